"""Token-tree attention (AttentionMetadata.tree): a tree node's logits are bit for bit those of
its path fed as a chain, on the fused quantized decoder and on the per-query PyTorch attention,
whatever else the batch holds."""
from __future__ import annotations

import pytest
import torch

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.llama import ForwardBatch
from agentrt.kernels.quant_decoder import TreeKeys
from agentrt.spec.tree_verify import node_depths

PROMPTS = ["The quick brown fox jumps over the lazy dog. The capital of France is", "def fib(n):\n    return"]


class Feeds:
    """A KV cache fed per sequence: chains (tokens at consecutive positions) or one root token
    followed by a token tree (node i at slot base + i, position base + depth)."""

    def __init__(self, m, blocks=64, block_size=16):
        self.m, self.done = m, {}
        self.bm, self.kv = BlockManager(blocks, block_size), KVCache(m.cfg, blocks * block_size, block_size, m.kv_dtype)

    def step(self, feeds: list[tuple[list[int], list[int] | None]], invariant: bool = False):
        """feeds: per sequence (tokens, parents of tokens[1:] or None for a chain)."""
        ids, pos, slots, ctx, bases, paths = [], [], [], [], [], []
        for sid, (toks, parents) in enumerate(feeds):
            s = self.done.get(sid, 0)
            self.bm.grow(sid, s + len(toks))
            sl = self.bm.slots(sid, s, s + len(toks))
            ids += toks
            slots += sl
            ctx.append(s + len(toks))
            if parents is None:
                pos += range(s, s + len(toks))
                bases += [p + 1 for p in range(s, s + len(toks))]
                paths += [[]] * len(toks)
                self.done[sid] = s + len(toks)
                continue
            depth = node_depths(parents)
            pos += [s] + [s + 1 + dd for dd in depth]
            bases += [s + 1] * len(toks)
            paths.append([])
            for i in range(len(parents)):
                path, j = [], i
                while j >= 0:
                    path.append(sl[1 + j])
                    j = parents[j]
                paths.append(path[::-1])
        width = max(1, max(len(p) for p in paths))
        tree = TreeKeys(torch.tensor(bases), torch.tensor([p + [0] * (width - len(p)) for p in paths]))
        positions = torch.tensor(pos)
        meta = build_attention_metadata([len(f[0]) for f in feeds], ctx, positions,
                                        [self.bm.tables[i] for i in range(len(feeds))], self.bm.block_size,
                                        torch.device("cpu"))
        if any(f[1] is not None for f in feeds):
            meta.tree = tree
        batch = ForwardBatch(torch.tensor(ids), positions, torch.tensor(slots), meta, None)
        return self.m.forward(batch, self.kv, batch_invariant=invariant).logits


def _paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's path from the root child, as node indices."""
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("path_kind", ["fused", "torch"])
def test_tree_rows_equal_chain_rows_bit_for_bit(smollm2_quant, path_kind: str) -> None:
    m, tok = smollm2_quant.model, smollm2_quant.tokenizer
    m.quant_fused = path_kind == "fused"
    try:
        prompts = [tok.encode(p) for p in PROMPTS]
        root = tok.encode(" Paris")[:1]
        tokens = tok.encode(" and the capital city of Spain is Madrid")[:7]
        parents = [-1, -1, 0, 0, 1, 2, 5]  # 2 root children, 2 under the first, a chain of 3 under one
        tree_cache, chain_cache = Feeds(m), Feeds(m)
        # a neighbour with a plain chain in the same batch: it must not change the tree's bits
        neighbour = (tok.encode(" 1, 2, 3"), None)
        tree_cache.step([(prompts[0], None), (prompts[1], None)], invariant=True)
        tree_logits = tree_cache.step([(root + tokens, parents), neighbour], invariant=True)
        for node, path in enumerate(_paths(tokens, parents)):
            chain_cache.done.clear()
            chain_cache.bm = BlockManager(64, 16)
            chain_cache.step([(prompts[0], None), (prompts[1], None)], invariant=True)
            chain = chain_cache.step([(root + [tokens[j] for j in path], None)], invariant=True)
            assert torch.equal(tree_logits[1 + node], chain[-1]), (path_kind, node, path)
            if node == 0:
                assert torch.equal(tree_logits[0], chain[0])  # the root's own row
    finally:
        m.quant_fused = True


def test_bad_tree_paths_are_refused(smollm2_quant) -> None:
    m, tok = smollm2_quant.model, smollm2_quant.tokenizer
    feeds = Feeds(m)
    feeds.step([(tok.encode("Hello there"), None)])
    meta = build_attention_metadata([2], [feeds.done[0] + 2], torch.tensor([feeds.done[0], feeds.done[0] + 1]),
                                    [feeds.bm.tables[0]], 16, torch.device("cpu"))
    feeds.bm.grow(0, feeds.done[0] + 2)
    meta.tree = TreeKeys(torch.tensor([feeds.done[0] + 1] * 2), torch.tensor([[0], [10**9]]))  # a slot past the cache
    batch = ForwardBatch(torch.tensor([1, 2]), meta.positions, torch.tensor(feeds.bm.slots(0, feeds.done[0],
                                                                                          feeds.done[0] + 2)), meta)
    with pytest.raises(IndexError, match="out of range"):
        m.forward(batch, feeds.kv)


def test_accepted_path_compacted_then_decoding_goes_on_as_after_the_chain(smollm2_quant) -> None:
    """A tree step, its second branch accepted, its K/V moved to the chain's slots
    (step_tree.compact_accepted), the cache cut there: the next token's logits are bit for bit
    those after the same path fed as a chain."""
    from types import SimpleNamespace

    from agentrt.engine.step.step_tree import compact_accepted

    m, tok = smollm2_quant.model, smollm2_quant.tokenizer
    prompt, root = tok.encode(PROMPTS[0]), tok.encode(" Paris")[:1]
    tokens = tok.encode(" and the capital city of Spain")[:6]
    parents = [-1, -1, 0, 1, 3, 4]  # branch A: 0, 2; branch B: 1, 3, 4, 5
    accepted = (1, 3, 4)
    tree, chain = Feeds(m), Feeds(m)
    for f in (tree, chain):
        f.step([(prompt, None)])
    start = tree.done[0]
    tree.step([(root + tokens, parents)])
    row = SimpleNamespace(start=start, num_new=1, seq=SimpleNamespace(seq_id=0), end=start + 1 + len(tokens))
    compact_accepted(row, accepted, tree.bm, tree.kv)
    tree.done[0] = start + 1 + len(accepted)
    tree.bm.truncate(0, tree.done[0])
    chain.step([(root + [tokens[j] for j in accepted], None)])
    nxt = tok.encode(" is")[:1]
    assert torch.equal(tree.step([(nxt, None)]), chain.step([(nxt, None)]))
