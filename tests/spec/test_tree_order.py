"""A token tree as the k controller prices it (spec/tree_order.py): nodes by decreasing reach,
parents first, and chain-equivalent acceptances whose running product is each node's reach; the
accepted path and its one missed level, as the online α counts them."""
from __future__ import annotations

import math

import pytest

from agentrt.errors import SpecError
from agentrt.spec.arithmetic import expected_accepted, marginal_gains
from agentrt.spec.drafters.base import Draft
from agentrt.spec.tree_order import accepted_path, by_reach, reach

#        root
#       /    \
#   0:a(.3)  1:b(.6)          siblings: .3 + .6 <= 1, kept as they are
#     |        |
#   2:c(1)   3:d(.5)
#              |
#            4:e(1)
PARENTS = [-1, -1, 0, 1, 3]
ACCEPT = [0.3, 0.6, 1.0, 0.5, 1.0]


def _tree() -> Draft:
    return Draft(tokens=[10, 11, 12, 13, 14], probs=None, confidence=[0.3, 0.6, 1.0, 0.5, 1.0],
                 forced=[False, False, True, False, True], parents=PARENTS)


def test_reach_is_the_path_product_with_siblings_sharing_at_most_one():
    assert reach(PARENTS, ACCEPT) == pytest.approx([0.3, 0.6, 0.3, 0.3, 0.3])
    # three children claiming .8 each share 1: each reaches 1/3 of its parent
    assert reach([-1, 0, 0, 0], [1.0, 0.8, 0.8, 0.8]) == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    with pytest.raises(SpecError, match="before it"):
        reach([1, -1], [0.5, 0.5])
    with pytest.raises(SpecError, match=r"\[0, 1\]"):
        reach([-1], [1.5])


def test_by_reach_orders_nodes_parents_first_and_prices_prefixes_as_the_tree():
    d, chain = by_reach(_tree(), ACCEPT)
    # b first (.6), then a, its child c, d and e (.3 each, ties in the drafter's order)
    assert d.tokens == [11, 10, 12, 13, 14]
    assert d.parents == [-1, -1, 1, 0, 3]
    assert d.forced == [False, False, True, False, True] and d.confidence == [0.6, 0.3, 1.0, 0.5, 1.0]
    assert all(p < i for i, p in enumerate(d.parents))
    # the controller's running product is each node's reach: a prefix's expected accepted tokens
    # are the sum of its nodes' reach
    assert marginal_gains(chain) == pytest.approx([0.6, 0.3, 0.3, 0.3, 0.3])
    assert expected_accepted(chain[:2]) == pytest.approx(0.9)
    # a truncation keeps a valid tree of the likeliest nodes
    assert d.truncated(2).parents == [-1, -1]


def test_a_chain_comes_back_unchanged():
    chain = Draft(tokens=[1, 2, 3], probs=None, confidence=[0.9, 0.9, 0.9])
    d, accept = by_reach(chain, [0.9, 0.8, 0.7])
    assert d is chain and accept == [0.9, 0.8, 0.7]


def test_unreachable_nodes_are_worth_nothing():
    d, chain = by_reach(Draft(tokens=[1, 2, 3], probs=None, confidence=[0.0, 1.0, 1.0], parents=[-1, 0, -1]),
                        [0.0, 1.0, 1.0])
    assert d.tokens == [3, 1, 2] and chain == [1.0, 0.0, 0.0]
    assert not any(math.isnan(x) for x in chain)


def test_accepted_path_and_the_missed_level():
    tokens = _tree().tokens
    # b, d accepted, e (its only child) not: one level missed below d
    assert accepted_path(PARENTS, tokens, [11, 13, 99], 2) == ([1, 3], True)
    # a, c accepted: c is a leaf, nothing was missed
    assert accepted_path(PARENTS, tokens, [10, 12, 7], 2) == ([0, 2], False)
    # nothing accepted below the root, whose children were tried
    assert accepted_path(PARENTS, tokens, [55], 0) == ([], True)
