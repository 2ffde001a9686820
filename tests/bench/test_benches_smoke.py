"""Smoke runs of the spec, toolcall and batch-sweep benchmarks' measuring functions on a tiny random
model: every row and summary key is produced and the accounting adds up. Speed is not checked."""
from __future__ import annotations

import math

import pytest

CHATS = {
    "prose": [{"role": "user", "content": "the cat sat on the mat"}],
    "agent": [{"role": "user", "content": "a b c a b c a b c a b c"}],
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from agentrt.engine.loading.model_loader import load_model

    return load_model(str(tiny_model_dir("smollm")), "float32", progress=False)


@pytest.fixture(scope="module")
def tiny_hf(tiny):
    from agentrt.bench.spec import load_hf

    return load_hf(tiny)


def test_spec_bench_rows_and_summary(tiny, tiny_hf):
    from agentrt.bench import spec

    prompts = spec.encode_prompts(tiny, CHATS)
    vs = spec.variants((2,), layerskip=1)
    best = spec.measure(tiny, tiny_hf, prompts, vs, max_tokens=12, repeats=1)
    rows = spec.table_rows(best, prompts, vs)
    assert len(rows) == len(prompts) * len(vs)
    assert {r["config"] for r in rows} == {v.label for v in vs}
    for r in rows:
        assert 1 <= r["tokens"] <= 12
        if r["config"].startswith(("suffix", "layerskip")):
            assert r["tok_per_pass"] >= 1.0
    summary = spec.summarize(rows)
    assert set(summary) >= {"best_speedup_vs_nospec", "vs_hf_prompt_lookup"}
    assert all(not isinstance(v, float) or math.isfinite(v) for v in summary.values())


def test_toolcall_bench_rows_and_summary(tiny, tiny_hf):
    from agentrt.bench import toolcall
    from agentrt.bench.prompts import TOOLS
    from agentrt.structured.output_format import parse_response_format

    tools = [t for t in TOOLS if t["function"]["name"] == "get_stock_price"]
    rf = toolcall.response_format(tools)
    chats = [[{"role": "user", "content": q}] for q in ("price of AAPL?", "price of NVDA?")]
    prompts = toolcall.encode_requests(tiny, chats, rf, max_tokens=16)
    best = toolcall.measure(tiny, tiny_hf, prompts, rf, toolcall.POLICIES, max_tokens=16, repeats=1)
    expected = ["get_stock_price"] * len(chats)
    rows = toolcall.table(best, toolcall.POLICIES, parse_response_format(rf), expected, tiny.tokenizer)
    assert [r["policy"] for r in rows] == [p.label for p in toolcall.POLICIES]
    nospec, spec = rows[0], rows[1]
    assert nospec["tok_per_pass"] == 1.0 and nospec["speedup"] == 1.0
    assert spec["tok_per_pass"] >= 1.0
    # greedy: the template drafts change no output, so both policies emit the same calls
    detail = toolcall.per_request(best, toolcall.POLICIES, expected)
    assert len(detail) == len(chats) and all(d["same_tokens"] for d in detail), detail
    assert all(d["same_tokens_trees_chains"] for d in detail), detail  # token trees change no output either
    assert (spec["valid"], spec["tokens"]) == (nospec["valid"], nospec["tokens"])
    summary = toolcall.summarize(rows, len(chats))
    assert summary["total"] == len(chats) and set(summary) >= {"tokens_per_pass", "speedup", "valid",
                                                         "single_call_start_earlier_tokens", "single_call_start_earlier_ms"}
    assert summary["tree_vs_chain_tokens_per_pass"] > 0
    assert summary["valid"] == summary["valid_nospec"] == spec["valid"]


def test_toolcall_bench_parallel_calls_part(tiny):
    """The parallel part times lists of calls under the engine policies and reads how much earlier
    the first call's tool starts than the turn's end from the template policy's runs."""
    from agentrt.bench import toolcall
    from agentrt.bench.toolcall_parallel import run_parallel

    # an enum argument: even a random model's calls close within a few tokens
    tools = [{"type": "function", "function": {"name": "price", "description": "price", "parameters": {
        "type": "object", "properties": {"ticker": {"enum": ["AAPL", "MSFT", "NVDA"]}}, "required": ["ticker"]}}}]
    chats = [[{"role": "user", "content": q}] for q in ("prices of AAPL and MSFT?", "prices of NVDA and AMZN?")]
    policies = [p for p in toolcall.POLICIES if not p.hf]
    rows, summary = run_parallel(tiny, policies, 1, None, toolcall.measure, toolcall.encode_requests,
                                 toolcall.first_call_start_earlier, policies[1].label, lambda msg: None,
                                 tools=tools, chats=chats, max_tokens=48)
    assert [r["policy"] for r in rows] == [p.label for p in policies]
    assert summary["parallel_total"] == 2 and 0 <= summary["parallel_valid"] <= 2
    assert set(summary) >= {"first_call_start_earlier_tokens", "first_call_start_earlier_ms", "parallel_calls_per_turn"}
    assert summary["parallel_calls_per_turn"] == rows[1]["calls_per_turn"] >= 1
    assert summary["first_call_start_earlier_tokens"] >= 1 and summary["first_call_start_earlier_ms"] > 0


def test_toolcall_budget_sweep_is_valid_at_every_budget(tiny):
    """A random model writes arbitrary (grammar-allowed) calls: every output still parses at
    every budget from the minimum up, which is what valid_under_budget reports."""
    from agentrt.bench import toolcall_budget

    def tool(name, properties):  # small schemas: the tiny model's context is 512 tokens
        return {"type": "function", "function": {"name": name, "description": name, "parameters": {
            "type": "object", "properties": properties, "required": sorted(properties)}}}

    tools = [tool("weather", {"city": {"type": "string", "maxLength": 12},
                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}})]
    chats = [[{"role": "user", "content": q}] for q in ("book two meetings", "search a and b")]
    rows, summary = toolcall_budget.run_budgets(tiny, None, ["none", "template"], quick=True, log=lambda msg: None,
                                                tools=tools, chats=chats, span=24)
    assert [r["outputs"] for r in rows] == [12, 12]
    assert summary["valid_under_budget"] == 1.0 and summary["budget_outputs"] == 24
    assert all(r["valid"] == r["outputs"] and r["min_budget"] > 10 for r in rows)


def test_batch_sweep_rows_and_breakeven(tiny):
    from agentrt.bench import batch_sweep
    from agentrt.spec.cost_model import StepCostModel

    cost = StepCostModel(overhead_s=0.001, bytes_fixed=0.004, bytes_per_kv_token=0.0, flops_per_token=0.001,
                         read_bw=1.0, flop_rate=1.0)
    tok = tiny.tokenizer
    prompts = [tok.encode(t) for t in ("a b c a b c a b c", "the the the the", "hello world", "x y z x y z")]
    batches = [2, 4]
    best = batch_sweep.measure(tiny, prompts, batches, batch_sweep.POLICIES, max_tokens=6, repeats=1, cost_model=cost)
    rows = batch_sweep.table(best, batches, batch_sweep.POLICIES)
    assert [r["B"] for r in rows] == batches
    for r in rows:
        assert 0 < r["adaptive/best"] <= 1.0
        assert all(r[p.label] > 0 for p in batch_sweep.POLICIES)
    predicted, alpha, context = batch_sweep.predicted_breakeven(best, batches, cost)
    assert 0.0 <= alpha <= 1.0 and context > 0
    summary = batch_sweep.summarize(rows, predicted)
    assert set(summary) == {"worst_adaptive_vs_best", "breakeven_measured", "breakeven_predicted",
                            "adaptive_beats_k4_where_k4_loses"}
    # every request emitted exactly max_tokens (ignore_eos), in every policy
    assert all(v["totals"].emitted == 6 * 4 for v in best.values())


def test_attention_bench_rows_and_summary():
    from agentrt.bench import attention
    from agentrt.kernels.cpu_build import unsupported_reason

    if unsupported_reason() is not None:
        pytest.skip(f"CPU kernels cannot run here: {unsupported_reason()}")
    shapes = [(1, 40, 1), (3, 70, 2)]
    rows = attention.measure(shapes, (4, 2, 16), layers=2, passes=2)
    assert [(r["B"], r["ctx"], r["new tokens"], r["queries per kv head"]) for r in rows] == [(1, 40, 1, 2), (3, 70, 2, 4)]
    for r in rows:
        assert all(r[f"{name} ms"] > 0 for name in attention.VARIANTS)
        assert r["speedup"] == pytest.approx(r["no prefetch ms"] / r["default ms"])
    summary = attention.summarize(rows)
    speedups = [r["speedup"] for r in rows]
    assert summary == {"b16_decode_speedup": speedups[0], "worst_speedup": min(speedups), "best_speedup": max(speedups)}


def test_attention_bench_kv_write_rows():
    from agentrt.bench import attention
    from agentrt.kernels.cpu_build import unsupported_reason

    if unsupported_reason() is not None:
        pytest.skip(f"CPU kernels cannot run here: {unsupported_reason()}")
    kv = attention.measure_kv_write((4, 2, 16), layers=2, tokens=20, steps=2, repeats=1)
    assert set(kv) == {"4k_pages", "huge_pages", "touched"} and all(ms > 0 for ms in kv.values())


def test_determinism_section_rows(smollm2_source):
    """bench decode --determinism: every drafter's row (on 3 requests), and the verify steps."""
    from agentrt.bench import determinism
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.kernels.cpu_build import unsupported_reason

    if unsupported_reason() is not None:
        pytest.skip(f"bf16 decoding runs on the C kernels: {unsupported_reason()}")
    loaded = load_model(str(smollm2_source.path), "bfloat16", progress=False)
    rows = determinism.identical_outputs(loaded, max_tokens=12, limit=3)
    assert len(rows) == len(determinism.DRAFTERS) and rows[0]["vs_plain_batch"] == 1
    assert all(r["identical"] == "3/3" and r["identical_fraction"] == 1 and r["tok_s"] > 0 for r in rows)
    ms = determinism.verify_step_ms(loaded, ks=(0, 4), ctx=40, reps=2)
    assert set(ms) == {0, 4} and all(v > 0 for v in ms.values())


def test_verify_cost_table_shapes(tiny):
    """bench decode's verify cost: every shape timed (interleaved), the one-row step first, and the
    rows as ratios to it; the prefill figure is tokens per second of one forward."""
    from agentrt.bench import verify_cost as vc

    ms = vc.forward_ms(tiny.model, reps=2)
    assert list(ms) == vc.shapes() and vc.shapes()[0] == (1, 1)
    assert all(v > 0 for v in ms.values())
    row = vc.cost_row("tiny", ms)
    assert row["step1_ms"] == ms[(1, 1)] and row["1x16"] == ms[(1, 16)] / ms[(1, 1)]
    assert set(row) == {"path", "step1_ms", "1x2", "1x4", "1x8", "1x16", "1x32", "8x1", "8x8"}
    assert vc.prefill_tok_s(tiny.model, reps=1, n=40) > 0


def test_verify_cost_at_a_long_context(tiny):
    """The long-context rows: one sequence fed each of LONG_ROWS rows, each forward over the
    one-row one, and what the extra rows add to the forward beside what they add to the quantized
    decoder's attention alone on caches of the model's heads."""
    from agentrt.bench import verify_cost as vc
    from agentrt.kernels.quant_build import quant_kernels

    if quant_kernels() is None:
        pytest.skip("the quantized kernels do not run here (their attention is what the rows time)")
    rows, ratio16 = vc.long_context_rows(tiny.model, reps=1, context=70)
    assert [r["rows"] for r in rows] == list(vc.LONG_ROWS) and rows[0]["over_step1"] == 1.0
    assert ratio16 == rows[-1]["over_step1"] and all(r["forward_ms"] > 0 for r in rows)
    assert rows[0]["added_ms"] == 0 and rows[0]["attention_added_ms"] == 0
    assert rows[0]["attention_share_of_added"] is None
    assert all(r["attention_share_of_added"] is not None for r in rows[1:])
