"""Tree verification (spec.tree_verify): equal to the chain rule on chains, equal to its per-node
reference, and exact: the emitted tokens follow the target's distribution."""
from __future__ import annotations

import pytest
import torch

from agentrt.errors import SpecError
from agentrt.spec.tree_verify import node_depths, verify_tree, verify_tree_greedy, verify_tree_reference
from agentrt.spec.verify import verify_drafts, verify_greedy


def _emitted(res) -> list[list[int]]:
    return [toks[:n] for toks, n in zip(res.output_tokens.tolist(), res.num_emitted.tolist())]


def _chains(gen: torch.Generator, ks: list[int], vocab: int, peaked: bool):
    """A ragged batch of chains: drafts that are often the target's likely token."""
    rows = sum(k + 1 for k in ks)
    logits = torch.randn(rows, vocab, generator=gen) * (4.0 if peaked else 1.0)
    probs = torch.softmax(logits, -1)
    drafts, parents, row = [], [], 0
    for k in ks:
        for j in range(k):
            best = int(probs[row + j].argmax())
            drafts.append(best if torch.rand((), generator=gen) < 0.7 else int(torch.randint(vocab, (), generator=gen)))
            parents.append(j - 1)
        row += k + 1
    cu = torch.tensor([0] + torch.tensor(ks).cumsum(0).tolist(), dtype=torch.long)
    return probs, torch.tensor(drafts, dtype=torch.long), torch.tensor(parents, dtype=torch.long), cu


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_chain_shaped_tree_is_the_chain_rule_bit_for_bit(seed: int, peaked: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    ks = [3, 0, 5, 1, 4]
    probs, drafts, parents, cu = _chains(gen, ks, 50, peaked)
    for _ in range(5):
        u_acc, u_smp = torch.rand(drafts.numel(), generator=gen), torch.rand(len(ks), generator=gen)
        chain = verify_drafts(probs, drafts, cu, None, u_acc, u_smp)
        tree = verify_tree(probs, drafts, parents, cu, u_acc, u_smp)
        assert _emitted(tree) == _emitted(chain)
        assert tree.num_accepted.tolist() == chain.num_accepted.tolist()
        assert all(list(p) == list(range(n)) for p, n in zip(tree.accepted_nodes, chain.num_accepted.tolist()))
    best = probs.argmax(-1)
    assert _emitted(verify_tree_greedy(best, drafts, parents, cu)) == _emitted(verify_greedy(best, drafts, cu))
    one_hot = torch.nn.functional.one_hot(best, 50).float()  # temperature 0: the greedy rule
    u_acc, u_smp = torch.rand(drafts.numel(), generator=gen), torch.rand(len(ks), generator=gen)
    assert _emitted(verify_tree(one_hot, drafts, parents, cu, u_acc, u_smp)) == _emitted(verify_greedy(best, drafts, cu))


def _tree_batch(gen: torch.Generator, B: int, vocab: int, sharpness: float = 2.0):
    """B copies of one tree (3 root children, 2 under the first two, 1 under one of those),
    each copy with its own target rows."""
    parents = [-1, -1, -1, 0, 0, 1, 1, 3]
    base = torch.randperm(vocab, generator=gen)[:8].tolist()
    toks = [base[0], base[1], base[2], base[3], base[4], base[3], base[5], base[6]]
    n = len(parents)
    probs = torch.softmax(torch.randn(B * (n + 1), vocab, generator=gen) * sharpness, -1)
    cu = torch.arange(B + 1, dtype=torch.long) * n
    return probs, torch.tensor(toks * B), torch.tensor(parents * B), cu


@pytest.mark.parametrize("seed", range(3))
def test_tree_matches_its_per_node_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    probs, toks, parents, cu = _tree_batch(gen, 12, 9)
    for _ in range(10):
        u_acc, u_smp = torch.rand(toks.numel(), generator=gen), torch.rand(12, generator=gen)
        fast = verify_tree(probs, toks, parents, cu, u_acc, u_smp)
        ref = verify_tree_reference(probs, toks, parents, cu, u_acc, u_smp)
        assert _emitted(fast) == _emitted(ref) and fast.accepted_nodes == ref.accepted_nodes


def test_greedy_tree_walks_to_the_targets_tokens() -> None:
    # root children 7, 8; under 8: 1, 2; under 2: 3.  rows: root, n0, n1, n2, n3, n4
    toks, parents = torch.tensor([7, 8, 1, 2, 3]), torch.tensor([-1, -1, 1, 1, 3])
    cu = torch.tensor([0, 5])
    best = torch.tensor([8, 0, 2, 0, 3, 9])  # root->8 (n1), n1->2 (n3), n3->3 (n4), n4 -> bonus 9
    res = verify_tree_greedy(best, toks, parents, cu)
    assert _emitted(res) == [[8, 2, 3, 9]] and res.accepted_nodes == ((1, 3, 4),)
    best = torch.tensor([7, 5, 0, 0, 0, 0])  # root->7 (n0), n0 has no children: emit 5
    assert _emitted(verify_tree_greedy(best, toks, parents, cu)) == [[7, 5]]


def test_emitted_tokens_follow_the_target_distribution() -> None:
    """T=1 sampling over many copies of one tree: the first emitted token follows the root's p,
    and the second, given the first was a node with its own row, that node's p (TV bound)."""
    gen = torch.Generator().manual_seed(0)
    B, vocab = 20000, 9
    probs1, toks, parents, cu = _tree_batch(gen, 1, vocab, sharpness=0.5)
    n = parents.numel()
    probs = probs1.repeat(B, 1)
    res = verify_tree(probs, toks.repeat(B), parents.repeat(B), torch.arange(B + 1) * n,
                      torch.rand(B * n, generator=gen), torch.rand(B, generator=gen))
    out = res.output_tokens
    first = torch.bincount(out[:, 0], minlength=vocab).float() / B
    assert 0.5 * (first - probs1[0]).abs().sum() < 0.02
    root_kids = {int(toks[j]): j for j in range(n) if int(parents[j]) == -1}
    for tok, node in root_kids.items():
        took = out[:, 0] == tok
        assert int(took.sum()) > 1000  # each root child is likely enough to bound its row's TV
        second = torch.bincount(out[took, 1], minlength=vocab).float() / int(took.sum())
        assert 0.5 * (second - probs1[node + 1]).abs().sum() < 0.05, tok
    assert (res.num_accepted >= 1).float().mean() > (probs1[0, list(root_kids)].sum() - 0.02)


def test_bad_trees_are_refused() -> None:
    assert node_depths([-1, 0, 0, 2, -1]) == [0, 1, 1, 2, 0]
    with pytest.raises(SpecError, match="parent"):
        node_depths([-1, 2, 0])
    with pytest.raises(SpecError, match="sibling"):
        verify_tree_greedy(torch.zeros(3, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([-1, -1]),
                           torch.tensor([0, 2]))
