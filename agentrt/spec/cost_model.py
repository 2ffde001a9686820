"""Step-cost model: how long one target forward takes, as a function of the new tokens in the step,
the cached tokens attention reads and its query-key pairs. A forward runs its linear layers and its
attention one after the other, each bound by memory or by arithmetic, so the step is the sum of two
rooflines plus a fixed overhead:

    T(n, kv, pairs) = overhead + max(bytes_fixed / read_bw, n * flops_per_token / flop_rate)
                               + tile_s * (ceil(n / row_tile) - 1)
                               + max(bytes_per_kv_token * kv / read_bw, pairs * attn_flops_per_pair / flop_rate)

Verifying drafts is nearly free while the linears read weights slower than they multiply, and
costs its full share once they do; the KV a batch of sequences reads is paid on top (on the CPU
paths one sequence's K/V rows are read once for all its queries, so a batch of one-token rows
reads B contexts where a verify of the same width reads one). Kernels that multiply rows in
tiles (AMX: 16 activation rows per tile) pay a step each time the rows spill into another tile:
on the quantized AMX path a 17-row forward costs ~3.5 ms more than a 16-row one (~25%), where the
16th row added ~0.8 ms; tile_s is that step, row_tile its period (1: no steps). The model is fitted to timings of
the running engine (`calibrate`, via a callback, so this module never imports the engine), or,
uncalibrated, derived from the model size and machine rates.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentrt.errors import CalibrationError, SpecConfigError
from agentrt.kernels.machine import MachineRates, _write_json_atomic, dtype_name

FORMAT_VERSION = 4  # 1: one roofline over weights and KV together; 2: warm-up fits on one context length, which
# could not tell a row's linear cost from its attention cost; 3: no row tiles (cached fits of these are not read)


@dataclass(frozen=True)
class StepSample:
    """One measured target forward. query_kv_pairs: sum over sequences of new tokens x context
    length (attention work); None means one sequence, num_tokens * kv_tokens."""

    num_tokens: int
    kv_tokens: int
    seconds: float
    query_kv_pairs: int | None = None

    @property
    def pairs(self) -> int:
        return self.num_tokens * self.kv_tokens if self.query_kv_pairs is None else self.query_kv_pairs


@dataclass(frozen=True)
class StepCostModel:
    overhead_s: float
    bytes_fixed: float  # weights read once per step
    bytes_per_kv_token: float  # KV cache bytes read per cached token (all layers, K and V)
    flops_per_token: float  # matmul FLOPs per new token
    read_bw: float  # bytes/s
    flop_rate: float  # FLOP/s
    attn_flops_per_pair: float = 0.0  # QK^T + PV FLOPs per (new token, cached token) pair
    source: str = "analytic"  # "analytic" | "fit"
    fit_rel_rmse: float | None = None  # root-mean-square relative error on the fitted samples
    num_samples: int = 0
    row_tile: int = 1  # rows the linears multiply at once (1: their cost has no steps)
    tile_s: float = 0.0  # seconds each row tile past the first adds

    def __post_init__(self) -> None:
        if isinstance(self.row_tile, bool) or not isinstance(self.row_tile, int) or self.row_tile < 1:
            raise SpecConfigError(f"StepCostModel.row_tile must be an integer >= 1, got {self.row_tile!r}")
        for name in ("overhead_s", "bytes_fixed", "bytes_per_kv_token", "flops_per_token", "attn_flops_per_pair",
                     "tile_s"):
            v = getattr(self, name)
            if not (v >= 0.0) or math.isinf(v):
                raise SpecConfigError(f"StepCostModel.{name} must be finite and >= 0, got {v!r}")
        for name in ("read_bw", "flop_rate"):
            v = getattr(self, name)
            if not (v > 0.0) or math.isinf(v):
                raise SpecConfigError(f"StepCostModel.{name} must be finite and > 0, got {v!r}")

    def linear_s(self, num_tokens: int) -> float:
        """The linear layers: the weights' read or the tokens' FLOPs, the slower."""
        return max(self.bytes_fixed / self.read_bw, num_tokens * self.flops_per_token / self.flop_rate)

    def row_tiles(self, num_tokens: int) -> int:
        """The row tiles num_tokens rows fill."""
        return row_tiles(num_tokens, self.row_tile)

    def tiles_s(self, row_tiles: int) -> float:
        """What the tiles past the first add."""
        return self.tile_s * (row_tiles - 1)

    def attention_s(self, kv_tokens: int, query_kv_pairs: int) -> float:
        """Attention: the cached K/V's read or the query-key pairs' FLOPs, the slower."""
        return max(self.bytes_per_kv_token * kv_tokens / self.read_bw,
                   query_kv_pairs * self.attn_flops_per_pair / self.flop_rate)

    def compute_s(self, num_tokens: int, query_kv_pairs: int = 0) -> float:
        """The FLOP time of num_tokens tokens and their pairs (what one more token costs past the ridge)."""
        return (num_tokens * self.flops_per_token + query_kv_pairs * self.attn_flops_per_pair) / self.flop_rate

    def predict(self, num_tokens: int, kv_tokens: int, query_kv_pairs: int = 0, row_tiles: int | None = None) -> float:
        """Seconds for one forward of num_tokens new tokens reading kv_tokens cached tokens;
        row_tiles: price the step as that many row tiles (default: those num_tokens fill)."""
        tiles = self.row_tiles(num_tokens) if row_tiles is None else row_tiles
        return (self.overhead_s + self.linear_s(num_tokens) + self.tiles_s(tiles)
                + self.attention_s(kv_tokens, query_kv_pairs))

    def is_compute_bound(self, num_tokens: int, kv_tokens: int, query_kv_pairs: int = 0) -> bool:
        """Whether one more token costs target time: the linears or attention are past their ridge."""
        return (num_tokens * self.flops_per_token / self.flop_rate > self.bytes_fixed / self.read_bw
                or query_kv_pairs * self.attn_flops_per_pair / self.flop_rate
                > self.bytes_per_kv_token * kv_tokens / self.read_bw)

    def ridge_tokens(self) -> float:
        """New tokens per step at which the linears' FLOPs catch up with their weights' read."""
        if self.flops_per_token == 0.0:
            return math.inf
        return self.bytes_fixed / self.read_bw * self.flop_rate / self.flops_per_token

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StepCostModel":
        if not isinstance(d, dict) or d.get("format_version") != FORMAT_VERSION:
            raise CalibrationError(f"not a step-cost model of format {FORMAT_VERSION}: {str(d)[:120]!r}")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        try:
            return cls(**fields)
        except TypeError as e:
            raise CalibrationError(f"step-cost model JSON is missing or has unknown fields: {e}") from e

    def save(self, path: str | Path) -> None:
        _write_json_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "StepCostModel":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CalibrationError(f"cannot read step-cost model {path}: {e}") from e
        return cls.from_json(data)


def row_tiles(num_tokens: int, row_tile: int) -> int:
    """The tiles of row_tile rows that num_tokens rows fill (at least one)."""
    return max(1, -(-num_tokens // row_tile))


def cost_model_path(cache_root: str | Path, model_name: str, dtype: Any, machine_id: str) -> Path:
    """Where the calibrated model for (model, dtype, machine) lives under the cache root."""
    model_slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-")
    if not model_slug or not machine_id:
        raise SpecConfigError(f"cost_model_path needs a model name and machine id, got {model_name!r}, {machine_id!r}")
    return Path(cache_root) / "cost_models" / f"{model_slug}--{dtype_name(dtype)}--{machine_id}--v{FORMAT_VERSION}.json"


def analytic(
    num_params: int,
    num_layers: int,
    kv_bytes_per_token: float,
    dtype_bytes: float,  # bytes read per parameter (a quantized format's fraction of a byte included)
    rates: MachineRates,
    *,
    q_size: int | None = None,
    overhead_s: float = 0.0,
) -> StepCostModel:
    """Roofline from the model's size: every weight read once per step, 2 FLOPs per weight per
    token. Attention does 4 * q_size FLOPs per layer per (query, key) pair; without q_size the
    KV width stands in (a lower bound under grouped-query attention). overhead_s defaults to 0,
    which understates step time and so errs towards less speculation, until calibrated."""
    if num_params <= 0 or num_layers <= 0 or dtype_bytes <= 0 or kv_bytes_per_token < 0:
        raise SpecConfigError(
            f"analytic cost model needs positive sizes, got num_params={num_params}, num_layers={num_layers}, "
            f"kv_bytes_per_token={kv_bytes_per_token}, dtype_bytes={dtype_bytes}"
        )
    width = q_size if q_size is not None else kv_bytes_per_token / (2 * num_layers * dtype_bytes)
    return StepCostModel(
        overhead_s=overhead_s,
        bytes_fixed=float(num_params * dtype_bytes),
        bytes_per_kv_token=float(kv_bytes_per_token),
        flops_per_token=2.0 * num_params,
        read_bw=rates.read_bw_bytes_per_s,
        flop_rate=rates.matmul_flops_per_s,
        attn_flops_per_pair=4.0 * num_layers * width,
    )


# ---- fitting ----------------------------------------------------------------------------------
# Unknowns, all >= 0: theta = [overhead, mem0, mem_per_kv, comp_per_token, comp_per_pair, per_extra_tile]
# (seconds). For a fixed split of the samples into linears memory- or compute-bound, and attention
# KV- or pair-bound, the model is linear, so: try every pair of thresholds (new tokens for the
# linears, queries per cached token for attention), refine each by re-assigning samples to the
# larger fitted term of each roofline, keep the split with the lowest loss, then down-weight
# outliers (Huber) and refit. Columns a split cannot identify (no compute-bound sample, no KV
# variation, pairs that move with tokens, no sample past the first row tile) take the prior's value.

_DROP_ORDER = (5, 4, 2, 0, 3, 1)  # which unidentifiable column takes the prior's value first


def _design(lin_mem, att_mem, kv, n, p, tiles) -> np.ndarray:
    one = np.ones_like(kv)
    return np.stack([one, lin_mem * one, att_mem * kv, ~lin_mem * n, ~att_mem * p, tiles], axis=1)  # [samples, 6]


def _predict_theta(theta: np.ndarray, kv, n, p, tiles) -> np.ndarray:
    return theta[0] + np.maximum(theta[1], theta[3] * n) + np.maximum(theta[2] * kv, theta[4] * p) + theta[5] * tiles


def _regimes(theta: np.ndarray, kv: np.ndarray, n: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return theta[1] >= theta[3] * n, theta[2] * kv >= theta[4] * p


def _identifiable(X: np.ndarray) -> list[int]:
    """The columns fitted from the data: non-zero ones, dropping (in _DROP_ORDER) each that the
    others already span."""
    free = [j for j in range(X.shape[1]) if np.any(X[:, j] != 0)]
    for j in _DROP_ORDER:
        if j in free and len(free) > 1:
            others = [c for c in free if c != j]
            if np.linalg.matrix_rank(X[:, others]) == np.linalg.matrix_rank(X[:, free]):
                free = others
    return free


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray, free: list[int]) -> np.ndarray:
    """Least squares over the columns in `free` with theta >= 0 (drop the most negative, refit)."""
    free = list(free)
    theta = np.zeros(X.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(X[:, free], y, rcond=None)
        if (sol >= 0).all():
            theta[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return theta


def _fit_split(lin_mem, att_mem, kv, n, p, tiles, t, w, prior_theta: list[float] | None) -> np.ndarray:
    """Fit theta for one split; columns the split cannot identify take the prior's value (or 0)."""
    X = _design(lin_mem, att_mem, kv, n, p, tiles)
    free = _identifiable(X)
    known = np.zeros(X.shape[1])
    for j in range(X.shape[1]):
        if j not in free and prior_theta is not None:
            known[j] = prior_theta[j]
    sw = np.sqrt(w) / t  # relative errors: timing noise is multiplicative
    return _nonneg_lstsq(X * sw[:, None], (t - X @ known) * sw, free) + known


def fit(
    samples: Sequence[StepSample],
    rates: MachineRates | None = None,
    prior: StepCostModel | None = None,
    row_tile: int = 1,
) -> StepCostModel:
    """Fit the model to measured steps. Rates (or the prior's) convert fitted seconds back into
    bytes and FLOPs; without either, read_bw = flop_rate = 1 and bytes/FLOPs are in seconds.
    Terms the samples cannot identify (no compute-bound sample, say) come from `prior`; without a
    prior the compute slope is set so the ridge sits just past the largest measured step.
    row_tile: the kernels' row tile (the fit's tile_s is the step past each; 1: none)."""
    if len(samples) < 4:
        raise CalibrationError(f"fit needs at least 4 timed steps, got {len(samples)}")
    n = np.array([s.num_tokens for s in samples], dtype=float)
    kv = np.array([s.kv_tokens for s in samples], dtype=float)
    p = np.array([s.pairs for s in samples], dtype=float)
    t = np.array([s.seconds for s in samples], dtype=float)
    if isinstance(row_tile, bool) or not isinstance(row_tile, int) or row_tile < 1:
        raise CalibrationError(f"fit needs row_tile, the kernels' row tile, as an integer >= 1, got {row_tile!r}")
    tiles = np.array([row_tiles(s.num_tokens, row_tile) - 1 for s in samples], dtype=float)
    if not np.isfinite(t).all() or (t <= 0).any() or (n < 1).any() or (kv < 0).any() or (p < 0).any():
        raise CalibrationError("fit needs positive finite step times, num_tokens >= 1 and kv_tokens, pairs >= 0")
    read_bw = rates.read_bw_bytes_per_s if rates else (prior.read_bw if prior else 1.0)
    flop_rate = rates.matmul_flops_per_s if rates else (prior.flop_rate if prior else 1.0)
    prior_theta = None
    if prior is not None:
        prior_theta = [prior.overhead_s, prior.bytes_fixed / prior.read_bw, prior.bytes_per_kv_token / prior.read_bw,
                       prior.flops_per_token / prior.flop_rate, prior.attn_flops_per_pair / prior.flop_rate,
                       prior.tile_s if prior.row_tile == row_tile else 0.0]
    queries = np.divide(p, kv, out=np.zeros_like(p), where=kv > 0)  # new tokens per cached token read

    def loss(theta: np.ndarray, w: np.ndarray) -> float:
        return float(np.sum(w * ((_predict_theta(theta, kv, n, p, tiles) - t) / t) ** 2))

    def fit_weighted(w: np.ndarray) -> np.ndarray:
        best, best_loss = None, math.inf
        for lin_threshold in [0.0, *np.unique(n)]:
            for att_threshold in [0.0, *np.unique(queries)]:
                lin_mem, att_mem = n <= lin_threshold, queries <= att_threshold
                for _ in range(20):
                    theta = _fit_split(lin_mem, att_mem, kv, n, p, tiles, t, w, prior_theta)
                    new_lin, new_att = _regimes(theta, kv, n, p)
                    if (new_lin == lin_mem).all() and (new_att == att_mem).all():
                        break
                    lin_mem, att_mem = new_lin, new_att
                if lin_mem.all():
                    theta = _complete_compute(theta, prior_theta, n)
                current = loss(theta, w)
                if current < best_loss:
                    best, best_loss = theta, current
        return best

    w = np.ones_like(t)
    theta = fit_weighted(w)
    for _ in range(2):  # Huber re-weighting: a few slow outliers (a GC pause) must not tilt the fit
        r = (_predict_theta(theta, kv, n, p, tiles) - t) / t
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r)))) + 1e-9
        w = np.minimum(1.0, 1.5 * scale / np.maximum(np.abs(r), 1e-12))
        theta = fit_weighted(w)
    rel = (_predict_theta(theta, kv, n, p, tiles) - t) / t
    return StepCostModel(
        overhead_s=float(theta[0]),
        bytes_fixed=float(theta[1] * read_bw),
        bytes_per_kv_token=float(theta[2] * read_bw),
        flops_per_token=float(theta[3] * flop_rate),
        read_bw=float(read_bw),
        flop_rate=float(flop_rate),
        attn_flops_per_pair=float(theta[4] * flop_rate),
        source="fit",
        fit_rel_rmse=float(np.sqrt(np.mean(rel**2))),
        num_samples=len(samples),
        row_tile=row_tile,
        tile_s=float(theta[5]),
    )


def _complete_compute(theta, prior_theta, n) -> np.ndarray:
    """No sample with compute-bound linears: their slope from the prior, else the ridge just past
    the largest measured step (the most pessimistic slope the data allows)."""
    theta = theta.copy()
    theta[3] = prior_theta[3] if prior_theta is not None else float(theta[1] / np.max(n))
    return theta


def median_samples(samples: Iterable[StepSample]) -> list[StepSample]:
    """One sample per (num_tokens, kv_tokens, pairs) point: the median of its repeats."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for s in samples:
        groups.setdefault((s.num_tokens, s.kv_tokens, s.pairs), []).append(s.seconds)
    return [StepSample(n, kv, statistics.median(secs), pairs) for (n, kv, pairs), secs in sorted(groups.items())]


def prediction_report(model: StepCostModel, samples: Iterable[StepSample]) -> list[dict[str, Any]]:
    """Predicted vs measured per grid point (median over repeats), for a table or JSON."""
    rows = []
    for s in median_samples(samples):
        num_tokens, kv_tokens, pairs, measured = s.num_tokens, s.kv_tokens, s.pairs, s.seconds
        predicted = model.predict(num_tokens, kv_tokens, pairs)
        rows.append({
            "num_tokens": num_tokens,
            "kv_tokens": kv_tokens,
            "seqs": max(1, round(num_tokens * kv_tokens / pairs)) if pairs else 1,
            "measured_ms": measured * 1e3,
            "predicted_ms": predicted * 1e3,
            "error_pct": 100.0 * (predicted - measured) / measured,
            "bound": "compute" if model.is_compute_bound(num_tokens, kv_tokens, pairs) else "memory",
        })
    return rows


GridPoint = tuple[int, int, int]  # (new tokens, cached tokens, sequences they are spread over)
BATCH_POINTS = ((4, 1), (16, 1), (16, 2), (16, 4))  # (sequences, new tokens each) on the shortest context


def default_grid(max_tokens: int = 64, kv_values: Sequence[int] = (128, 512, 2048),
                 batches: Sequence[tuple[int, int]] = BATCH_POINTS, row_tile: int = 1) -> list[GridPoint]:
    """One sequence's steps, dense around small steps where a CPU's ridge sits, on each context
    (with row tiles, one row past the first two tiles: where a verify spills into the next);
    then batches of sequences each on the shortest context, which read one context per sequence
    (what tells the K/V read apart from the query-key pairs)."""
    past_tiles = {row_tile + 1, 2 * row_tile + 1} if row_tile > 1 else set()
    tokens = sorted({t for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, *past_tiles)
                     if t <= max_tokens} | {max_tokens})
    grid = [(t, kv, 1) for kv in kv_values for t in tokens]
    if kv_values:
        grid += [(b * t, b * min(kv_values), b) for b, t in batches if b * t <= max_tokens]
    return grid


def calibrate(
    step_fn: Callable[[int, int, int], float],
    grid: Sequence[GridPoint] | None = None,
    repeats: int = 3,
    progress: bool = True,
    *,
    rates: MachineRates | None = None,
    prior: StepCostModel | None = None,
    warmup: int = 1,
    warmup_s: float = 0.0,
    row_tile: int = 1,
) -> tuple[StepCostModel, list[StepSample], list[dict[str, Any]]]:
    """Time step_fn(num_tokens, kv_tokens, num_seqs) -> seconds (num_seqs sequences, each feeding
    num_tokens / num_seqs new tokens on a kv_tokens / num_seqs-long cached context) over the grid,
    fit on the per-point medians (row_tile: the kernels', see fit), and report predicted vs
    measured. Repeats are interleaved across the grid so slow drift hits every point. Untimed
    first: `warmup` steps, and the grid's points in turn for at least warmup_s seconds (a fresh
    engine's first forwards run slow: on a 2-core Xeon one row took 5.0 ms at first and 3.7 ms
    after ~0.3 s of forwards, which a fit on the early timings would take for the step's cost)."""
    grid = list(grid) if grid is not None else default_grid()
    if not grid or repeats < 1 or warmup < 0 or not warmup_s >= 0:
        raise CalibrationError(f"calibrate needs a non-empty grid, repeats >= 1 and warm-ups >= 0, got {len(grid)} "
                               f"points, repeats={repeats}, warmup={warmup}, warmup_s={warmup_s}")
    if any(seqs < 1 or n % seqs or kv % seqs for n, kv, seqs in grid):
        raise CalibrationError("calibrate's grid points (tokens, kv_tokens, seqs) need tokens and kv_tokens "
                               "divisible by seqs >= 1")
    samples: list[StepSample] = []

    def run_all(advance: Callable[[], None]) -> None:
        deadline, i = time.perf_counter() + warmup_s, 0
        while i < warmup or time.perf_counter() < deadline:  # first-call allocation, kernel selection, clocks
            step_fn(*grid[i % len(grid)])
            i += 1
            if i <= warmup:
                advance()
        for _ in range(repeats):
            for num_tokens, kv_tokens, num_seqs in grid:
                seconds = float(step_fn(num_tokens, kv_tokens, num_seqs))
                if not (seconds > 0) or math.isinf(seconds):
                    raise CalibrationError(f"step_fn({num_tokens}, {kv_tokens}, {num_seqs}) returned {seconds!r}, "
                                           "not a time")
                samples.append(StepSample(num_tokens, kv_tokens, seconds, num_tokens * kv_tokens // num_seqs))
                advance()

    total = repeats * len(grid) + warmup
    if progress:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("calibrating step cost", total=total)
            run_all(lambda: bar.advance(task))
    else:
        run_all(lambda: None)
    model = fit(median_samples(samples), rates=rates, prior=prior, row_tile=row_tile)
    return model, samples, prediction_report(model, samples)


class PredictionTracker:
    """Predicted vs measured step times while serving, so the cost model's error stays visible."""

    def __init__(self, window: int = 512) -> None:
        self._rel: deque[float] = deque(maxlen=window)

    def record(self, predicted_s: float, measured_s: float) -> float:
        rel = (predicted_s - measured_s) / measured_s
        self._rel.append(rel)
        return rel

    def summary(self) -> dict[str, float]:
        if not self._rel:
            return {"steps": 0}
        abs_rel = sorted(abs(r) for r in self._rel)
        return {
            "steps": len(abs_rel),
            "median_abs_error_pct": 100.0 * statistics.median(abs_rel),
            "p90_abs_error_pct": 100.0 * abs_rel[min(len(abs_rel) - 1, int(0.9 * len(abs_rel)))],
            "bias_pct": 100.0 * statistics.fmean(self._rel),  # > 0: the model predicts slow
        }
