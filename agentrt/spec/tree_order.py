"""A token tree priced for the k controller, which sizes a draft by the length of the prefix it
verifies and prices position j by prod_{i<=j} a_i (arithmetic.marginal_gains: a chain's
P(reach j)).

A tree's node is worth the probability that verification reaches it: the path to it accepted,

    reach(node) = reach(parent) * a(node),   reach(root) = 1,

with a(node) = P(node accepted | parent accepted). Siblings are exclusive (the target's token at
their parent is one of them at most), so a parent's children share at most probability 1: where
their a's add up to more, they are scaled down to add up to 1.

Listed in the drafter's order (a trie level by level, base.branch_tree), a tree's second child
sits behind its first child's whole chance of rejection: the controller, reading the list as a
chain, prices every later sibling at P(first sibling accepted) times its own, next to nothing,
and cuts the tree to one branch. Listed by decreasing reach instead, a prefix of any length is
the most valuable set of nodes of that size (a child never reaches more often than its parent,
so parents still come first), and the chain-equivalent a'_j = reach_j / reach_{j-1} makes the
controller's prod_{i<=j} a'_i exactly reach_j: the expected accepted tokens of the first k nodes
are the sum of their reach, as they are for a tree.
"""
from __future__ import annotations

from collections.abc import Sequence

from agentrt.errors import SpecError
from agentrt.spec.drafters.base import Draft


def reach(parents: Sequence[int], accept: Sequence[float]) -> list[float]:
    """Each node's probability of being reached (its path accepted), siblings' a scaled down to
    add up to at most 1. parents[i] < i (-1: the root)."""
    if len(parents) != len(accept):
        raise SpecError(f"reach: {len(parents)} parents for {len(accept)} acceptance probabilities")
    share: dict[int, float] = {}
    for p, a in zip(parents, accept):
        if not 0.0 <= a <= 1.0:
            raise SpecError(f"reach: acceptance probabilities must lie in [0, 1], got {a}")
        share[p] = share.get(p, 0.0) + a
    out: list[float] = []
    for i, (p, a) in enumerate(zip(parents, accept)):
        if not -1 <= p < i:
            raise SpecError(f"reach: node {i}'s parent {p} does not come before it")
        out.append((1.0 if p < 0 else out[p]) * a / max(1.0, share[p]))
    return out


def by_reach(draft: Draft, accept: Sequence[float]) -> tuple[Draft, list[float]]:
    """The tree's nodes by decreasing reach (ties in the drafter's order, so a parent stays before
    a child that reaches as often), and the chain-equivalent acceptance per position (see the
    module docstring). A chain comes back as it was, with `accept`."""
    if draft.parents is None:
        return draft, list(accept)
    r = reach(draft.parents, accept)
    order = sorted(range(len(r)), key=lambda i: (-r[i], i))
    new = {old: j for j, old in enumerate(order)}
    reordered = Draft(tokens=[draft.tokens[i] for i in order], probs=None,
                      confidence=[draft.confidence[i] for i in order],
                      forced=[draft.forced[i] for i in order] if draft.forced else [],
                      parents=[-1 if draft.parents[i] < 0 else new[draft.parents[i]] for i in order])
    chain, before = [], 1.0
    for i in order:
        chain.append(min(1.0, r[i] / before) if before > 0 else 0.0)
        before = r[i]
    return reordered, chain


def accepted_path(parents: Sequence[int], tokens: Sequence[int], kept: Sequence[int],
                  accepted: int) -> tuple[list[int], bool]:
    """The nodes verification accepted (kept[:accepted] followed down from the root), and whether
    it rejected below them: the path's last node (or the root) has children. On a tree the
    online α counts the path's levels, each one trial whichever sibling passed, and one failure
    only where a level was tried and missed (k nodes with L accepted is not k - L failures)."""
    at, path = -1, []
    for t in kept[:accepted]:
        nxt = next((i for i, (p, tok) in enumerate(zip(parents, tokens)) if p == at and tok == t), None)
        if nxt is None:
            break
        path.append(nxt)
        at = nxt
    return path, any(p == at for p in parents)
