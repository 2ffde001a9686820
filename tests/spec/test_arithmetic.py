"""The acceptance arithmetic against independent computations: the accepted-length distribution
enumerated term by term, and every accept/reject pattern enumerated."""
import itertools
import math

import pytest

from agentrt.errors import SpecConfigError
from agentrt.spec.arithmetic import (
    expected_accepted,
    expected_tokens,
    expected_tokens_positional,
    marginal_gains,
)


def expected_by_distribution(alpha: float, k: int) -> float:
    # accepted length L: P(L = j) = alpha^j (1 - alpha) for j < k, P(L = k) = alpha^k; emitted = 1 + L
    probs = [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]
    assert math.isclose(sum(probs), 1.0)
    return sum((1 + j) * p for j, p in enumerate(probs))


def expected_by_patterns(accept_probs: list[float]) -> float:
    # walk every accept/reject outcome of every position with the stopping rule
    total = 0.0
    for outcome in itertools.product([True, False], repeat=len(accept_probs)):
        p = math.prod(a if ok else 1 - a for a, ok in zip(accept_probs, outcome))
        accepted = next((j for j, ok in enumerate(outcome) if not ok), len(outcome))
        total += p * (1 + accepted)
    return total


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 0.9, 0.999999, 1.0])
@pytest.mark.parametrize("k", [0, 1, 2, 5, 12])
def test_expected_tokens_matches_distribution(alpha, k):
    assert expected_tokens(alpha, k) == pytest.approx(expected_by_distribution(alpha, k), rel=1e-9)


def test_expected_tokens_limits():
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(0.8, 200) == pytest.approx(5.0)  # ceiling 1 / (1 - alpha)


@pytest.mark.parametrize(
    "probs", [[], [0.7], [0.9, 0.5, 1.0], [1.0, 1.0, 1.0, 0.2, 0.8], [0.3, 0.0, 0.9], [0.6] * 6]
)
def test_positional_matches_enumerated_patterns(probs):
    assert expected_tokens_positional(probs) == pytest.approx(expected_by_patterns(probs), rel=1e-12)
    # the accepted drafts are the emitted tokens less the target's own one
    assert expected_accepted(probs) == pytest.approx(expected_by_patterns(probs) - 1.0, abs=1e-12)


def test_positional_with_equal_probs_is_the_closed_form_and_forced_positions_count_fully():
    assert expected_tokens_positional([0.8] * 5) == pytest.approx(expected_tokens(0.8, 5))
    assert expected_tokens_positional([1.0] * 4) == 5.0
    gains = marginal_gains([1.0, 1.0, 0.5, 0.5])
    assert gains == [1.0, 1.0, 0.5, 0.25]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_bad_alpha_is_named(bad):
    with pytest.raises(SpecConfigError, match="alpha"):
        expected_tokens(bad, 3)
    with pytest.raises(SpecConfigError, match=r"accept_probs\[1\]"):
        expected_tokens_positional([0.5, bad])
    with pytest.raises(SpecConfigError, match=r"accept_probs\[1\]"):
        marginal_gains([0.5, bad])
    with pytest.raises(SpecConfigError, match=r"accept_probs\[1\]"):
        expected_accepted([0.5, bad])


def test_bad_k():
    with pytest.raises(SpecConfigError, match="non-negative integer draft length, got -1"):
        expected_tokens(0.5, -1)
