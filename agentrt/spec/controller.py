"""The k controller: how many tokens to draft for each running sequence this step.

Goodput = expected emitted tokens / predicted step time, where the step time is the target
forward over every sequence's k_i + 1 tokens and the prompt chunks fed in the same step
(StepPrefill; StepCostModel) plus drafting. While the step is memory-bound, extra verified
tokens cost no target time, so k is bounded only by α and the draft cost (deep drafts when
idle); once the step is compute-bound each extra token costs its full FLOP share and must pay
for itself at the current goodput (k falls to 0 when the batch is full; beside a long prompt
chunk, whose step is slow anyway, a likely draft still pays).

Greedy marginal allocation (SmartSpec-like). Why adding the best token until none improves is
enough: a sequence's marginal gains prod_{i<=j} a_i never increase (every a_i <= 1), and the
target time is convex in the tokens added (overhead + a sum of maxes of affine terms), so a later token
of a sequence never has a better gain per second than an earlier one. Kernels that multiply rows
in tiles add a step each time the rows pass a multiple of the tile (StepCostModel.row_tile), which
is not convex: the greedy runs within each count of tiles (a constant there), from the count the
step fills without drafts up, and the best of those allocations wins. It stops at the first count
the greedy does not fill: its last token already failed to pay at that count's goodput, and more
tiles only add their step. Where the tiles' rows run out, gain per second decides who gets the
last ones; that equals the best choice when every sequence's drafts cost the same per token (one
drafter per step, as the engine runs), checked against brute force in the tests.

The engine adds what its steps cost beyond the fitted model (`residual`, spec.step_residual): a
measured curve with no shape promised (on the quantized path the first draft row costs a jump
the fit does not see). With one sequence every k is priced and the best taken (at most kmax + 1
predictions), exact whatever the curve; with more, the greedy above runs on the corrected times.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from agentrt.errors import SpecConfigError
from agentrt.spec.arithmetic import expected_accepted, expected_tokens, marginal_gains
from agentrt.spec.cost_model import StepCostModel

POLICIES = ("adaptive", "fixed", "off")


@dataclass(frozen=True)
class SeqDraftState:
    """One running sequence as the controller sees it. len(accept_probs) is the most drafts its
    drafter offers this step; grammar-forced positions have probability 1.0."""

    seq_id: Hashable
    accept_probs: Sequence[float]
    draft_cost_s_per_token: float
    context_len: int


@dataclass(frozen=True)
class StepPrefill:
    """Prompt tokens the step feeds besides each sequence's one verified token (a prompt chunk
    counts its rows but one), and their query-key pairs beyond each sequence's context_len: they
    are in the forward whatever k is, so they set how much a draft token costs."""

    tokens: int = 0
    pairs: int = 0


NO_PREFILL = StepPrefill()


@dataclass(frozen=True)
class Allocation:
    k: list[int]
    expected_tokens: list[float]
    predicted_step_s: float  # target forward + drafting
    predicted_goodput: float  # expected emitted tokens per second
    predicted_target_s: float = 0.0  # the fitted model's forward plus the residual
    predicted_draft_s: float = 0.0
    compute_bound: bool = False
    predicted_residual_s: float = 0.0  # of predicted_target_s, what the residual added


class _Step:
    """Running totals of a candidate allocation; goodput() is exact for the totals."""

    def __init__(self, model: StepCostModel, seqs: Sequence[SeqDraftState], prefill: StepPrefill,
                 row_tiles: int | None = None, residual: Callable[[int], float] | None = None) -> None:
        self.model = model
        self.residual = residual
        self.row_tiles = row_tiles  # price the step as this many row tiles (None: those its tokens fill)
        # every sequence verifies at least its own next token; prompt chunks ride along
        self.tokens = len(seqs) + prefill.tokens
        self.kv = sum(s.context_len for s in seqs)
        self.pairs = self.kv + prefill.pairs
        self.draft_s = 0.0
        self.emitted = float(len(seqs))

    def fitted_s(self, d_tokens: int = 0, d_pairs: int = 0) -> float:
        return self.model.predict(self.tokens + d_tokens, self.kv, self.pairs + d_pairs, self.row_tiles)

    def target_s(self, d_tokens: int = 0, d_pairs: int = 0) -> float:
        fitted = self.fitted_s(d_tokens, d_pairs)
        return fitted + self.residual_s(fitted, d_tokens)

    def residual_s(self, fitted: float, d_tokens: int = 0) -> float:
        """What the residual adds to the fit's `fitted` seconds (never taking the step under a tenth of them)."""
        return 0.0 if self.residual is None else max(self.residual(self.tokens + d_tokens), -0.9 * fitted)

    def goodput(self, d_emitted=0.0, d_tokens=0, d_pairs=0, d_draft=0.0) -> float:
        seconds = self.target_s(d_tokens, d_pairs) + self.draft_s + d_draft
        return (self.emitted + d_emitted) / seconds

    def add(self, d_emitted: float, d_tokens: int, d_pairs: int, d_draft: float) -> None:
        self.emitted += d_emitted
        self.tokens += d_tokens
        self.pairs += d_pairs
        self.draft_s += d_draft


class KController:
    """Chooses k per sequence each step. policy "adaptive": greedy goodput maximisation; "fixed":
    min(fixed_k, offered) for every sequence (the baseline benchmarks compare against); "off": 0.
    kmax_cap bounds every k on top of what each drafter offers."""

    def __init__(
        self, cost_model: StepCostModel, kmax_cap: int = 32, policy: str = "adaptive", fixed_k: int = 4,
        residual: Callable[[int], float] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise SpecConfigError(f"KController policy must be one of {POLICIES}, got {policy!r}")
        if kmax_cap < 0 or fixed_k < 0:
            raise SpecConfigError(f"KController needs kmax_cap >= 0 and fixed_k >= 0, got {kmax_cap}, {fixed_k}")
        self.cost_model = cost_model
        self.kmax_cap = kmax_cap
        self.policy = policy
        self.fixed_k = fixed_k
        self.residual = residual  # seconds a step of n rows costs beyond the fit (spec.step_residual)

    def choose(self, seqs: Sequence[SeqDraftState], prefill: StepPrefill = NO_PREFILL) -> Allocation:
        """k_i in [0, min(kmax_cap, len(accept_probs_i))] per sequence, in the order given, with the
        predicted emitted tokens, step time and goodput of that choice."""
        if prefill.tokens < 0 or prefill.pairs < 0:
            raise SpecConfigError(f"StepPrefill needs tokens >= 0 and pairs >= 0, got {prefill}")
        gains = [self._gains(s) for s in seqs]  # [seq][position] marginal expected tokens
        if self.policy == "off":
            ks = [0] * len(seqs)
        elif self.policy == "fixed":
            ks = [min(self.fixed_k, len(g)) for g in gains]
        else:
            ks = self._greedy(seqs, gains, prefill)
        return self._allocation(seqs, ks, prefill)

    def _gains(self, s: SeqDraftState) -> list[float]:
        if s.context_len < 0 or not (s.draft_cost_s_per_token >= 0):
            raise SpecConfigError(f"sequence {s.seq_id!r}: context_len and draft_cost_s_per_token must be >= 0")
        try:
            return marginal_gains(list(s.accept_probs)[: self.kmax_cap])
        except SpecConfigError as e:
            raise SpecConfigError(f"sequence {s.seq_id!r}: {e}") from e

    def _allocation(self, seqs, ks: list[int], prefill: StepPrefill) -> Allocation:
        step = _Step(self.cost_model, seqs, prefill, residual=self.residual)
        accepted = [expected_accepted(s.accept_probs[:k]) for s, k in zip(seqs, ks)]
        for s, a, k in zip(seqs, accepted, ks):
            step.add(a, k, k * s.context_len, _draft_s(s, k))
        target = step.target_s() if seqs else 0.0
        total = target + step.draft_s
        return Allocation(
            k=ks,
            expected_tokens=[1.0 + a for a in accepted],
            predicted_step_s=total,
            predicted_goodput=step.emitted / total if seqs else 0.0,
            predicted_target_s=target,
            predicted_draft_s=step.draft_s,
            compute_bound=bool(seqs) and self.cost_model.is_compute_bound(step.tokens, step.kv, step.pairs),
            predicted_residual_s=step.residual_s(step.fitted_s()) if seqs else 0.0,
        )

    def _greedy(self, seqs: Sequence[SeqDraftState], gains: list[list[float]], prefill: StepPrefill) -> list[int]:
        """The greedy allocation, within each count of row tiles where the step has them (see the
        module docstring)."""
        model = self.cost_model
        if len(seqs) == 1:  # every k priced (see the module docstring), the first best taken
            return [self._best_k_alone(seqs[0], gains[0], prefill)]
        if not seqs or model.row_tile == 1 or model.tile_s == 0.0:
            return self._greedy_within(seqs, gains, prefill, None)
        base = len(seqs) + prefill.tokens
        best, best_goodput = [0] * len(seqs), -math.inf
        for tiles in range(model.row_tiles(base), model.row_tiles(base + sum(map(len, gains))) + 1):
            ks = self._greedy_within(seqs, gains, prefill, tiles)
            goodput = self._allocation(seqs, ks, prefill).predicted_goodput
            if goodput > best_goodput:
                best, best_goodput = ks, goodput
            if base + sum(ks) < tiles * model.row_tile:
                break
        return best

    def _best_k_alone(self, s: SeqDraftState, gains: list[float], prefill: StepPrefill) -> int:
        """The k of one sequence with the best goodput, each k priced as _allocation prices it
        (the same operations, so the same floats) from a running sum of the gains: a step's
        controller time stays O(kmax), not O(kmax^2)."""
        best_k, best, accepted = 0, -math.inf, 0.0
        for k in range(len(gains) + 1):
            if k:
                accepted += gains[k - 1]
            step = _Step(self.cost_model, (s,), prefill, residual=self.residual)
            step.add(accepted, k, k * s.context_len, _draft_s(s, k))
            goodput = step.goodput()
            if goodput > best:
                best_k, best = k, goodput
        return best_k

    def _greedy_within(self, seqs: Sequence[SeqDraftState], gains: list[list[float]], prefill: StepPrefill,
                       row_tiles: int | None) -> list[int]:
        """Greedy marginal allocation with the step priced as row_tiles tiles and its tokens kept
        within them (None: any tokens, priced as they fall)."""
        ks = [0] * len(seqs)
        if not seqs:
            return ks
        model, step = self.cost_model, _Step(self.cost_model, seqs, prefill, row_tiles, self.residual)
        cap = math.inf if row_tiles is None else row_tiles * model.row_tile
        compute_regime = model.is_compute_bound(step.tokens, step.kv, step.pairs)

        def move(i: int) -> tuple[int, float, float] | None:
            """Best next move of sequence i: (tokens, expected gain, estimated seconds)."""
            s, g, k = seqs[i], gains[i], ks[i]
            if k >= len(g):
                return None
            per_token = s.draft_cost_s_per_token
            if compute_regime:
                per_token += model.compute_s(1, s.context_len)
            return 1, g[k], per_token

        def entry(i: int):
            m = move(i)
            return None if m is None else (-_ratio(m[1], m[2]), -m[1], i, m[0], m[1])

        heap = [e for e in map(entry, range(len(seqs))) if e is not None]
        heapq.heapify(heap)
        goodput = step.goodput()
        while heap:
            _, _, i, j, gain = heapq.heappop(heap)
            if step.tokens + j > cap:
                break  # every move is one token: the tiles are full
            s = seqs[i]
            d_pairs, d_draft = j * s.context_len, _draft_s(s, ks[i] + j) - _draft_s(s, ks[i])
            if not compute_regime and model.is_compute_bound(step.tokens + j, step.kv, step.pairs + d_pairs):
                # past the ridge extra tokens cost target time: re-rank everything by the new cost
                compute_regime = True
                heap = [e for e in (entry(x) for x in range(len(seqs))) if e is not None]
                heapq.heapify(heap)
                continue
            new_goodput = step.goodput(gain, j, d_pairs, d_draft)
            if not new_goodput > goodput * (1.0 + 1e-12):
                break  # the best-ranked move does not pay, so none does (see the module docstring)
            step.add(gain, j, d_pairs, d_draft)
            ks[i] += j
            goodput = new_goodput
            e = entry(i)
            if e is not None:
                heapq.heappush(heap, e)
        return ks

    def break_even_batch(
        self, alpha: float, k: int, context_len: int, draft_cost_s_per_token: float = 0.0, max_batch: int = 4096
    ) -> int | None:
        return break_even_batch(
            alpha, k, context_len, cost_model=self.cost_model,
            draft_cost_s_per_token=draft_cost_s_per_token, max_batch=max_batch,
        )


def _ratio(gain: float, seconds: float) -> float:
    return math.inf if seconds <= 0.0 else gain / seconds


def _draft_s(s: SeqDraftState, k: int) -> float:
    return 0.0 if k <= 0 else k * s.draft_cost_s_per_token


def speculative_goodput(
    cost_model: StepCostModel, batch: int, alpha: float, k: int, context_len: int, draft_cost_s_per_token: float = 0.0
) -> float:
    """Predicted tokens/s of `batch` identical sequences all drafting k tokens at acceptance alpha."""
    n = batch * (k + 1)
    seconds = cost_model.predict(n, batch * context_len, n * context_len) + batch * k * draft_cost_s_per_token
    return batch * expected_tokens(alpha, k) / seconds


def break_even_batch(
    alpha: float,
    k: int,
    context_len: int,
    *,
    cost_model: StepCostModel,
    draft_cost_s_per_token: float = 0.0,
    max_batch: int = 4096,
) -> int | None:
    """The first batch size at which fixed-k speculation is predicted to emit fewer tokens per
    second than no speculation (where the linears turn compute-bound and verified drafts cost
    their full FLOP share); None if speculation still wins at max_batch (long contexts, whose K/V
    read every step pays whatever k is, can keep it winning at any batch)."""
    for batch in range(1, max_batch + 1):
        spec = speculative_goodput(cost_model, batch, alpha, k, context_len, draft_cost_s_per_token)
        if spec < speculative_goodput(cost_model, batch, alpha, 0, context_len):
            return batch
    return None
