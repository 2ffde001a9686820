"""The workload benchmark's parts: seeded heavy-tailed tool latencies keyed by program and call,
the k-by-load split of the engine's step log, averaging over repeats, and a smoke run of one
policy over the three examples on a tiny random model (plumbing only; speed is not checked)."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from agentrt.bench import workload, workload_load, workload_stats


def test_tool_latency_matches_its_median_and_p90():
    lat = workload_load.ToolLatency(median_s=0.3, p90_s=3.0, cap_s=15.0, seed=1)
    assert lat.sigma == pytest.approx(math.log(10) / 1.2816, rel=1e-4)
    xs = [lat.draw(i, "search", 0) for i in range(4000)]
    # n = 4000: the standard error of the log-median is ~0.036 and of the log-p90 ~0.049, so
    # +-10% and +-15% are ~3 standard errors (and the draws are seeded: the test is deterministic).
    assert workload_stats.percentile(xs, 0.5) == pytest.approx(0.3, rel=0.10)
    assert workload_stats.percentile(xs, 0.9) == pytest.approx(3.0, rel=0.15)
    assert max(xs) == 15.0  # the cap bounds the tail
    # Same key, same latency; another seed, another one.
    assert lat.draw(3, "search", 2) == lat.draw(3, "search", 2) != lat.draw(3, "search", 3)
    assert workload_load.ToolLatency(seed=2).draw(3, "search", 2) != workload_load.ToolLatency(seed=1).draw(3, "search", 2)


async def test_delayed_tools_know_their_program_and_call_number():
    from agentrt.tools import ToolRegistry, tool

    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    lat = workload_load.ToolLatency(median_s=0.001, p90_s=0.002, cap_s=0.01)
    tools, log = workload_load.delayed_tools([echo], lat)
    registry = ToolRegistry(tools)

    async def program(i: int, calls: int) -> list[str]:
        workload_load._PROGRAM.set(i)  # a task's own context, as the bench sets it before submit()
        return [(await registry.call("echo", {"text": f"{i}"})).value for _ in range(calls)]

    outs = await asyncio.gather(asyncio.create_task(program(0, 2)), asyncio.create_task(program(5, 1)))
    assert outs == [["0", "0"], ["5"]]
    assert sorted(log) == sorted([(0, "echo", lat.draw(0, "echo", 0)), (0, "echo", lat.draw(0, "echo", 1)),
                                  (5, "echo", lat.draw(5, "echo", 0))])
    assert tools[0].timeout_s is None and tools[0].name == "echo"
    await registry.aclose()


def step(batch: int, k: list[int], num_new: list[int], forced: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(batch_size=batch, k=k, num_new=num_new, forced=forced or [0] * len(k))


def test_k_by_load_splits_decoding_rows_by_batch_size():
    log = [step(1, [8], [1], [5]), step(2, [6, 0], [1, 300]), step(4, [1, 2, 0, 0], [1, 1, 1, 50], [0, 2, 0, 0]),
           step(3, [5, 5, 5], [1, 1, 1])]
    split = workload_stats.k_by_load(log, 8)  # idle: batch <= 2, busy: batch >= 4
    assert (split["idle_batch_max"], split["busy_batch_min"]) == (2, 4)
    assert (split["idle_rows"], split["idle_k_sum"]) == (2, 14)  # the prefill row does not count
    assert (split["busy_rows"], split["busy_k_sum"]) == (3, 3)
    assert (split["idle_free_k_sum"], split["busy_free_k_sum"]) == (9, 1)  # forced drafts left out
    means = workload_stats.k_means([split, workload_stats.k_by_load([step(1, [2], [1])], 8)])
    assert means == {"k_idle_mean": pytest.approx(16 / 3), "k_busy_mean": pytest.approx(1.0),
                     "k_free_idle_mean": pytest.approx(11 / 3), "k_free_busy_mean": pytest.approx(1 / 3)}
    assert workload_stats.k_means([workload_stats.k_by_load([], 8)]) == {"k_idle_mean": None, "k_busy_mean": None,
                                                             "k_free_idle_mean": None, "k_free_busy_mean": None}


def test_average_over_repeats_and_summary():
    loads = [{"idle_k_sum": 8, "idle_free_k_sum": 6, "idle_rows": 2, "busy_k_sum": 1, "busy_free_k_sum": 0, "busy_rows": 1}]
    rows = [{"policy": "x", "done": 6, "mean_s": 10.0, "alpha": None},
            {"policy": "x", "done": 5, "mean_s": 14.0, "alpha": None}]
    avg = workload_stats.average(rows, [{"k_by_load": loads[0]}, {"k_by_load": loads[0]}])
    assert avg == {"policy": "x", "done": 5, "mean_s": 12.0, "alpha": None, "k_idle_mean": 4.0, "k_busy_mean": 1.0,
                   "k_free_idle_mean": 3.0, "k_free_busy_mean": 0.0}
    base = {"mean_s": 12.0, "p90_s": 20.0, "makespan_s": 30.0, "prefill_saved": 0, "done": 6,
            "k_idle_mean": 0.0, "k_busy_mean": 0.0}
    full = dict(base, mean_s=6.0, p90_s=10.0, makespan_s=20.0, prefill_saved=900, k_idle_mean=4.0, k_busy_mean=1.0)
    s = workload_stats.summarize([base, dict(base, mean_s=9.0), full])
    assert s["mean_latency_speedup_vs_fcfs"] == 2.0 and s["p90_latency_speedup_vs_fcfs"] == 2.0
    assert s["mean_latency_speedup_vs_fixed_k4"] == 1.5 and (s["k_idle_mean"], s["k_busy_mean"]) == (4.0, 1.0)


def test_speedup_interval_from_paired_repeats():
    """A t interval on the log ratios: per-repeat ratios 1.2, 1.5, 1.8 (logs 0.182, 0.405,
    0.588; mean 0.392, sd 0.203, t(2) = 4.303) give exp(0.392 -+ 0.505) = 0.89 .. 2.45; equal
    ratios give a point; one repeat gives none."""
    lo, hi = workload_stats.speedup_interval([1.2, 3.0, 5.4], [1.0, 2.0, 3.0])
    assert abs(lo - 0.893) < 0.005 and abs(hi - 2.45) < 0.01
    lo, hi = workload_stats.speedup_interval([3.0, 6.0], [2.0, 4.0])
    assert abs(lo - 1.5) < 1e-9 and abs(hi - 1.5) < 1e-9
    assert workload_stats.speedup_interval([3.0], [2.0]) is None
    assert workload_stats.t975(1) == 12.706 and abs(workload_stats.t975(20) - 2.086) < 0.002
    assert abs(workload_stats.t975(11) - 2.201) < 0.003 and abs(workload_stats.t975(200) - 1.972) < 0.002


def test_inputs_name_known_cities_and_no_program_of_32_repeats_another():
    import json

    cities = json.loads((workload_load.EXAMPLES_DIR / "data" / "weather.json").read_text())["cities"]
    assert all(len(workload_load.INPUTS[n]) == 11 for n in workload_load.EXAMPLE_NAMES)
    programs = workload_load.workload(33)
    assert len({(name, str(inputs)) for name, inputs in programs}) == 33
    for inputs in workload_load.INPUTS["trip_planner"]:
        assert any(c in inputs["request"] for c in cities), inputs
    assert [name for name, _ in workload_load.workload(5)] == ["trip_planner", "research", "sql_agent", "trip_planner",
                                                          "research"]


async def test_one_policy_runs_the_examples_on_a_tiny_model(tiny_model_dir):
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.runtime.loader import load_example

    loaded = load_model(str(tiny_model_dir("smollm")), "float32", progress=False)
    examples = {n: load_example(workload_load.EXAMPLES_DIR / f"{n}.py") for n in workload_load.EXAMPLE_NAMES}
    lat = workload_load.ToolLatency(median_s=0.001, p90_s=0.002, cap_s=0.01)
    out = await workload.run_policy(workload.POLICIES[2], loaded, None, examples, 3, lat, 12, 8192, None)
    row, detail = out["row"], out["detail"]
    assert row["policy"] == "c full runtime" and 0 <= row["done"] <= 3 and len(detail["programs"]) == 3
    assert row["steps"] > 0 and 0 < row["busy_frac"] <= 1.0 + 1e-9 and row["mean_s"] <= row["makespan_s"] + 1e-6
    assert detail["prefix_stats"] is not None and row["prefill_saved"] == detail["prefix_stats"]["hit_tokens"]
    assert {p["run_id"] for p in detail["programs"]} == {"00-trip_planner", "01-research", "02-sql_agent"}


def test_critical_path_split_follows_the_inputs_waited_on_last():
    def node(run, name, kind, start, end, waited_on=None, wait_end=None):
        sid = f"{run}/{name}"
        attrs = {"agentrt.node": name, "agentrt.node.kind": kind}
        if waited_on:
            attrs["agentrt.waited_on"] = waited_on
        recs = [{"type": "span", "run_id": run, "span_id": sid, "parent_id": None, "start": start, "end": end,
                 "attributes": attrs}]
        if wait_end is not None:
            recs.append({"type": "span", "run_id": run, "span_id": sid + "/w", "parent_id": sid, "start": start,
                         "end": wait_end, "attributes": {"agentrt.phase": "waiting"}})
        return recs

    records = (node("r", "plan", "llm", 0.0, 1.0) + node("r", "slow", "tool", 0.0, 3.0, "plan", 1.0)
               + node("r", "fast", "tool", 0.0, 1.5, "plan", 1.0)
               + node("r", "answer", "llm", 0.0, 4.0, "slow", 3.0)
               + node("s", "only", "llm", 0.0, 2.0))
    tool, llm = workload_stats.critical_path_split(records)
    assert tool == pytest.approx((2.0 + 0.0) / 2)  # run r: slow (1 -> 3); run s: none
    assert llm == pytest.approx((1.0 + 1.0 + 2.0) / 2)  # r: plan and answer; s: only


def test_post_tool_ttft_runs_from_the_tool_end_to_the_first_decode_step():
    def span(run, sid, parent, start, end, **attrs):
        return {"type": "span", "run_id": run, "span_id": sid, "parent_id": parent, "start": start, "end": end,
                "attributes": attrs}

    records = [
        span("r", "t", None, 0.0, 2.0, **{"agentrt.node": "fetch", "agentrt.node.kind": "tool"}),
        span("r", "a", None, 0.0, 3.0, **{"agentrt.node": "answer", "agentrt.node.kind": "llm",
                                          "agentrt.waited_on": "fetch"}),
        span("r", "a/w", "a", 0.0, 1.0, **{"agentrt.phase": "waiting"}),
        span("r", "a/x", "a", 1.0, 1.5, **{"agentrt.phase": "prefill_ahead"}),
        span("r", "a/v", "a", 1.5, 2.0, **{"agentrt.phase": "waiting"}),
        span("r", "a/p", "a", 2.0, 2.25, **{"agentrt.phase": "prefill"}),
        span("r", "a/d", "a", 2.25, 3.0, **{"agentrt.phase": "decode"}),
        # an LLM node that waited on another LLM node is not counted
        span("r", "b", None, 3.0, 4.0, **{"agentrt.node": "again", "agentrt.node.kind": "llm",
                                          "agentrt.waited_on": "answer"}),
        span("r", "b/d", "b", 3.5, 4.0, **{"agentrt.phase": "decode"}),
    ]
    assert workload_stats.post_tool_ttft(records) == [0.25]
    # the prefill-ahead phase is part of the wait, not of the LLM time on the critical path
    assert workload_stats.critical_path_split(records) == pytest.approx((2.0, 1.0 + 1.0))


def test_arrival_times_all_at_once_or_seeded_poisson():
    assert workload_load.arrival_times(4, None) == [0.0] * 4
    times = workload_load.arrival_times(2000, 4.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0.0
    # exponential gaps with mean 0.25 s: sd of the mean of 1999 gaps is 0.25 / sqrt(1999) = 0.0056
    assert abs(sum(gaps) / len(gaps) - 0.25) < 4 * 0.0056
    assert workload_load.arrival_times(5, 4.0, seed=3) == times[:5] != workload_load.arrival_times(5, 4.0, seed=4)
    with pytest.raises(ValueError, match="--rate"):
        workload_load.arrival_times(3, 0.0)


async def test_staggered_programs_count_their_time_from_their_own_submit(tiny_model_dir):
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.runtime.loader import load_example

    loaded = load_model(str(tiny_model_dir("smollm")), "float32", progress=False)
    examples = {n: load_example(workload_load.EXAMPLES_DIR / f"{n}.py") for n in workload_load.EXAMPLE_NAMES}
    lat = workload_load.ToolLatency(median_s=0.001, p90_s=0.002, cap_s=0.01)
    arrivals = [0.0, 0.4, 0.8]
    out = await workload.run_policy(workload.POLICIES[0], loaded, None, examples, 3, lat, 8, 8192, None, arrivals)
    row, programs = out["row"], out["detail"]["programs"]
    assert row["makespan_s"] >= 0.8
    for p, at in zip(programs, arrivals):  # a program submitted at `at` ran within the rest of the makespan
        assert p["duration_s"] <= row["makespan_s"] - at + 0.01, (p, at)
