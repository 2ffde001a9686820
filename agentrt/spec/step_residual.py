"""What the engine's steps cost beyond the step-cost model's prediction, learned from the steps.

The cost model is fitted on bare target forwards, each the fastest of several (engine.calibration),
and its form is a roofline: flat while the weights' read dominates, then a slope per row. An
engine step costs more, and not by a constant factor: it also schedules, drafts, samples and
verifies, commits and detokenizes (~0.3-0.8 ms a step on the embedded model), and on the
quantized path a forward of 2 rows costs ~1.25x one row where the roofline sees a flat start
(one-row linears run another kernel than multi-row ones). Measured on a Zen 4 EPYC, SmolLM2-135M
Q4 at ~780 tokens of context: 1, 2, 5, 9 and 15 rows took 5.5, 6.8, 8.9, 13.3 and 17.8 ms a step
where the fit predicted 4.9, 5.0, 6.2, 9.8 and 15.8. Priced by the bare fit, the first draft
looks free and the fifteenth ~3x dearer (relative to the step) than it is.

So the engine learns the difference: per count of rows a step feeds (one bucket per count up to
16, then one per power of two), the median of the last `window` decode steps' measured time
minus the fit's prediction; a median, because a step another process delayed is an outlier,
not a cost. A count without `min_samples` steps yet takes the residual interpolated between the
nearest learned counts; below the smallest, the smallest's; before any step, none. Past the
largest learned count the residual goes on along the learned counts' trend (a least-squares
line over those from half the largest up, and of 2+ rows: one row runs kernels of its own), up
to twice that count, then holds. Why not hold at once: a fit whose slope is off (timed while
another process held a core, say) leaves a residual that changes with the rows, and held flat it
keeps pricing the next rows as the fit does, so the controller never drafts deep enough to learn
what they cost. Steps that
prefill are left out: a prompt chunk's error is its own (attention over the chunk), and it
would be charged to the decode rows sharing its bucket.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque

from agentrt.errors import SpecConfigError

EXACT_ROWS = 16  # one bucket per row count up to here (a one-sequence verify's whole range)


def bucket_of(num_tokens: int) -> int:
    """The bucket's representative row count: num_tokens itself up to EXACT_ROWS, else the
    power of two at or below it."""
    if num_tokens < 1:
        raise SpecConfigError(f"a step feeds at least one row, got {num_tokens}")
    return num_tokens if num_tokens <= EXACT_ROWS else 1 << (num_tokens.bit_length() - 1)


class StepResidual:
    """Measured step seconds minus the cost model's prediction, by the step's row count."""

    def __init__(self, window: int = 32, min_samples: int = 3) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise SpecConfigError(f"StepResidual needs window >= 1 and 1 <= min_samples <= window, "
                                  f"got {window}, {min_samples}")
        self.window = window
        self.min_samples = min_samples
        self._samples: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}  # the buckets with min_samples steps: their median residual
        self._learned: list[int] = []  # those buckets, ascending
        self._slope = 0.0  # seconds a row along the learned buckets' trend (see _trend)

    def observe(self, num_tokens: int, measured_s: float, predicted_s: float) -> None:
        """One decode step that fed num_tokens rows took measured_s; the fit predicted predicted_s."""
        b = bucket_of(num_tokens)
        samples = self._samples.setdefault(b, deque(maxlen=self.window))
        samples.append(measured_s - predicted_s)
        if len(samples) >= self.min_samples:
            if b not in self._median:
                bisect.insort(self._learned, b)
            self._median[b] = statistics.median(samples)
            self._slope = self._trend()

    def __call__(self, num_tokens: int) -> float:
        """Seconds to add to the fit's prediction for a step of num_tokens rows (may be < 0)."""
        learned = self._learned
        if not learned:
            return 0.0
        b = bucket_of(num_tokens)
        i = bisect.bisect_left(learned, b)
        if i < len(learned) and learned[i] == b:
            return self._median[b]
        if i == 0:
            return self._median[learned[0]]
        if i == len(learned):  # past the largest: along the trend, to twice the largest count
            top = learned[-1]
            return self._median[top] + self._slope * (min(b, 2 * top) - top)
        b0, b1 = learned[i - 1], learned[i]
        r0, r1 = self._median[b0], self._median[b1]
        return r0 + (r1 - r0) * (b - b0) / (b1 - b0)

    def _trend(self) -> float:
        """Least-squares seconds per row over the learned counts from half the largest up (and of
        2+ rows); 0 with fewer than two."""
        xs = [b for b in self._learned if b >= max(2, self._learned[-1] // 2)]
        if len(xs) < 2:
            return 0.0
        ys = [self._median[b] for b in xs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
