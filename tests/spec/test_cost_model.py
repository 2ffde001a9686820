"""Step-cost model: the two-roofline formula, the analytic fallback, fitting synthetic timings,
calibration through a timing callback, persistence, and the machine micro-benchmarks."""
import json
import math
import time
from dataclasses import replace

import numpy as np

import pytest

from agentrt.errors import CalibrationError, SpecConfigError
from agentrt.spec.cost_model import (
    PredictionTracker,
    StepCostModel,
    StepSample,
    analytic,
    calibrate,
    cost_model_path,
    default_grid,
    fit,
    prediction_report,
)
from agentrt.kernels.machine import MachineRates, dtype_name, machine_id, measure_machine

# CPU-like ground truth: 15 ms overhead, 9 ms weight read, ridge near 13 tokens, attention counted.
TRUE = StepCostModel(
    overhead_s=0.015, bytes_fixed=270e6, bytes_per_kv_token=92160, flops_per_token=270e6,
    read_bw=30e9, flop_rate=400e9, attn_flops_per_pair=69120,
)
RATES = MachineRates(read_bw_bytes_per_s=30e9, matmul_flops_per_s=400e9, dtype="bfloat16")


def noisy_step_fn(model: StepCostModel, seed: int, noise: float = 0.03, outlier_rate: float = 0.0):
    rng = np.random.default_rng(seed)

    def step(num_tokens: int, kv_tokens: int, num_seqs: int) -> float:
        t = model.predict(num_tokens, kv_tokens, num_tokens * kv_tokens // num_seqs) * float(np.exp(rng.normal(0, noise)))
        return t * 3 if rng.random() < outlier_rate else t

    return step


def test_predict_is_overhead_plus_the_linears_roofline_plus_the_attention_roofline():
    m = StepCostModel(overhead_s=0.001, bytes_fixed=1e9, bytes_per_kv_token=1e5, flops_per_token=2e9,
                      read_bw=1e11, flop_rate=1e13, attn_flops_per_pair=1e5)
    weights, kv_read = 1e9 / 1e11, 1e5 * 1000 / 1e11
    assert m.predict(1, 1000, 1000) == pytest.approx(0.001 + weights + kv_read)  # both memory-bound
    assert not m.is_compute_bound(1, 1000, 1000)
    linears, pairs = 2000 * 2e9 / 1e13, 3000 * 1e5 / 1e13
    assert linears > weights and pairs < kv_read
    assert m.predict(2000, 1000, 3000) == pytest.approx(0.001 + linears + kv_read)
    assert m.is_compute_bound(2000, 1000, 3000)
    # one sequence, many queries on a long context: attention's FLOPs bind while the linears read weights
    slow_attention = replace(m, attn_flops_per_pair=1e7)
    assert slow_attention.predict(16, 1000, 16_000) == pytest.approx(0.001 + weights + 16_000 * 1e7 / 1e13)
    assert slow_attention.is_compute_bound(16, 1000, 16_000)
    assert m.ridge_tokens() == pytest.approx(weights * 1e13 / 2e9)


def test_a_batch_of_one_token_rows_costs_more_than_one_sequence_of_as_many():
    # B sequences read B contexts, a verify of as many rows reads one: the K/V read adds to the linears
    assert TRUE.predict(16, 16 * 512, 16 * 512) > TRUE.predict(16, 512, 16 * 512) + 15 * 512 * 92160 / 30e9 * 0.99


def test_analytic_smollm2_bf16_ridge_is_where_the_notes_put_it():
    # SmolLM2-135M: 134.5M params, 30 layers, 3 KV heads x 64, q 576; the notes' bf16 rates
    kv_bytes = 2 * 30 * 3 * 64 * 2
    rates = MachineRates(read_bw_bytes_per_s=35e9, matmul_flops_per_s=410e9, dtype="bfloat16")
    m = analytic(134_515_008, 30, kv_bytes, 2, rates, q_size=576)
    assert m.bytes_fixed == 134_515_008 * 2 and m.flops_per_token == 2 * 134_515_008
    assert m.attn_flops_per_pair == 4 * 30 * 576
    assert 8 <= m.ridge_tokens() <= 13  # "roughly 8-12 tokens per step in bf16"
    assert m.predict(1, 200, 200) == pytest.approx((m.bytes_fixed + 200 * m.bytes_per_kv_token) / m.read_bw)
    with pytest.raises(SpecConfigError, match="num_params"):
        analytic(0, 30, kv_bytes, 2, rates)


def test_fit_recovers_known_parameters_from_noisy_timings():
    # 3% log-normal noise, 3 repeats, medians per point; 3% of the raw timings are 3x outliers.
    # Tolerances (from 40 seeds, worst case about half of each): the time at one token within 3%,
    # compute slope 10%, overhead, weight bytes, KV slope and attention 20%, predictions 8%.
    model, samples, report = calibrate(
        noisy_step_fn(TRUE, seed=1, outlier_rate=0.03), default_grid(64, (128, 512, 2048)),
        repeats=3, progress=False, rates=RATES,
    )
    assert model.source == "fit" and model.num_samples == len(report) == len(default_grid(64, (128, 512, 2048)))
    assert model.read_bw == RATES.read_bw_bytes_per_s and model.flop_rate == RATES.matmul_flops_per_s
    assert model.predict(1, 512, 512) == pytest.approx(TRUE.predict(1, 512, 512), rel=0.03)
    assert model.flops_per_token == pytest.approx(TRUE.flops_per_token, rel=0.10)
    for name in ("overhead_s", "bytes_fixed", "bytes_per_kv_token", "attn_flops_per_pair"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=0.20), name
    for n in (1, 3, 8, 13, 20, 40, 64):
        for kv in (64, 300, 1024, 4096):  # includes points off the calibration grid
            assert model.predict(n, kv, n * kv) == pytest.approx(TRUE.predict(n, kv, n * kv), rel=0.08)
    for b in (8, 32):  # batches of one-token rows, off the grid's batches
        assert model.predict(b, b * 300, b * 300) == pytest.approx(TRUE.predict(b, b * 300, b * 300), rel=0.08)
    assert model.ridge_tokens() == pytest.approx(TRUE.ridge_tokens(), rel=0.2)
    assert model.fit_rel_rmse < 0.05


def test_fit_without_rates_is_in_seconds_and_noise_free_fit_is_exact():
    samples = [StepSample(n, kv, TRUE.predict(n, kv, n * kv // b), n * kv // b) for n, kv, b in default_grid(48, (100, 1000))]
    model = fit(samples)
    assert model.read_bw == 1.0 and model.flop_rate == 1.0
    assert model.bytes_fixed == pytest.approx(TRUE.bytes_fixed / TRUE.read_bw, rel=1e-6)
    assert model.overhead_s == pytest.approx(TRUE.overhead_s, rel=1e-6)
    assert model.fit_rel_rmse < 1e-9


def test_fit_all_memory_bound_takes_compute_terms_from_the_prior_or_stays_pessimistic():
    # a GPU-like engine: every calibration step is memory-bound, so the compute slope is unseen
    samples = [StepSample(n, kv, TRUE.predict(n, kv, 0), 0) for n, kv, _ in default_grid(8, (128, 1024), batches=())]
    assert not any(TRUE.is_compute_bound(s.num_tokens, s.kv_tokens, 0) for s in samples)
    with_prior = fit(samples, prior=TRUE)
    assert with_prior.flops_per_token == pytest.approx(TRUE.flops_per_token)
    assert with_prior.overhead_s == pytest.approx(TRUE.overhead_s)
    assert with_prior.bytes_fixed == pytest.approx(TRUE.bytes_fixed, rel=1e-6)
    bare = fit(samples)
    # without a prior the ridge sits at the largest measured step: no free speculation is assumed
    assert bare.ridge_tokens() == pytest.approx(8, rel=1e-6)


def test_fit_rejects_unusable_samples():
    with pytest.raises(CalibrationError, match="at least 4"):
        fit([StepSample(1, 10, 0.01)] * 3)
    with pytest.raises(CalibrationError, match="positive finite"):
        fit([StepSample(1, 10, 0.01)] * 3 + [StepSample(2, 10, -1.0)])


def test_calibrate_interleaves_repeats_reports_predicted_vs_measured_and_shows_progress():
    calls = []

    def step(n, kv, seqs):
        calls.append((n, kv, seqs))
        return TRUE.predict(n, kv, n * kv // seqs)

    grid = [(1, 100, 1), (4, 100, 1), (16, 100, 1), (32, 100, 1), (1, 1000, 1), (16, 1000, 1), (32, 1000, 1),
            (16, 1600, 16)]
    model, samples, report = calibrate(step, grid, repeats=2, progress=True, warmup=1)
    assert calls[1:] == grid + grid  # one warm-up call, then repeats interleaved across the grid
    assert len(samples) == 2 * len(grid)
    assert samples[-1].pairs == 1600  # 16 sequences, one new token on 100 cached each
    assert sorted((r["num_tokens"], r["kv_tokens"], r["seqs"]) for r in report) == sorted(grid)
    for r in report:
        assert r["predicted_ms"] == pytest.approx(r["measured_ms"], rel=1e-6)
        assert abs(r["error_pct"]) < 1e-4
        pairs = r["num_tokens"] * r["kv_tokens"] // r["seqs"]
        assert r["bound"] == ("compute" if TRUE.is_compute_bound(r["num_tokens"], r["kv_tokens"], pairs) else "memory")
    assert {r["bound"] for r in report} == {"memory", "compute"}
    with pytest.raises(CalibrationError, match=r"step_fn\(1, 100, 1\)"):
        calibrate(lambda n, kv, seqs: float("nan"), grid, repeats=1, progress=False)
    with pytest.raises(CalibrationError, match="divisible"):
        calibrate(step, [(3, 100, 2)], repeats=1, progress=False)


def test_calibrate_warms_up_for_warmup_s_before_timing_so_slow_first_forwards_are_not_fitted():
    calls, t0 = [], time.perf_counter()

    def step(n, kv, seqs):  # a fresh engine: forwards in the first 0.05 s take 3x as long
        calls.append((n, kv, seqs))
        slow = 3.0 if time.perf_counter() - t0 < 0.05 else 1.0
        return slow * TRUE.predict(n, kv, n * kv // seqs)

    grid = [(1, 100, 1), (4, 100, 1), (16, 100, 1), (32, 100, 1), (1, 1000, 1), (16, 1000, 1)]
    model, samples, report = calibrate(step, grid, repeats=1, progress=False, warmup=0, warmup_s=0.08)
    untimed = calls[:len(calls) - len(grid)]
    assert len(untimed) > len(grid) and untimed[:len(grid)] == grid  # the grid's points in turn
    assert all(abs(r["error_pct"]) < 1e-4 for r in report)
    assert model.predict(1, 100) == pytest.approx(TRUE.predict(1, 100), rel=1e-6)
    with pytest.raises(CalibrationError, match="warmup_s=-1"):
        calibrate(step, grid, repeats=1, progress=False, warmup_s=-1)


def test_prediction_report_shows_error_of_a_wrong_model():
    samples = [StepSample(4, 100, 0.020), StepSample(4, 100, 0.022), StepSample(4, 100, 0.021)]
    slow = StepCostModel(0.0, 0.0, 0.0, 0.0, 1.0, 1.0, source="analytic")
    (row,) = prediction_report(slow, samples)
    assert row["measured_ms"] == pytest.approx(21.0) and row["predicted_ms"] == 0.0
    assert row["error_pct"] == pytest.approx(-100.0)


def test_the_fit_finds_the_step_each_row_tile_adds():
    # AMX-like: 16 rows per tile, each tile past the first 3 ms on a ~15 ms step
    truth = replace(TRUE, row_tile=16, tile_s=0.003)
    assert truth.predict(17, 128) - truth.predict(16, 128) == pytest.approx(0.003 + 270e6 / 400e9)  # the tile, a row's FLOPs
    grid = default_grid(64, (128, 1024), row_tile=16)
    assert {(17, 128, 1), (33, 128, 1)} <= set(grid)
    model, _, _ = calibrate(noisy_step_fn(truth, seed=3, noise=0.02), grid, repeats=3, progress=False, row_tile=16,
                            rates=RATES)
    assert model.row_tile == 16 and model.tile_s == pytest.approx(0.003, rel=0.3)
    for n in (16, 17, 32, 33, 48):
        assert model.predict(n, 128, n * 128) == pytest.approx(truth.predict(n, 128, n * 128), rel=0.08)
    # the same timings fitted as if the rows had no tiles: the step is smeared into the slope
    smooth, _, _ = calibrate(noisy_step_fn(truth, seed=3, noise=0.02), grid, repeats=3, progress=False, rates=RATES)
    assert smooth.tile_s == 0.0 and smooth.predict(17, 128, 17 * 128) < truth.predict(17, 128, 17 * 128) * 0.95
    with pytest.raises(SpecConfigError, match="row_tile"):
        replace(truth, row_tile=0)
    with pytest.raises(CalibrationError, match="row_tile"):
        fit([StepSample(n, 128, truth.predict(n, 128)) for n in (1, 2, 4, 8)], row_tile=0)


def test_json_round_trip_save_load_and_path(tmp_path):
    m = fit([StepSample(n, kv, TRUE.predict(n, kv, n * kv)) for n, kv, _ in default_grid(32, (64, 640), batches=())],
            rates=RATES)
    again = StepCostModel.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m
    path = cost_model_path(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", "bf16", "cpu-xeon-2c-2t")
    assert path.parent == tmp_path / "cost_models"
    # the format in the name: a fit of an older model form is not read as this one
    assert path.name == "HuggingFaceTB-SmolLM2-135M-Instruct--bfloat16--cpu-xeon-2c-2t--v4.json"
    m.save(path)
    assert StepCostModel.load(path) == m
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match=str(path.name)):
        StepCostModel.load(path)
    with pytest.raises(CalibrationError, match="format"):
        StepCostModel.from_json({"overhead_s": 1.0})


def test_invalid_model_fields_are_named():
    with pytest.raises(SpecConfigError, match="read_bw"):
        StepCostModel(0.0, 1.0, 1.0, 1.0, read_bw=0.0, flop_rate=1.0)
    with pytest.raises(SpecConfigError, match="overhead_s"):
        StepCostModel(-1.0, 1.0, 1.0, 1.0, read_bw=1.0, flop_rate=1.0)
    with pytest.raises(SpecConfigError, match="dtype"):
        cost_model_path("/tmp", "m", "int3", "cpu")


def test_prediction_tracker_summarises_error():
    tracker = PredictionTracker(window=4)
    assert tracker.summary() == {"steps": 0}
    for predicted, measured in [(1.0, 2.0), (1.1, 1.0), (1.0, 1.0), (1.2, 1.0), (0.9, 1.0)]:
        tracker.record(predicted, measured)
    s = tracker.summary()  # the first record fell out of the window
    assert s["steps"] == 4
    assert s["median_abs_error_pct"] == pytest.approx(10.0)
    assert s["bias_pct"] == pytest.approx(5.0)


def test_measure_machine_returns_positive_finite_rates_and_caches(tmp_path):
    cache = tmp_path / "machine.json"
    rates = measure_machine("bf16", seconds_budget=0.05, cache_path=cache,
                            gemm_shape=(32, 256, 512), buffer_bytes=16 << 20)
    assert rates.dtype == "bfloat16" and rates.machine_id == machine_id("cpu")
    for v in (rates.read_bw_bytes_per_s, rates.matmul_flops_per_s):
        assert math.isfinite(v) and v > 0
    data = json.loads(cache.read_text())
    assert f"{machine_id('cpu')}|bfloat16" in data
    assert measure_machine(dtype_name("bf16"), seconds_budget=0.05, cache_path=cache) == rates  # from the cache
    fp32 = measure_machine("float32", seconds_budget=0.05, cache_path=cache,
                           gemm_shape=(32, 256, 512), buffer_bytes=16 << 20)
    assert fp32.dtype == "float32" and len(json.loads(cache.read_text())) == 2
    with pytest.raises(SpecConfigError, match="dtype"):
        measure_machine("int8", seconds_budget=0.05)
