"""Online calibration of draft acceptance scores: what a score of 0.6 has actually meant lately.

The k controller needs, per draft position, the probability that the target accepts the token
given that every earlier draft of the step was accepted (controller.SeqDraftState.accept_probs).
A model-free drafter's confidence is only a score: it comes from occurrence counts and a prior
on match length, and the engine mixes it with the sequence's online α (spec_runner). Measured on
`bench workload`, scores of 0.5-0.8 were accepted 71-97% of the time, so the controller cut
drafts short that would have held (continuing a copy, once its first token is taken, is much
likelier than the count prior says).

So the engine learns the map score -> P(accept) from its own verifications: the score range is
cut into bins, each a Beta posterior over its acceptance rate with a prior centred on the bin's
midpoint (before any evidence the map is the identity), and evidence decays with a half-life
counted in observations (the workload drifts). Reading the map pools adjacent bins that violate
monotonicity (pool-adjacent-violators, weighted by evidence), so a higher score never maps to a
lower probability. Observations are censored as in spec.alpha: verification stops at the first
rejection, so the positions up to and including it were tested (successes, then one failure)
and the later ones were not. Grammar-forced positions are certain and are not scores at all.
"""
from __future__ import annotations

from collections.abc import Sequence

from agentrt.errors import SpecConfigError


class AcceptanceCalibration:
    def __init__(self, bins: int = 10, prior_strength: float = 8.0, half_life: float = 2048.0) -> None:
        if bins < 1 or not (prior_strength > 0.0) or not (half_life > 0.0):
            raise SpecConfigError(
                f"AcceptanceCalibration needs bins >= 1, prior_strength > 0 and half_life > 0, "
                f"got {bins}, {prior_strength}, {half_life}"
            )
        self.bins = bins
        self.prior_strength = prior_strength
        self._decay = 0.5 ** (1.0 / half_life)
        self._weight = 1.0  # weight of the next observation; grows instead of decaying all bins
        self._accepted = [0.0] * bins
        self._tested = [0.0] * bins
        self._map: list[float] | None = None  # calibrated probability per bin, rebuilt lazily

    def _bin(self, score: float) -> int:
        return min(self.bins - 1, max(0, int(score * self.bins)))

    def __call__(self, score: float) -> float:
        """P(accept | score, earlier drafts accepted)."""
        if self._map is None:
            self._map = self._fit()
        return self._map[self._bin(score)]

    def observe(self, scores: Sequence[float], accepted: int) -> None:
        """One verification of free draft positions scored `scores` (in draft order, forced ones
        left out): the first `accepted` held; the next, if any, was rejected."""
        if not 0 <= accepted <= len(scores):
            raise SpecConfigError(f"accepted must be in [0, {len(scores)}], got {accepted}")
        tested = scores[: accepted + 1]
        for j, s in enumerate(tested):
            b = self._bin(s)
            self._tested[b] += self._weight
            self._accepted[b] += self._weight if j < accepted else 0.0
            self._weight /= self._decay
        if self._weight > 1e12:  # rescale before the weights overflow; ratios stay the same
            self._accepted = [a / self._weight for a in self._accepted]
            self._tested = [t / self._weight for t in self._tested]
            self._weight = 1.0
        if tested:
            self._map = None

    @property
    def evidence(self) -> float:
        """Decayed number of observations behind the map (its effective sample size)."""
        return sum(self._tested) / self._weight

    def _fit(self) -> list[float]:
        # Beta posterior per bin (prior mean: the bin's midpoint), then pool adjacent violators
        blocks: list[list[float]] = []  # [successes, trials, bins pooled]
        for b in range(self.bins):
            mid = (b + 0.5) / self.bins
            blocks.append([mid * self.prior_strength + self._accepted[b] / self._weight,
                           self.prior_strength + self._tested[b] / self._weight, 1.0])
            while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
                s, n, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += n
                blocks[-1][2] += c
        out: list[float] = []
        for s, n, c in blocks:
            out += [s / n] * int(c)
        return out
