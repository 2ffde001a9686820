"""The engine's step-cost model: measured once per (model, dtype, machine) and cached.

`calibrate_engine` times real target forwards over a grid of (new tokens, cached context) and
fits the roofline-shaped StepCostModel; `load_or_estimate_cost_model` reads the cached fit or,
uncalibrated, builds the analytic roofline from the model's size and this machine's measured
bandwidth and matmul rate."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.llama import ForwardBatch
from agentrt.engine.loading.registry import cache_root
from agentrt.errors import CalibrationError
from agentrt.kernels.machine import machine_id, measure_machine
from agentrt.spec.cost_model import StepCostModel, analytic, calibrate, cost_model_path, default_grid

log = logging.getLogger(__name__)

_SCRATCH = -1  # block-table id of the first calibration sequence (-1, -2, ...; real ids are >= 0)


def model_cost_path(engine) -> Path:
    # a model on its GGUF's blocks is another model to time than its float twin (other kernels,
    # ~1/6 of the fp32 weight bytes), so it gets its own fit, one per build and instruction set of
    # the kernels (a 16-row verify costs ~6x a step on AVX2 and ~2x with AMX-INT8)
    name = engine.loaded.name
    if engine.model.quantized:
        from agentrt.kernels.quant_build import kernels_key

        name += "-quantized" + (f"-{kernels_key()}" if kernels_key() else "")
    return cost_model_path(cache_root(), name, engine.model.dtype, machine_id(engine.config.device))


def row_tile(engine) -> int:
    """Rows the engine's linears multiply at once, where their cost steps (StepCostModel.row_tile)."""
    if not engine.model.quantized:
        return 1
    from agentrt.kernels.quant_build import row_tile as quant_row_tile

    return quant_row_tile()


def weight_bytes_per_param(model) -> float:
    """Bytes a forward reads per parameter: the dtype's size, or for a quantized model the
    blocks' bytes (projections and output head) per parameter."""
    if not model.quantized:
        return float(model.dtype.itemsize)
    linears = [getattr(ly, a) for ly in model.layers for a in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
    total = sum(lin.nbytes() if hasattr(lin, "nbytes") else lin.weight.numel() * lin.weight.element_size() for lin in linears)
    return total / sum(lin.in_features * lin.out_features for lin in linears)


def analytic_cost_model(engine, seconds_budget: float = 1.0) -> StepCostModel:
    cfg = engine.model.cfg
    rates = measure_machine(engine.model.dtype, seconds_budget, cache_root() / "machine.json", device=engine.config.device)
    return replace(analytic(
        cfg.num_params(), cfg.num_hidden_layers, KVCache.bytes_per_token(cfg, engine.model.kv_dtype),
        weight_bytes_per_param(engine.model), rates, q_size=cfg.q_size,
    ), row_tile=row_tile(engine))  # its steps unknown (tile_s 0) until timed


def load_or_estimate_cost_model(engine) -> StepCostModel:
    path = model_cost_path(engine)
    if path.exists():
        return StepCostModel.load(path)
    return analytic_cost_model(engine)


QUICK_FIT_TOKENS = (1, 2, 4, 8, 16)  # new tokens per timed forward: k + 1 of a verify step up to k = 15
# (and one row past the kernels' row tile, where they have one: the step a 16-sequence batch pays
# for its first draft)
QUICK_FIT_BATCHES = ((16, 1), (16, 2))  # (sequences, new tokens each): a full batch decoding, and drafting one
QUICK_FIT_LONG_TOKENS = (1, 16)  # new tokens on a context QUICK_FIT_LONG_FACTOR times longer
QUICK_FIT_LONG_FACTOR = 8
QUICK_FIT_MAX_RMSE = 0.15  # quiet machines fit their forwards within ~5%
WARMUP_S = 0.5  # untimed forwards before a fit's timings (see calibrate)


def quick_grid(kv_tokens: int, room: int, block_size: int, max_len: int | None = None,
               row_tile: int = 1) -> list[tuple[int, int, int]]:
    """One sequence feeding QUICK_FIT_TOKENS on a kv_tokens context, then the batches of
    QUICK_FIT_BATCHES each on such a context, then QUICK_FIT_LONG_TOKENS on a context
    QUICK_FIT_LONG_FACTOR times longer (or as long as max_len, the engine's longest sequence,
    allows), where the KV cache has room for them. On one context
    length every sample's attention pairs are that length times its new tokens, so the fit
    cannot tell a row's linear cost from its attention cost; it once gave all of it to attention
    (10x the arithmetic's FLOPs per pair), which extrapolated to a 17-row verify at 800 cached
    tokens costing 8x a step, and adaptive k drafted shallow on long contexts."""
    grid = [(n, kv_tokens, 1) for n in QUICK_FIT_TOKENS + ((row_tile + 1,) if row_tile > 1 else ())
            if kv_tokens + n + block_size <= room]
    grid += [(b * t, b * kv_tokens, b) for b, t in QUICK_FIT_BATCHES if b * (kv_tokens + t + block_size) <= room]
    longest = max(QUICK_FIT_LONG_TOKENS)
    long_kv = min(QUICK_FIT_LONG_FACTOR * kv_tokens, (max_len or room) - longest, room - longest - block_size)
    if long_kv < 2 * kv_tokens:  # too close to the first context to tell anything apart
        return grid
    return grid + [(n, long_kv, 1) for n in QUICK_FIT_LONG_TOKENS]


def quick_cost_model(engine, kv_tokens: int = 128, fastest_of: int = 5, repeats: int = 2) -> StepCostModel:
    """A fit on quick_grid's 5-10 points, each the median over `repeats` passes of the fastest of
    `fastest_of` forwards (~1.2 s in all with the warm-up), the analytic roofline as the prior for
    what so few points cannot tell. For the quantized path, where the analytic roofline is
    furthest off: it prices the int8 kernels at torch's fp32 matmul rate, and it cannot know that a
    batch of one-token rows reads one context per sequence where a verify reads one (at 16
    sequences the quantized path's K/V read costs about as much as its linears). One pass of the
    fastest of 3 fitted 2-10% rms on a 2-core Xeon, where a row costs ~10% of a one-row step; two
    passes of the fastest of 5 fitted 2-4%. The ridge stays loosely held either way (1.2-1.6 rows
    in four fits in a row, 2.6 in a fifth at 2.4% rms): a flat start and a slope from the first
    row explain the few small steps about equally well. The engine must be idle (the forwards run
    on scratch sequences' blocks)."""
    tile = row_tile(engine)
    grid = quick_grid(kv_tokens, engine.blocks.num_slots, engine.blocks.block_size, engine.max_model_len, tile)
    model, _, _ = calibrate(fastest_forward_timer(engine, fastest_of), grid, repeats=repeats, progress=False,
                            prior=analytic_cost_model(engine), warmup_s=WARMUP_S, row_tile=tile)
    return model


def fit_cost_model_when_idle(engine) -> StepCostModel | None:
    """Where speculation runs on the quantized path with neither a cached fit nor a cost model in
    use yet, and the engine is idle with room for the timed forwards: quick_cost_model, saved where
    `agentrt calibrate` saves its fit (which replaces it) and used from now on. Timings the model
    cannot explain (other processes took the cores: off by more than QUICK_FIT_MAX_RMSE) are
    measured once more, and if still unexplained neither used nor cached: a fit is read by every
    later engine on this machine. Returns the fit, or None where nothing was done."""
    kv_tokens, spec = 128, engine.spec
    path = model_cost_path(engine)
    if (spec.drafter is None or not engine.model.quantized or spec.has_cost_model or path.exists()
            or engine.has_work() or engine.blocks.num_slots < kv_tokens + max(QUICK_FIT_TOKENS)):
        return None
    try:
        model = quick_cost_model(engine, kv_tokens)
        if model.fit_rel_rmse > QUICK_FIT_MAX_RMSE:
            model = quick_cost_model(engine, kv_tokens)
        if model.fit_rel_rmse > QUICK_FIT_MAX_RMSE:
            raise CalibrationError(f"the timed forwards are off the fitted model by {100 * model.fit_rel_rmse:.0f}% "
                                   "rms twice (a busy machine?)")
    except CalibrationError as e:  # timings no fit can use: the roofline stays, the engine runs on
        log.warning("no step-cost fit at warm-up, the analytic roofline prices steps: %s", e)
        return None
    spec.cost_model = model
    try:
        model.save(path)
    except OSError as e:  # used in this process all the same
        log.warning("step-cost fit not cached at %s: %s", path, e)
    return model


def forward_timer(engine):
    """step_fn(num_tokens, kv_tokens, num_seqs=1) -> seconds of one target forward of num_seqs
    sequences (scratch block tables), each verifying num_tokens / num_seqs positions on a
    kv_tokens / num_seqs-long cached context (logits for every position). Through the engine's
    step graphs where it has them: a step that fits a bucket is timed as the engine runs it, replayed."""
    blocks, model = engine.blocks, engine.model
    graphs = engine.step_graphs
    forward = graphs.forward if graphs is not None else lambda batch: model.forward(batch, engine.kv)

    def step_fn(num_tokens: int, kv_tokens: int, num_seqs: int = 1) -> float:
        n, ctx = num_tokens // num_seqs, kv_tokens // num_seqs
        scratch = [_SCRATCH - i for i in range(num_seqs)]
        try:
            for seq in scratch:
                blocks.grow(seq, ctx + n)
            positions = torch.arange(ctx, ctx + n).repeat(num_seqs)
            meta = build_attention_metadata([n] * num_seqs, [ctx + n] * num_seqs, positions,
                                            [blocks.tables[seq] for seq in scratch], blocks.block_size, model.device)
            batch = ForwardBatch(
                input_ids=torch.randint(0, model.cfg.vocab_size, (n * num_seqs,), device=model.device),
                positions=positions.to(model.device),
                slot_mapping=torch.tensor([s for seq in scratch for s in blocks.slots(seq, ctx, ctx + n)],
                                          device=model.device),
                attn=meta,
                logits_indices=torch.arange(n * num_seqs, device=model.device),
            )
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward(batch)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        finally:
            for seq in scratch:
                blocks.free(seq)

    return step_fn


def fastest_forward_timer(engine, fastest_of: int):
    """forward_timer's step_fn, each sample the fastest of `fastest_of` back-to-back forwards."""
    timer = forward_timer(engine)

    def fastest(num_tokens: int, kv_tokens: int, num_seqs: int = 1) -> float:
        return min(timer(num_tokens, kv_tokens, num_seqs) for _ in range(max(1, fastest_of)))

    return fastest


def calibrate_engine(engine, max_tokens: int = 256, kv_values=(128, 512, 2048), repeats: int = 3, progress: bool = True,
                     fastest_of: int = 3):
    """Measure, fit, persist. Returns (model, report rows of predicted vs measured, path).

    Each sample is the fastest of `fastest_of` back-to-back forwards: on a CPU shared with other
    processes a descheduled forward is common, and one-forward samples once tilted the fit to a
    per-KV-token cost 100x the real one (2.3 MB vs 23 KB), which predicts memory-bound steps at
    any batch size and keeps the controller drafting into a full batch."""
    room = engine.blocks.num_slots
    kv_values = [kv for kv in kv_values if kv + max_tokens <= room]
    tile = row_tile(engine)
    grid = [(n, kv, seqs) for n, kv, seqs in default_grid(max_tokens, kv_values, row_tile=tile)
            if kv + n + seqs * engine.blocks.block_size <= room]  # a block of slack per sequence
    prior = analytic_cost_model(engine)
    model, _, report = calibrate(fastest_forward_timer(engine, fastest_of), grid, repeats=repeats, progress=progress,
                                 prior=prior, warmup_s=WARMUP_S, row_tile=tile)
    path = model_cost_path(engine)
    model.save(path)
    engine.spec.cost_model = model
    return model, report, path
