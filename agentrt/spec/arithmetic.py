"""The acceptance arithmetic of speculative decoding (Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", 2023): expected tokens per pass.

A verification pass over k drafts emits 1 + (length of the accepted prefix) tokens: the target's
own token at the first rejection (or after the last draft) is emitted either way.
"""
from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

from agentrt.errors import SpecConfigError


def _check_alpha(alpha: float, what: str = "alpha") -> float:
    a = float(alpha)
    if not (0.0 <= a <= 1.0) or math.isnan(a):
        raise SpecConfigError(f"{what} must be an acceptance probability in [0, 1], got {alpha!r}")
    return a


def _check_k(k: int, what: str = "k") -> int:
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise SpecConfigError(f"{what} must be a non-negative integer draft length, got {k!r}")
    return int(k)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one verification of k drafts with i.i.d. acceptance alpha:
    expected_accepted's sum with every position at alpha (the closed form
    (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1), plus the target's own token."""
    a, k = _check_alpha(alpha), _check_k(k)
    return expected_tokens_positional([a] * k)


def expected_accepted(accept_probs: Sequence[float]) -> float:
    """Expected accepted drafts when draft position j is accepted with probability accept_probs[j]
    given that every earlier draft was: sum_j prod_{i<=j} a_i (the sum of the marginal gains).
    Grammar-forced positions have a = 1; len(accept_probs) is the draft length. The one formula
    of the expectation: the others here, the k controller's and the engine's draft plan call it."""
    return sum(marginal_gains(accept_probs), 0.0)


def expected_tokens_positional(accept_probs: Sequence[float]) -> float:
    """Expected tokens emitted by that pass: the accepted drafts plus the target's own token."""
    return 1.0 + expected_accepted(accept_probs)


def marginal_gains(accept_probs: Sequence[float]) -> list[float]:
    """Expected extra tokens from drafting position j+1 on top of j drafts: prod_{i<=j} a_i.
    Non-increasing, because every factor is <= 1 (the reason greedy allocation works)."""
    probs = [float(p) for p in accept_probs]
    if not all(0.0 <= p <= 1.0 for p in probs):  # also false for NaN
        j = next(j for j, p in enumerate(probs) if not 0.0 <= p <= 1.0)
        _check_alpha(probs[j], f"accept_probs[{j}]")
    return list(itertools.accumulate(probs, operator.mul))

