"""Online acceptance-rate (α) estimates, per sequence and drafter.

Acceptance is bursty within a request (copying a span of the prompt, then free prose), so the
estimate is a Beta posterior whose evidence decays with a half-life counted in observed draft
tokens and another counted in verification steps (an all-accepted step yields many observations,
a rejection at the first draft only one; the step half-life stops a long accepted run from
outweighing the next few rejections): a burst moves it within a few verification steps. New sequences start from a per-drafter
prior that itself learns, more slowly, from every sequence of that drafter.

Observations are censored by the stopping rule: verification stops at the first rejection, so
"num_accepted of num_drafted" is num_accepted successes followed by one failure (none when every
draft was accepted); the drafts after the rejection were never tested. That is exactly the Beta
update below (the likelihood is α^s (1 - α)^f). Counting num_drafted - num_accepted failures
would bias α down, more so the deeper the drafts.

Grammar-forced draft positions are accepted by construction (α = 1); they carry no information
about the drafter's free tokens and are left out of the estimate.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from agentrt.errors import SpecConfigError


@dataclass(frozen=True)
class AlphaPrior:
    """Beta(mean * strength, (1 - mean) * strength): strength is in pseudo-tokens."""

    mean: float
    strength: float = 4.0

    def __post_init__(self) -> None:
        if not (0.0 < self.mean < 1.0):
            raise SpecConfigError(f"AlphaPrior.mean must be in (0, 1), got {self.mean!r}")
        if not (self.strength > 0.0) or math.isinf(self.strength):
            raise SpecConfigError(f"AlphaPrior.strength must be finite and > 0, got {self.strength!r}")


DEFAULT_PRIOR = AlphaPrior(mean=0.5, strength=4.0)


def _decay_factor(half_life: float) -> float:
    if not (half_life > 0.0):
        raise SpecConfigError(f"half_life_tokens and half_life_steps must be > 0, got {half_life!r}")
    return 0.5 ** (1.0 / half_life) if math.isfinite(half_life) else 1.0


class OnlineAlpha:
    """α of one drafter on one sequence: prior pseudo-counts plus decayed evidence counts.
    `shared`, when given, receives every observation too (the drafter's cross-request estimate)."""

    def __init__(
        self,
        prior: AlphaPrior = DEFAULT_PRIOR,
        half_life_tokens: float = 12.0,
        half_life_steps: float = 4.0,
        shared: "OnlineAlpha | None" = None,
    ) -> None:
        self.prior = prior
        self.half_life_tokens = half_life_tokens
        self.half_life_steps = half_life_steps
        self._gamma = _decay_factor(half_life_tokens)
        self._step_gamma = _decay_factor(half_life_steps)
        self._successes = 0.0  # decayed evidence
        self._failures = 0.0
        self.total_drafted = 0  # undecayed counts, for reports
        self.total_accepted = 0
        self.total_forced = 0
        self._shared = shared

    def update(self, num_drafted: int, num_accepted: int, forced: int = 0) -> None:
        """One verification: num_accepted of num_drafted drafts accepted, `forced` of the accepted
        ones grammar-forced. Successes (num_accepted - forced, oldest first) then at most one
        failure enter the estimate; the newest observation weighs most."""
        if not (0 <= forced <= num_accepted <= num_drafted):
            raise SpecConfigError(
                f"OnlineAlpha.update needs 0 <= forced <= num_accepted <= num_drafted, "
                f"got forced={forced}, num_accepted={num_accepted}, num_drafted={num_drafted}"
            )
        s = num_accepted - forced
        f = 1 if num_accepted < num_drafted else 0
        g = self._gamma
        age = self._step_gamma * g ** (s + f)  # how much this step ages the earlier evidence
        # observations in time order: s successes, then f failures; each later one ages the earlier
        self._successes = self._successes * age + g**f * _geometric_sum(g, s)
        self._failures = self._failures * age + _geometric_sum(g, f)
        self.total_drafted += num_drafted
        self.total_accepted += num_accepted
        self.total_forced += forced
        if self._shared is not None:
            self._shared.update(num_drafted, num_accepted, forced)

    def tick(self) -> None:
        """A step without drafts: age the evidence one step (not forwarded to `shared`). Without
        it a sequence whose α once collapsed would never draft again and never find out that
        its acceptance recovered; with it the estimate drifts back to the prior and re-probes."""
        self._successes *= self._step_gamma
        self._failures *= self._step_gamma

    def estimate(self) -> float:
        """Posterior mean of α for the drafter's free (not grammar-forced) tokens."""
        a = self.prior.mean * self.prior.strength + self._successes
        b = (1.0 - self.prior.mean) * self.prior.strength + self._failures
        return a / (a + b)

    @property
    def evidence_tokens(self) -> float:
        """Decayed number of observed free tokens behind the estimate (its effective sample size)."""
        return self._successes + self._failures

    def accept_probs(self, k: int, forced_positions: Sequence[int] = ()) -> list[float]:
        """Per-position acceptance probabilities for a k-token draft: α, or 1.0 where the grammar
        forces the token (controller.SeqDraftState.accept_probs)."""
        a, forced = self.estimate(), set(forced_positions)
        return [1.0 if j in forced else a for j in range(k)]


def _geometric_sum(g: float, count: int) -> float:
    """sum_{i<count} g^i: the total weight of `count` observations, the newest weighing 1."""
    return float(count) if g == 1.0 else (1.0 - g**count) / (1.0 - g)


class AlphaRegistry:
    """Per-drafter α learned across requests; each new sequence starts from it.

    The shared estimate uses a long half-life (the workload drifts slowly); a sequence's estimate
    uses a short one and a weak prior (strength pseudo-tokens) centred on the shared value, so it
    adapts within a few steps yet starts where that drafter has recently been."""

    def __init__(
        self,
        priors: dict[str, AlphaPrior] | None = None,
        default: AlphaPrior = DEFAULT_PRIOR,
        shared_half_life_tokens: float = 4096.0,
        seq_half_life_tokens: float = 12.0,
        seq_half_life_steps: float = 4.0,
        seq_prior_strength: float = 4.0,
    ) -> None:
        self._priors = dict(priors or {})
        self.default = default
        self.shared_half_life_tokens = shared_half_life_tokens
        self.seq_half_life_tokens = seq_half_life_tokens
        self.seq_half_life_steps = seq_half_life_steps
        self.seq_prior_strength = seq_prior_strength
        self._shared: dict[str, OnlineAlpha] = {}

    def shared(self, drafter: str) -> OnlineAlpha:
        if drafter not in self._shared:
            prior = self._priors.get(drafter, self.default)
            self._shared[drafter] = OnlineAlpha(prior, self.shared_half_life_tokens, half_life_steps=math.inf)
        return self._shared[drafter]

    def estimate(self, drafter: str) -> float:
        return self.shared(drafter).estimate()

    def new_sequence(self, drafter: str) -> OnlineAlpha:
        """An estimator for one sequence; its updates also teach the drafter's shared estimate."""
        shared = self.shared(drafter)
        prior = AlphaPrior(_clip(shared.estimate()), self.seq_prior_strength)
        return OnlineAlpha(prior, self.seq_half_life_tokens, self.seq_half_life_steps, shared=shared)


def _clip(a: float) -> float:
    return min(1.0 - 1e-6, max(1e-6, a))
