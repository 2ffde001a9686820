"""The step-cost fit a warm-up makes for speculation on the quantized path
(calibration.fit_cost_model_when_idle): made once on a few real forwards, saved where `agentrt
calibrate` saves, loaded by the next engine instead of fitting again; never made where it has no
business (no drafter, a cost model already in use, work in the engine)."""
from __future__ import annotations

import asyncio

import pytest

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine import calibration
from agentrt.engine.async_engine import AsyncEngine


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    from agentrt.kernels.quant_build import quant_kernels

    quant_kernels()  # loaded from the user's cache before it moves: not compiled again


def _warm(engine) -> None:
    front = AsyncEngine(engine)
    try:
        asyncio.run(front.warm_up())
    finally:
        front.close()


def test_a_warm_up_fits_once_and_the_next_engine_loads_the_fit(smollm2_quant, make_engine, own_cache, monkeypatch):
    engine = make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix"))
    _warm(engine)
    model = engine.spec.cost_model
    tile = calibration.row_tile(engine)
    grid = calibration.quick_grid(128, engine.blocks.num_slots, engine.blocks.block_size, engine.max_model_len, tile)
    assert any(seqs > 1 for _, _, seqs in grid)  # batches of sequences timed too, where the KV has room
    assert model.source == "fit" and model.num_samples == len(grid) and model.row_tile == tile
    if tile > 1:  # AMX: one row past a tile timed, so the fit sees the step a first draft of 16 rows pays
        assert (tile + 1, 128, 1) in grid
    assert calibration.model_cost_path(engine).is_file()
    assert engine.blocks.num_free == engine.blocks.allocator.num_blocks  # the scratch sequences' blocks are back

    def no_second_fit(*a, **k):
        raise AssertionError("fitted again")

    monkeypatch.setattr(calibration, "quick_cost_model", no_second_fit)
    again = make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix"))
    _warm(again)
    assert again.spec.cost_model == model  # read from the file


def test_no_fit_without_a_drafter_with_a_model_in_use_or_with_work(smollm2_quant, make_engine, own_cache, monkeypatch):
    monkeypatch.setattr(calibration, "quick_cost_model", lambda *a, **k: pytest.fail("fitted"))
    assert calibration.fit_cost_model_when_idle(make_engine(smollm2_quant)) is None  # no speculation
    in_use = make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix"))
    in_use.spec.cost_model  # built on first need (the analytic roofline): kept
    assert calibration.fit_cost_model_when_idle(in_use) is None
    busy = make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix"))
    busy.add_request([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))
    assert calibration.fit_cost_model_when_idle(busy) is None


def test_a_fit_that_fails_leaves_the_roofline_and_the_warm_up_goes_on(smollm2_quant, make_engine, own_cache, monkeypatch):
    from agentrt.errors import CalibrationError

    def unusable(*a, **k):
        raise CalibrationError("step_fn(1, 128) returned 0.0, not a time")

    monkeypatch.setattr(calibration, "quick_cost_model", unusable)
    engine = make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix"))
    _warm(engine)  # the warm-up request still ran
    assert not calibration.model_cost_path(engine).exists()
    assert engine.spec.cost_model.source == "analytic"


def test_a_fit_the_timings_do_not_bear_out_twice_is_neither_used_nor_cached(smollm2_quant, make_engine, own_cache,
                                                                          monkeypatch):
    from agentrt.spec.cost_model import StepCostModel

    fits = []

    def noisy(*a, **k):  # what a fit of forwards timed while other processes held the cores looks like
        fits.append(StepCostModel(0.0, 1.0, 1.0, 1.0, 1.0, 1.0, source="fit", fit_rel_rmse=0.25, num_samples=7))
        return fits[-1]

    monkeypatch.setattr(calibration, "quick_cost_model", noisy)
    engine = make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix"))
    assert calibration.fit_cost_model_when_idle(engine) is None
    assert len(fits) == 2  # measured once more before giving up
    assert not calibration.model_cost_path(engine).exists()
    assert engine.spec.cost_model.source == "analytic"


def test_run_on_engine_thread_gives_the_result_or_the_exception(smollm2_quant, make_engine):
    front = AsyncEngine(make_engine(smollm2_quant))

    def boom():
        raise ValueError("boom")

    async def both():
        assert await front.run_on_engine_thread(lambda: 6 * 7) == 42
        with pytest.raises(ValueError, match="boom"):
            await front.run_on_engine_thread(boom)

    try:
        asyncio.run(both())
    finally:
        front.close()


@pytest.mark.parametrize("prefault", [True, False])
def test_a_warm_up_with_the_kv_cache_mapped_at_start_sizes_the_step_buffers_on_the_engine_thread(
        smollm2_quant, make_engine, own_cache, monkeypatch, prefault):
    import threading

    engine = make_engine(smollm2_quant, prefault_kv=prefault, max_num_batched_tokens=640)
    calls = []
    reserve = engine.model.reserve_step_buffers
    monkeypatch.setattr(engine.model, "reserve_step_buffers",
                        lambda n: (calls.append((n, threading.current_thread().name)), reserve(n)))
    _warm(engine)
    assert calls == ([(640, "agentrt-engine")] if prefault else [])


def test_the_quick_grid_tells_a_row_s_linear_cost_from_its_attention_cost():
    """On one context length every sample's attention pairs are that length times its new tokens,
    so a row's cost splits between the linears and attention only by the roofline's kinks, which
    timing noise blurs; the quick grid's second, longer context pins it. Ground truth shaped like
    the quantized path (Xeon, AMX): a 4.3 ms weight read, 0.55 ms of linears per row past the
    ridge, 1.4 us per cached token, 0.66 us per query-key pair; the prior prices pairs 10x too
    high; 5% log-normal noise. A verify of 5, 9 and 17 rows at 800 cached tokens, as the k
    controller prices it, must come out within 20% on every seed (with the 128-token points
    alone: median 24%, worst 70% over 20 seeds; with the long ones: 5%, 17%)."""
    import numpy as np

    from agentrt.spec.cost_model import StepCostModel, calibrate

    bw, rate = 16e9, 190e9
    truth = StepCostModel(overhead_s=0.0003, bytes_fixed=0.0043 * bw, bytes_per_kv_token=1.4e-6 * bw,
                          flops_per_token=0.00055 * rate, read_bw=bw, flop_rate=rate, attn_flops_per_pair=0.66e-6 * rate)
    prior = StepCostModel(overhead_s=0.0, bytes_fixed=0.004 * bw, bytes_per_kv_token=1.0e-6 * bw,
                          flops_per_token=0.0003 * rate, read_bw=bw, flop_rate=rate, attn_flops_per_pair=6.6e-6 * rate)
    grid = calibration.quick_grid(128, 100_000, 16)
    assert sorted({kv // seqs for _, kv, seqs in grid}) == [128, 1024]
    assert max(kv + n for n, kv, seqs in calibration.quick_grid(128, 100_000, 16, max_len=600) if seqs == 1) <= 600
    assert {kv for _, kv, _ in calibration.quick_grid(128, 100_000, 16, max_len=256)} == {128, 2048}  # no room to tell
    for seed in range(10):
        rng = np.random.default_rng(seed)

        def step(n: int, kv: int, seqs: int) -> float:
            return truth.predict(n, kv, n * kv // seqs) * float(np.exp(rng.normal(0.0, 0.05)))

        model, _, _ = calibrate(step, grid, repeats=1, progress=False, prior=prior)
        for n in (5, 9, 17):
            assert model.predict(n, 800, 800 * n) == pytest.approx(truth.predict(n, 800, 800 * n), rel=0.2), (seed, n)
