"""`agentrt bench serve`: the server's cost over the engine, and program throughput under arrivals.

Part 1, OpenAI-compatible load. C concurrent streaming clients (C in 1, 4, 16), each sending R
chat requests one after another (greedy, max_tokens M, prompts from the bench prompt set): first
straight to an in-process engine (AsyncEngine.stream, the same engine config), then through
`agentrt serve` in its own process with the official openai client (AsyncOpenAI, stream=True,
include_usage). Per side and C: time to first token p50/p99, inter-token latency p50/p99 (gaps
between streamed pieces divided by the tokens they carry), output tokens/s over the wall time.

Part 2, programs through HTTP. The three example programs (bench workload's load: seeded
heavy-tailed tool latencies) submitted to an in-process server as a seeded Poisson process at
increasing rates, for two policies (bench workload's a: call-level FCFS without prefix cache or
speculation, and c: the full runtime). Per policy: the mean and p95 completion time unloaded
(the same programs, each alone: submitted when the one before ended, each drawing the tool
latencies it draws under load, so unloaded and loaded times differ by the load only), then per rate the mean and p95 completion time (submit to end, over the
HTTP API), over the whole rate grid. One latency bound holds both policies: 2x FCFS's unloaded
mean (a bound per policy would hold the faster policy to a tighter bound). A policy's sustained
rate is the highest rate of the grid whose mean completion is within that bound.

Part 3, durability (serve_durability.py): program completion with the SQLite run store on vs
off under the same arrivals, and the time a restarted server takes to resume 100 stored runs.

Summary: server_overhead (engine-direct tokens/s over served tokens/s at C=16; goal <= 1.10),
ttft_p50_ms (served, C=1), sustained_rate_vs_fcfs (c's sustained rate over a's; goal >= 2.0),
p95_at_fcfs_rate_vs_unloaded (c's p95 completion at a's sustained rate over c's unloaded p95;
goal <= 1.3),
durable_vs_memory (mean completion with the store over without; goal <= 1.05), resume_s.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.bench.program_load import program_load
from agentrt.bench.prompts import mixed_prompts
from agentrt.server.process import wait_ready
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default=None, help="comma-separated client counts (default 1,4,16)")
    p.add_argument("--requests", type=int, default=None, help="requests per client (default 4, --quick 2)")
    p.add_argument("--out-tokens", type=int, default=None, help="max_tokens per chat request (default 64, --quick 32)")
    p.add_argument("--rates", default=None, help="program arrival rates per second, comma-separated "
                                                 "(default 0.1,0.15,0.2,0.3,0.4,0.6,0.8,1.2; --quick 0.2,0.8)")
    p.add_argument("--programs", type=int, default=None, help="programs per rate (default 12, --quick 6)")
    p.add_argument("--part", choices=["chat", "programs", "both", "durability", "all"], default="both",
                   help="both: chat and programs; all: and durability")
    p.add_argument("--durability-rate", type=float, default=0.2, help="arrivals per second of the durability part")
    p.add_argument("--resume-runs", type=int, default=100, help="stored runs the durability part resumes")
    p.add_argument("--seed", type=int, default=0)
    from agentrt.bench.serve_soak import add_arguments as add_soak_arguments

    add_soak_arguments(p)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


class Tally:
    """What the clients of one (side, C) saw."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0

    def piece(self, t_prev: float, t_now: float, tokens: int) -> None:
        tokens = max(1, tokens)
        self.itl += [(t_now - t_prev) / tokens] * tokens

    def row(self, side: str, c: int, wall: float) -> dict[str, Any]:
        ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
        return {"side": side, "clients": c, "ttft_p50_ms": ms(pct(self.ttft, 0.5)), "ttft_p99_ms": ms(pct(self.ttft, 0.99)),
                "itl_p50_ms": ms(pct(self.itl, 0.5)), "itl_p99_ms": ms(pct(self.itl, 0.99)),
                "out_tokens": self.tokens, "tokens_per_s": round(self.tokens / wall, 2)}


# ---- part 1: chat ------------------------------------------------------------------------------
async def direct_load(engine: Any, prompts: list[list[dict]], c: int, r: int, out_tokens: int) -> dict[str, Any]:
    from agentrt.engine import SamplingParams

    tally = Tally()
    params = SamplingParams(max_tokens=out_tokens, temperature=0)

    async def client(i: int) -> None:
        for j in range(r):
            t0 = last = time.perf_counter()
            first = True
            async for ev in engine.stream(prompts[(i * r + j) % len(prompts)], params):
                now = time.perf_counter()
                n = len(ev.token_ids)
                if ev.text and first:
                    tally.ttft.append(now - t0)
                    first = False
                elif n and not first:
                    tally.piece(last, now, n)
                last = now if n else last
                tally.tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(c)))
    return tally.row("engine", c, time.perf_counter() - t0)


async def served_load(url: str, model: str, prompts: list[list[dict]], c: int, r: int, out_tokens: int) -> dict[str, Any]:
    import openai

    tally = Tally()
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)

    async def client(i: int) -> None:
        for j in range(r):
            t0 = last = time.perf_counter()
            first, pieces = True, []
            stream = await aclient.chat.completions.create(
                model=model, messages=prompts[(i * r + j) % len(prompts)], max_tokens=out_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                now = time.perf_counter()
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    if first:
                        tally.ttft.append(now - t0)
                        first = False
                    else:
                        pieces.append((last, now, text))
                    last = now
                if chunk.usage is not None:
                    tally.tokens += chunk.usage.completion_tokens
                    # spread the tokens over the pieces in proportion to their characters
                    chars = sum(len(t) for _, _, t in pieces) or 1
                    for a, b, t in pieces:
                        tally.piece(a, b, round(chunk.usage.completion_tokens * len(t) / chars))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(c)))
    wall = time.perf_counter() - t0
    await aclient.close()
    return tally.row("served", c, wall)


def chat_part(args: argparse.Namespace, console: Console, levels: list[int], r: int, out_tokens: int) -> list[dict]:
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig

    prompts = mixed_prompts(64)
    rows = []
    console.print(f"[bold]chat[/bold]: engine-direct, C = {levels}, {r} requests each, max_tokens {out_tokens}")
    engine = AsyncEngine(LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, spec=SpecConfig(drafter="template"))))
    try:
        asyncio.run(direct_load(engine, prompts, 1, 1, 4))  # warm-up: first-touch and grammar set-up
        for c in levels:
            rows.append(asyncio.run(direct_load(engine, prompts, c, r, out_tokens)))
            console.print(f"  {rows[-1]}")
    finally:
        engine.close()
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"agentrt-bench-serve-{port}.log"
    console.print(f"[bold]chat[/bold]: served (agentrt serve on port {port}, log {log})")
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--model", args.model,
                                 "--dtype", args.dtype, "--spec", "template", "--no-access-log",
                                 "--runs-dir", str(log.with_suffix(".runs"))], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, log)
            asyncio.run(served_load(url, args.model, prompts, 1, 1, 4))  # the same warm-up
            for c in levels:
                rows.append(asyncio.run(served_load(url, args.model, prompts, c, r, out_tokens)))
                console.print(f"  {rows[-1]}")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


# ---- part 2: programs ----------------------------------------------------------------------------
def programs_part(args: argparse.Namespace, console: Console, rates: list[float], n: int) -> list[dict]:
    """One row per (policy, rate): mean and p95 completion; rate 0 is the same programs, each alone."""
    from agentrt.bench.spec import shared_cost_model
    from agentrt.bench.workload import POLICIES
    from agentrt.bench.workload_load import EXAMPLE_NAMES, EXAMPLES_DIR, ToolLatency, arrival_times, workload
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.runtime.loader import load_example

    loaded = load_model(args.model, args.dtype, progress=False)
    cost_model = shared_cost_model(loaded)
    examples = {name: load_example(EXAMPLES_DIR / f"{name}.py") for name in EXAMPLE_NAMES}
    latency = ToolLatency(seed=args.seed)
    max_tokens = 96 if args.quick else None
    rows = []

    def add(policy: Any, rate: float, times: list[float]) -> None:
        rows.append({"policy": policy.label, "rate_per_s": rate, "programs": len(times),
                     "mean_s": round(statistics.fmean(times), 3), "p95_s": round(pct(times, 0.95), 3)})
        console.print(f"  {rows[-1]}")

    for policy in [POLICIES[0], POLICIES[2]]:
        # unloaded: the same n programs, each alone, with the same tool latencies as under load
        add(policy, 0.0, asyncio.run(program_load(policy, loaded, cost_model, examples, None, workload(n), latency,
                                                  max_tokens)))
        # the whole grid, past the first rate a policy misses: where each stands at every rate is the figure
        for rate in rates:
            add(policy, rate, asyncio.run(program_load(policy, loaded, cost_model, examples,
                                                       arrival_times(n, rate, args.seed), workload(n), latency,
                                                       max_tokens)))
    return rows


def sustained_rates(rows: list[dict], fcfs: str, runtime: str) -> tuple[list[dict], dict[str, Any]]:
    """The rows marked against one latency bound (2x FCFS's unloaded mean), and the summary keys.

    A policy's sustained rate is the highest rate whose mean completion is within the bound (0.0 when
    none is); the runtime's p95 at FCFS's sustained rate is compared with its own unloaded p95."""
    def row(policy: str, rate: float) -> dict | None:
        return next((r for r in rows if r["policy"] == policy and r["rate_per_s"] == rate), None)

    bound = 2 * row(fcfs, 0.0)["mean_s"]
    marked = [{**r, "within_bound": r["mean_s"] <= bound} for r in rows]
    sustained = {p: max((r["rate_per_s"] for r in marked if r["policy"] == p and r["rate_per_s"] > 0 and
                         r["within_bound"]), default=0.0) for p in (fcfs, runtime)}
    a, c = sustained[fcfs], sustained[runtime]
    at_a = row(runtime, a) if a > 0 else None
    summary = {"latency_bound_s": round(bound, 3), "sustained_rate_a": a, "sustained_rate_c": c,
               "sustained_rate_vs_fcfs": round(c / a, 3) if a > 0 else None,
               "p95_at_fcfs_rate_vs_unloaded": round(at_a["p95_s"] / row(runtime, 0.0)["p95_s"], 3) if at_a else None}
    return marked, summary


def run(args: argparse.Namespace) -> BenchResult:
    console = Console()
    if args.soak is not None:
        from agentrt.bench.serve_soak import run_soak

        return run_soak(args, console)
    levels = [int(x) for x in (args.concurrency or ("1,4" if args.quick else "1,4,16")).split(",")]
    r = args.requests or (2 if args.quick else 4)
    out_tokens = args.out_tokens or (32 if args.quick else 64)
    rates = [float(x) for x in (args.rates or ("0.2,0.8" if args.quick else "0.1,0.15,0.2,0.3,0.4,0.6,0.8,1.2")).split(",")]
    n = args.programs or (6 if args.quick else 12)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    if args.part in ("chat", "both", "all"):
        chat_rows = chat_part(args, console, levels, r, out_tokens)
        rows += chat_rows
        top = max(levels)
        direct = next(x for x in chat_rows if x["side"] == "engine" and x["clients"] == top)
        served = next(x for x in chat_rows if x["side"] == "served" and x["clients"] == top)
        summary["server_overhead"] = round(direct["tokens_per_s"] / served["tokens_per_s"], 3)
        summary["overhead_at_clients"] = top
        summary["ttft_p50_ms"] = next(x for x in chat_rows if x["side"] == "served" and x["clients"] == min(levels))["ttft_p50_ms"]
    if args.part in ("programs", "both", "all"):
        program_rows, program_summary = sustained_rates(programs_part(args, console, rates, n), "a fcfs",
                                                        "c full runtime")
        rows += program_rows
        summary.update(program_summary)
    if args.part in ("durability", "all"):
        from agentrt.bench.serve_durability import durability_part

        durable_rows, durable = durability_part(args, console, args.durability_rate, n, 1 if args.quick else 2,
                                                args.resume_runs)
        rows += durable_rows
        summary.update(durable)
    notes = [f"load average at the end: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 before the run means "
             f"something else was running)"]
    config = {"concurrency": levels, "requests_per_client": r, "out_tokens": out_tokens, "rates": rates, "programs": n,
              "seed": args.seed}
    return BenchResult(rows, summary, notes, config)
