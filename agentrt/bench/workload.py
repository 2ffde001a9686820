"""`agentrt bench workload`: N agent programs at once on one engine, three policies side by side.

The programs are the three examples (trip_planner, research, sql_agent) in turn, each with its own
inputs; every tool call first waits a seeded heavy-tailed latency (log-normal, median 0.3 s, p90
3 s, capped at 15 s) drawn from (seed, program, tool, n-th call of that tool in the program), so
each policy sees the same latencies. The programs are submitted to one Runtime over one fresh
engine per policy, its KV cache mapped before the clock starts (the model is loaded once), all at
once or, with --rate R, as a seeded Poisson process of R per second:

    a  call-level FCFS: no program awareness, no prefix cache, no speculation.
    b  (a) with the suffix drafter at fixed k = 4.
    c  the full runtime: prefix cache, KV held through tool stalls, least-attained-service
       priorities with critical-path awareness, template drafter (counting lists continued) with
       adaptive k, tools and fan-out branches started on the final members of a JSON output
       still generating.

Per policy: makespan (first submit to last program end), mean and p90 program completion time
(each from its own submit), prefill tokens saved (engine prefix-cache hits and prompt tokens
shared with a prefill of the same step), engine busy fraction (sum of step times / makespan),
and mean k over decoding rows in steps where most programs stall on tools (batch <= N/4) and in
steps where the batch is full (batch >= N/2), from the engine's step log; also the same for free
drafts only (k_free_*: not grammar-forced), since forced drafts are certain and
worth their verified position at any load, while free ones are the speculation load should cut.

Summary: mean_latency_speedup_vs_fcfs, p90_latency_speedup_vs_fcfs (a over c; with two or more
repeats also a 95% interval of the first from the per-repeat ratios), k_idle_mean and
k_busy_mean (of c), k_free_idle_mean and k_free_busy_mean; also the split of completion time along
each program's critical path: tool_critical_path_s (the same under every policy) and
llm_critical_path_speedup_vs_fcfs (a over c: what the engine policy controls). Goals: mean_latency_speedup_vs_fcfs
>= 1.5 and k_idle_mean > k_busy_mean.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.bench.workload_load import (
    _PROGRAM,
    EXAMPLE_NAMES,
    EXAMPLES_DIR,
    ToolLatency,
    arrival_times,
    delayed_tools,
    workload,
)
from agentrt.bench.workload_stats import (
    average,
    critical_path_split,
    post_tool_ttft,
    k_by_load,
    k_means,
    percentile,
    same_outputs,
    speedup_done_everywhere,
    speedup_interval,
    summarize,
)


@dataclass(frozen=True)
class Policy:
    label: str
    drafter: str  # SpecConfig drafter
    k: int | None  # SpecConfig k (None = adaptive)
    prefix_caching: bool
    scheduling: str  # runtime policy name
    kv_hold: bool
    shortest_prefill_first: bool = False  # engine: shortest prompt first, bursts split over steps
    counting_drafts: bool = True  # drafter: counting lists and dates continued (spec/drafters/progression.py)
    stream_outputs: bool = False  # runtime: tools and fan-out branches start on final members of a JSON output
    prefill_ahead: bool = True  # runtime: the next call's known prompt start prefilled during tool stalls


POLICIES = [
    Policy("a fcfs", "none", 0, False, "fcfs", False),
    Policy("b fcfs+suffix k=4", "suffix", 4, False, "fcfs", False),
    Policy("c full runtime", "template", None, True, "las", True, stream_outputs=True),
]
# always run beside (c): what prefill-ahead does to the time from a tool's end to the next token
AHEAD_OFF = Policy("c without prefill-ahead", "template", None, True, "las", True, stream_outputs=True,
                   prefill_ahead=False)
# --ablate: (c) less one part each, to see what it contributes
ABLATIONS = [
    Policy("c with fcfs", "template", None, True, "fcfs", True, stream_outputs=True),
    Policy("c without kv holds", "template", None, True, "las", False, stream_outputs=True),
    Policy("c with shortest-prompt-first prefill", "template", None, True, "las", True, True, stream_outputs=True),
    Policy("c without counting drafts", "template", None, True, "las", True, counting_drafts=False,
           stream_outputs=True),
    Policy("c without streamed dispatch", "template", None, True, "las", True),
]


# ---- one policy -------------------------------------------------------------------------------


def new_engine(loaded, policy: Policy, kv_tokens: int, cost_model):
    from agentrt.engine import EngineConfig, LLMEngine, SpecConfig

    dtype = str(loaded.model.dtype).removeprefix("torch.")
    # prefault_kv: like a server's engine, page faults of fresh KV memory are paid at start, not by
    # the first steps of the programs being timed (every policy alike)
    cfg = EngineConfig(model=str(loaded.source.path), dtype=dtype, kv_cache_tokens=kv_tokens, prefault_kv=True,
                       prefix_caching=policy.prefix_caching,
                       prefill_order="shortest" if policy.shortest_prefill_first else "arrival",
                       group_prefills=policy.shortest_prefill_first, spec=SpecConfig(drafter=policy.drafter, k=policy.k))
    engine = LLMEngine(cfg, loaded=loaded)
    if not policy.counting_drafts and engine.spec.drafter is not None:
        getattr(engine.spec.drafter, "suffix", engine.spec.drafter).digits = None
    if cost_model is not None:
        engine.spec.cost_model = cost_model  # one cost model for every engine (see bench spec)
    return engine


async def run_policy(policy: Policy, loaded, cost_model, examples: dict[str, Any], n_programs: int,
                     latency: ToolLatency, max_tokens: int | None, kv_tokens: int,
                     trace_dir: Path | None, arrivals: list[float] | None = None) -> dict[str, Any]:
    from agentrt.engine import AsyncEngine
    from agentrt.runtime import EngineBackend, Runtime, Trace

    engine = new_engine(loaded, policy, kv_tokens, cost_model)
    aengine = AsyncEngine(engine)
    backend = EngineBackend(aengine, model_name=loaded.name)
    tools, tool_log = delayed_tools([t for ex in examples.values() for t in ex.tools], latency)
    trace = Trace(name=f"workload {policy.label}", meta={"model": loaded.name, "policy": policy.scheduling,
                                                         "drafter": policy.drafter, "k": policy.k,
                                                         "prefix_caching": policy.prefix_caching})
    rt = Runtime(backend, tools=tools, policy=policy.scheduling, kv_hold=policy.kv_hold, trace=trace,
                 max_tokens=max_tokens, stream_outputs=policy.stream_outputs, prefill_ahead=policy.prefill_ahead)
    async def start(i: int, name: str, inputs: dict[str, Any]):
        await asyncio.sleep(max(0.0, t0 + (arrivals[i] if arrivals else 0.0) - time.monotonic()))
        _PROGRAM.set(i)  # this task's context, which the run's tasks copy: its tool calls know it
        return await rt.submit(examples[name].program, inputs, run_id=f"{i:02d}-{name}")

    try:
        t0 = time.monotonic()
        # each program's completion time counts from its own submit (ProgramStats)
        results = await asyncio.gather(*(start(i, name, inputs) for i, (name, inputs) in enumerate(workload(n_programs))))
        t_end = time.monotonic()
        stats = [rt.runs[r.run_id].stats for r in results]
    finally:
        await rt.aclose()
        await rt.tools.aclose()
        backend.close()
        aengine.close()
    if trace_dir is not None:
        # one file per policy (agentrt inspect reads it); (c)'s variants share its letter
        trace.write(trace_dir / f"workload-{'-'.join(policy.label.replace('+', ' ').split())}.jsonl")
    steps = [r for r in engine.step_log if r.start >= t0]
    makespan = t_end - t0
    durations = [r.duration_s for r in results]
    drafted = sum(sum(r.k) for r in steps)
    accepted = sum(sum(r.accepted) for r in steps)
    prefix = engine.blocks.prefix
    row = {
        "policy": policy.label,
        "done": sum(r.ok for r in results),
        "makespan_s": makespan,
        "mean_s": statistics.fmean(durations),
        "p90_s": percentile(durations, 0.9),
        "prefill_saved": prefix.stats.hit_tokens + engine.scheduler.shared_prefill_tokens if prefix else 0,
        "prefill_fed": sum(r.num_prefill_tokens for r in steps),
        "busy_frac": sum(r.duration_s for r in steps) / makespan,
        "steps": len(steps),
        "mean_batch": statistics.fmean(r.batch_size for r in steps) if steps else 0.0,
        "alpha": accepted / drafted if drafted else None,
        **k_means([k_by_load(steps, n_programs)]),
        "preempted": sum(len(r.preempted) for r in steps),
        "kv_holds": sum(s.kv_holds for s in stats),
        **dict(zip(("tool_critical_path_s", "llm_critical_path_s"), critical_path_split(trace.records()))),
        "hold_hits": sum(s.kv_hold_hits for s in stats),
        "hold_misses": sum(s.kv_hold_misses for s in stats),
        "post_tool_ttft_ms": 1000 * statistics.fmean(ttft) if (ttft := post_tool_ttft(trace.records())) else None,
        "prefill_ahead_tokens": sum(s.prefill_ahead_tokens for s in stats),
    }
    detail = {
        "load_average": os.getloadavg()[0],
        "k_by_load": k_by_load(steps, n_programs),
        "tool_s": sum(s for _, _, s in tool_log), "tool_calls": len(tool_log),
        "hold_unused": sum(s.kv_hold_unused for s in stats),
        "prefix_stats": prefix.stats.to_dict() if prefix else None,
        "programs": [{"run_id": r.run_id, "status": r.status, "duration_s": round(r.duration_s, 4),
                      "error": r.error, "output": r.output, "llm_calls": s.llm_calls, "tool_calls": s.tool_calls,
                      "tool_s": round(s.tool_s, 4), "llm_service_s": round(s.llm_service_s, 4),
                      "prefill_saved_tokens": s.cached_tokens}
                     for r, s in zip(results, stats)],
    }
    return {"row": row, "detail": detail}


# ---- the benchmark ----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--programs", type=int, help="concurrent programs (default 16, --quick 6)")
    p.add_argument("--max-tokens", type=int, help="cap on every LLM call's max_tokens (default: the examples' own; "
                                                  "--quick 96)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tool latencies (and of --rate's arrivals)")
    p.add_argument("--rate", type=float, help="submit programs as a Poisson process of this many per second "
                                              "(default: all at once); completion times count from each submit")
    p.add_argument("--repeats", type=int, help="interleaved repeats of the three policies, averaged (default 2)")
    p.add_argument("--ablate", action="store_true", help="also run (c) changed in one part each: FCFS priorities, "
                                                          "no KV holds, shortest-prompt-first prefill, no counting "
                                                          "drafts, no streamed dispatch")
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV cache size of every engine, in tokens")
    p.add_argument("--trace-dir", metavar="DIR", help="save each policy's run trace here (agentrt inspect)")


def warm_up(loaded) -> None:
    """First forwards of a process allocate; run a few (plain and constrained) on a throwaway engine."""
    from agentrt.engine import EngineConfig, LLMEngine, SamplingParams

    dtype = str(loaded.model.dtype).removeprefix("torch.")
    engine = LLMEngine(EngineConfig(model=str(loaded.source.path), dtype=dtype, kv_cache_tokens=4096), loaded=loaded)
    chat = [{"role": "user", "content": "Say hello to the world in a short sentence."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}}}
    engine.generate([chat, chat], SamplingParams(max_tokens=8, temperature=0))
    engine.generate([chat], SamplingParams(max_tokens=12, temperature=0, response_format=fmt))


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from agentrt.bench.spec import shared_cost_model
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.runtime.loader import load_example

    console = Console(stderr=True)
    n = getattr(args, "programs", None) or (6 if args.quick else 16)
    max_tokens = getattr(args, "max_tokens", None) or (96 if args.quick else None)
    repeats = getattr(args, "repeats", None) or 2
    kv_tokens = getattr(args, "kv_tokens", None) or 32768
    latency = ToolLatency(seed=getattr(args, "seed", 0) or 0)
    rate = getattr(args, "rate", None)
    arrivals = arrival_times(n, rate, latency.seed)
    trace_dir = Path(args.trace_dir) if getattr(args, "trace_dir", None) else None
    loaded = load_model(args.model, args.dtype, progress=False)
    cost_model = shared_cost_model(loaded)
    examples = {name: load_example(EXAMPLES_DIR / f"{name}.py") for name in EXAMPLE_NAMES}
    console.print(f"[bold]bench workload[/]: {args.model} {args.dtype}, {n} programs ({', '.join(EXAMPLE_NAMES)} in "
                  f"turn, {'all at once' if rate is None else f'{rate:g} per second (Poisson)'}), tool latency log-normal "
                  f"median {latency.median_s} s p90 {latency.p90_s} s (cap "
                  f"{latency.cap_s} s, seed {latency.seed}), max_tokens cap {max_tokens}, {repeats} repeats; "
                  f"cost model: {cost_model.source}")
    warm_up(loaded)
    policies = POLICIES + [AHEAD_OFF] + (ABLATIONS if getattr(args, "ablate", False) else [])
    runs: dict[str, list[dict[str, Any]]] = {p.label: [] for p in policies}
    for r in range(repeats):
        # interleaved and rotated, so the machine's drifting load falls on every policy alike
        for policy in policies[r % len(policies):] + policies[: r % len(policies)]:
            t = time.monotonic()
            runs[policy.label].append(asyncio.run(run_policy(
                policy, loaded, cost_model, examples, n, latency, max_tokens, kv_tokens,
                None if trace_dir is None else trace_dir / f"r{r}", arrivals)))
            row = runs[policy.label][-1]["row"]
            console.print(f"  repeat {r + 1}/{repeats} {policy.label}: {time.monotonic() - t:.1f} s, mean completion "
                          f"{row['mean_s']:.2f} s, load {runs[policy.label][-1]['detail']['load_average']:.1f}")
    rows = [average([x["row"] for x in runs[p.label]], [x["detail"] for x in runs[p.label]]) for p in policies]
    summary = summarize(rows[:3])
    for row in rows[3:]:  # --ablate: how much longer c's mean completion is without each part
        key = "c_mean_s_ratio_" + row["policy"].removeprefix("c ").replace(" ", "_").replace("-", "_")
        summary[key] = row["mean_s"] / rows[2]["mean_s"]
    if rows[2]["post_tool_ttft_ms"] and rows[3]["post_tool_ttft_ms"]:
        summary["post_tool_ttft_speedup"] = rows[3]["post_tool_ttft_ms"] / rows[2]["post_tool_ttft_ms"]
    interval = speedup_interval([x["row"]["mean_s"] for x in runs[POLICIES[0].label]],
                                [x["row"]["mean_s"] for x in runs[POLICIES[2].label]])
    if interval is not None:  # how far the machine's drift leaves the headline figure uncertain
        summary["mean_latency_speedup_ci95_low"], summary["mean_latency_speedup_ci95_high"] = interval
    details = {p.label: [x["detail"] for x in runs[p.label]] for p in policies}
    summary["mean_speedup_done_everywhere"] = speedup_done_everywhere(details[POLICIES[0].label],
                                                                      details[POLICIES[2].label])
    k = details[POLICIES[2].label][0]["k_by_load"]
    all_details = [d for ds in details.values() for d in ds]
    notes = [
        f"Averages over {repeats} interleaved repeat(s); load average at the end of each run: "
        + ", ".join(f"{d['load_average']:.1f}" for d in all_details) + " (2 cores, shared).",
        f"k_idle: decoding rows of steps with batch <= {k['idle_batch_max']}; k_busy: batch >= {k['busy_batch_min']} "
        f"(c: {sum(d['k_by_load']['idle_rows'] for d in details[POLICIES[2].label])} and "
        f"{sum(d['k_by_load']['busy_rows'] for d in details[POLICIES[2].label])} rows). Tool time per run: "
        + ", ".join(f"{d['tool_s']:.1f} s / {d['tool_calls']} calls" for d in all_details),
        f"same program outputs in every run: {same_outputs(all_details)}/{n} (greedy; bf16 forwards of different "
        "batch shapes differ in rounding, so a program may take another path, e.g. another SQL query)",
        "mean completion a / c per repeat: " + ", ".join(
            f"{x['row']['mean_s']:.2f} / {y['row']['mean_s']:.2f} = {x['row']['mean_s'] / y['row']['mean_s']:.2f}"
            for x, y in zip(runs[POLICIES[0].label], runs[POLICIES[2].label])),
        "Goals: mean_latency_speedup_vs_fcfs >= 1.5, k_idle_mean > k_busy_mean, post_tool_ttft_speedup >= 2 "
        "(c's time from a tool's end to the next call's first token, prefill-ahead off over on; "
        "c_mean_s_ratio_without_prefill_ahead: mean completion off over on).",
    ]
    config = {"model": args.model, "dtype": args.dtype, "programs": n, "arrival_rate": rate, "arrivals_s": arrivals,
              "max_tokens_cap": max_tokens, "repeats": repeats,
              "kv_cache_tokens": kv_tokens, "latency": dataclasses.asdict(latency), "sigma": latency.sigma,
              "policies": [dataclasses.asdict(p) for p in policies], "threads": torch.get_num_threads(),
              "cost_model": cost_model.source, "details": details}
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)
