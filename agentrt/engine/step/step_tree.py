"""Token-tree drafts in a step: a StepRow whose `parents` is set feeds a tree of draft tokens
instead of a chain, verified in the same one forward (spec.tree_verify).

Layout: node i of a row's tree sits in the row's cache slot start + num_new + i (the slots a
chain of the same length would take, so the block manager reserves them the same way) but at
rotary position base + depth(i), base = start + num_new; its keys past base are its path's slots
(AttentionMetadata.tree), so its logits are bit for bit those of its path fed as a chain. After
verification `compact_accepted` moves the accepted path's K/V to the linear slots base..base+a-1
(in increasing depth: a node at depth d has index >= d, so no copy overwrites a node still to be
read) and the engine truncates the rest, which keeps the block manager's invariants.

Grammar masks: a node's row is masked by the grammar after its path (`tree_masks`, one walk per
leaf); a node the grammar forbids is dropped with its subtree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentrt.kernels.quant_decoder import TreeKeys
from agentrt.spec.tree_verify import node_depths

if TYPE_CHECKING:
    from agentrt.engine.kv.block_manager import BlockManager
    from agentrt.engine.kv.kv_cache import KVCache
    from agentrt.engine.step.step_rows import StepRow


def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def tree_positions(r: StepRow) -> list[int]:
    """Positions of the row's fed tokens, then of its tree's nodes (base + depth)."""
    base = r.start + r.num_new
    return list(range(r.start, base)) + [base + d for d in node_depths(r.parents)]


def _paths(parents: list[int]) -> list[list[int]]:
    """Each node's path of node indices, from its root child down to it."""
    paths: list[list[int]] = []
    for par in parents:
        paths.append((paths[par] if par >= 0 else []) + [len(paths)])
    return paths


def tree_keys(rows: list[StepRow], blocks: BlockManager) -> TreeKeys:
    """The batch's TreeKeys: per fed token, its tree's base position and its path's cache slots
    (a token outside any tree: base past its position, no path)."""
    bases: list[int] = []
    paths: list[list[int]] = []
    for r in rows:
        n = r.num_new + r.k
        if r.parents is None:
            bases += range(r.start + 1, r.start + n + 1)
            paths += [[]] * n
            continue
        base = r.start + r.num_new
        slots = blocks.slots(r.seq.seq_id, base, r.end)  # node i's slot: slots[i]
        bases += [base] * n
        paths += [[]] * r.num_new + [[slots[j] for j in p] for p in _paths(r.parents)]
    width = max(1, max(len(p) for p in paths))
    return TreeKeys(torch.tensor(bases, dtype=torch.long),
                    torch.tensor([p + [0] * (width - len(p)) for p in paths], dtype=torch.long))


def row_output_offsets(r: StepRow) -> list[int]:
    """Per logits row of r, the output position it samples, relative to the row's first: the
    root's 0, a node's depth + 1 (a chain's rows: 0..k)."""
    if r.parents is None:
        return list(range(r.k + 1))
    return [0] + [d + 1 for d in node_depths(r.parents)]


def tree_masks(grammar, tokens: list[int], parents: tuple[int, ...], bitmask: torch.Tensor) -> list[int]:
    """Fill bitmask [k + 1, words]: row 0 the grammar's mask now, row 1 + j the j-th kept node's
    (after its path). Returns the nodes the grammar allows (a forbidden node's subtree goes with
    it), in order: the draft plan keeps only those (engine.step.draft_plan)."""
    k = len(tokens)
    paths = _paths(parents)
    leaves = [i for i in range(k) if i not in set(parents)]
    scratch = torch.empty_like(bitmask[: max(len(p) for p in paths) + 1]) if paths else bitmask[:1]
    allowed = [False] * k
    grammar.fill_masks([], bitmask, 0)
    for leaf in leaves:
        path = paths[leaf]
        m = grammar.fill_masks([tokens[j] for j in path], scratch, 0)
        for depth, node in enumerate(path[:m]):
            allowed[node] = True
            bitmask[1 + node] = scratch[depth + 1]
    keep = [i for i in range(k) if allowed[i]]
    if len(keep) < k:
        bitmask[1 : 1 + len(keep)] = bitmask[[1 + i for i in keep]].clone()
    return keep


def kept_tree(parents: tuple[int, ...], keep: list[int]) -> tuple[int, ...]:
    """The parents of the nodes `keep` (each with its parent kept), renumbered in order."""
    new = {old: i for i, old in enumerate(keep)}
    return tuple(new[parents[i]] if parents[i] >= 0 else -1 for i in keep)


def compact_accepted(r: StepRow, accepted_nodes: tuple[int, ...], blocks: BlockManager, kv: KVCache) -> None:
    """Move the accepted path's K/V (every layer) from the nodes' slots to the linear slots
    base..base+a-1, in increasing depth (a node at depth d has index >= d: nothing still to be
    read is overwritten)."""
    base = r.start + r.num_new
    moves = [(base + node, base + depth) for depth, node in enumerate(accepted_nodes) if node != depth]
    if not moves:
        return
    slots = blocks.slots(r.seq.seq_id, base, r.end)
    src = torch.tensor([slots[a - base] for a, _ in moves], dtype=torch.long, device=kv.k[0].device)
    dst = torch.tensor([slots[b - base] for _, b in moves], dtype=torch.long, device=kv.k[0].device)
    for cache in (*kv.k, *kv.v):
        cache[dst] = cache[src]  # one gather, then one scatter: later sources are read before any write
