"""`agentrt bench scale`: what scaling out costs and keeps, as ratios measured in one run with real
processes (a mosquitto broker, `agentrt engine-worker`s, a throwaway PostgreSQL cluster, `agentrt
serve` replicas), each pair under the same seeded arrivals:

- remote_engine_overhead: mean completion of the example programs (bench workload's load, seeded
  tool latencies) served by an in-process server on one engine worker over MQTT, over the same
  on the same engine in process (goal <= 1.10);
- affinity_prefill_saved: prompt tokens the engines served from their prefix caches (the
  engine's cached-token count of every LLM call, from the traces) for conversations of three
  calls (`continues=`) over one long shared system prompt, on 2 engine workers routed by KV
  affinity, over the same routed round-robin; beside it the single-engine reuse (the same load on
  one worker): affinity should keep >= 90% of it;
- failover_s: from SIGKILL of a replica (`serve --db postgresql://... --lease-s`) whose runs wait
  in a tool to every one of them owned by the other replica, which resumes it at once (goal <=
  lease + 2 s);
- postgres_vs_sqlite: mean completion of the example programs with the run store on PostgreSQL
  over the same on SQLite (goal <= 1.05).

On a small machine every process shares the same cores: two engine workers are not faster than
one, so the bench reports ratios, not throughput gains.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from agentrt.bench.common import BenchResult

SYSTEM = ("You are a field guide writer. You answer in short plain sentences, you name sources when you know "
          "them, you never invent numbers, and you keep to the topic the reader asked about. ") * 2
TOPICS = ("rivers", "hills", "roads", "woods", "lakes", "birds", "bridges", "caves", "islands", "deserts",
          "glaciers", "harbours")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--programs", type=int, default=None, help="programs per measured run (default 6, --quick 4)")
    p.add_argument("--rate", type=float, default=0.5, help="programs submitted per second (seeded Poisson)")
    p.add_argument("--lease-s", type=float, default=1.5, help="the replicas' lease in the failover part")
    p.add_argument("--seed", type=int, default=0)


def conversation_program(max_tokens: int, latency_seed: int, cold: str = "") -> tuple[Any, Any]:
    """Three calls of one conversation (each `continues=` the last), a tool between the first two
    (seeded 0.2-1 s, so that conversations interleave on the engines); (program, tool). `cold`
    starts the system prompt, so that a measurement finds none of an earlier one's KV cached (the
    engines' prefix caches outlive it)."""
    from agentrt.dag import Program
    from agentrt.tools import tool

    @tool(idempotent=True)
    async def look_up(topic: str) -> str:
        "Facts about a topic."
        await asyncio.sleep(random.Random(f"{latency_seed}:{topic}").uniform(0.2, 1.0))
        return f"{topic}: three facts from the field notes."

    p = Program("conversation", inputs={"topic": str}, tools=[look_up])
    first = p.llm("first", system=f"{cold}{SYSTEM}", prompt="Write two sentences about {topic}.", max_tokens=max_tokens)
    facts = p.tool("facts", "look_up", args={"topic": p.input("topic")})
    second = p.llm("second", continues=first, prompt="Add this: {facts}", max_tokens=max_tokens)
    p.output(p.llm("third", continues=second, prompt="Sum it up in one line.", max_tokens=max_tokens))
    return p, look_up


async def conversation_load(backend: Any, n: int, arrivals: list[float], max_tokens: int, seed: int,
                            cold: str = "") -> dict[str, Any]:
    """n conversations at these arrival times on backend: mean completion, and the prompt tokens
    of every LLM call and those the engine served from its prefix cache (from the trace)."""
    from agentrt.runtime import Runtime

    program, look_up = conversation_program(max_tokens, seed, cold)
    runtime = Runtime(backend, tools=[look_up])
    t0 = time.monotonic()

    async def one(i: int) -> float:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        start = time.monotonic()
        result = await runtime.run(program, {"topic": TOPICS[i % len(TOPICS)]})
        if not result.ok:
            raise RuntimeError(f"conversation {i} failed: {result.error}")
        return time.monotonic() - start

    try:
        times = await asyncio.gather(*(one(i) for i in range(n)))
        spans = [s["attributes"] for s in runtime.trace.records()
                 if s["type"] == "span" and "gen_ai.usage.input_tokens" in s["attributes"]]
    finally:
        await runtime.aclose()
    return {"mean_s": statistics.fmean(times), "llm_calls": len(spans),
            "prompt_tokens": sum(int(a["gen_ai.usage.input_tokens"]) for a in spans),
            "cached_tokens": sum(int(a.get("gen_ai.usage.cache_read.input_tokens") or 0) for a in spans)}


def run(args: argparse.Namespace) -> BenchResult:
    from agentrt.bench.pg_cluster import PostgresCluster, bin_dir
    from agentrt.bench.scale_procs import EngineWorkers, failover_time, remote_backend
    from agentrt.bench.program_load import program_load
    from agentrt.bench.spec import shared_cost_model
    from agentrt.bench.workload import POLICIES
    from agentrt.bench.workload_load import EXAMPLE_NAMES, EXAMPLES_DIR, ToolLatency, arrival_times, workload
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.runtime.loader import load_example
    from agentrt.runtime.store import SQLiteRunStore
    from agentrt.runtime.store_postgres import PostgresRunStore
    from agentrt.tools.mosquitto import MosquittoBroker

    console = Console()
    where = bin_dir()
    if where is None:
        raise SystemExit("bench scale needs PostgreSQL's server binaries (initdb): scripts/system-packages.sh")
    n = args.programs or (4 if args.quick else 6)
    max_tokens = 48 if args.quick else 96
    repeats = 1 if args.quick else 2
    arrivals = arrival_times(n, args.rate, args.seed)
    policy = POLICIES[2]  # the full runtime
    console.print(f"[bold]bench scale[/]: {n} programs per run at {args.rate}/s, max_tokens {max_tokens}, "
                  f"{repeats} repeat(s); loading {args.model}")
    loaded = load_model(args.model, args.dtype, progress=False)
    cost_model = shared_cost_model(loaded)
    examples = {name: load_example(EXAMPLES_DIR / f"{name}.py") for name in EXAMPLE_NAMES}
    latency = ToolLatency(seed=args.seed)
    rows: list[dict[str, Any]] = []

    def row(**r: Any) -> None:
        rows.append(r)
        console.print(f"  {r}")

    def examples_load(backend: Any = None, store: Any = None) -> float:
        return statistics.fmean(asyncio.run(program_load(policy, loaded, cost_model, examples, arrivals, workload(n),
                                                         latency, max_tokens, store=store, backend=backend)))

    with tempfile.TemporaryDirectory(prefix="agentrt-bench-scale-") as tmp_name, MosquittoBroker() as broker:
        tmp = Path(tmp_name)
        cluster = PostgresCluster(where)
        workers = EngineWorkers(broker.url, args.model, tmp, [  # the engine as loaded here, policy (c)'s drafter
            "--dtype", args.dtype, "--spec", "template", "--kv-cache-tokens", "32768", "--status-interval", "0.5",
            "--log-level", "WARNING"])
        try:
            console.print("starting engine worker w1 (loads the model, warms up)")
            workers.start("w1")

            async def on_remote(routing: str, count: int, body: Any) -> Any:
                backend = await remote_backend(broker, count, routing)
                try:
                    return await body(backend)
                finally:
                    await backend.aclose()

            # 1. one engine worker over MQTT vs the same engine in process
            console.print("[bold]1/4[/] the example programs: in-process engine vs one engine worker over MQTT")
            means: dict[str, list[float]] = {"in-process": [], "remote": []}
            for rep in range(repeats):
                for side in (("in-process", "remote") if rep % 2 == 0 else ("remote", "in-process")):
                    if side == "remote":
                        async def remote_side(backend: Any) -> list[float]:
                            return await program_load(policy, loaded, cost_model, examples, arrivals, workload(n),
                                                      latency, max_tokens, backend=backend)
                        mean = statistics.fmean(asyncio.run(on_remote("affinity", 1, remote_side)))
                    else:
                        mean = examples_load()
                    means[side].append(mean)
                    row(part="remote engine", side=side, repeat=rep + 1, programs=n, mean_s=round(mean, 3))

            # 2. prefix reuse: one engine, then two by affinity and round-robin
            console.print("[bold]2/4[/] conversations: prefix reuse on one worker, then two by affinity / round-robin")
            reuse: dict[str, dict[str, Any]] = {}

            def conversations(label: str, routing: str, count: int) -> None:
                cold = f"Notebook {len(reuse) + 1}. "  # as many tokens in every measurement
                figures = asyncio.run(on_remote(routing, count, lambda b: conversation_load(
                    b, n, arrivals, max_tokens, args.seed, cold=cold)))
                reuse[label] = figures
                row(part="prefix reuse", side=label, repeat=1, programs=n, mean_s=round(figures["mean_s"], 3),
                    llm_calls=figures["llm_calls"], prompt_tokens=figures["prompt_tokens"],
                    cached_tokens=figures["cached_tokens"])

            conversations("1 worker", "affinity", 1)
            console.print("starting engine worker w2")
            workers.start("w2")
            conversations("2 workers affinity", "affinity", 2)
            conversations("2 workers round-robin", "round-robin", 2)

            # 3. failover between two replicas on PostgreSQL
            console.print(f"[bold]3/4[/] failover: two replicas on PostgreSQL (lease {args.lease_s:g} s), one killed")
            failover = failover_time(tmp, cluster.new_database(), broker.url, args.model, args.lease_s, 4)
            row(part="failover", side=f"lease {args.lease_s:g} s", repeat=1, programs=4,
                failover_s=round(failover["failover_s"], 3), statuses=",".join(sorted(set(failover["statuses"]))))
        finally:
            workers.stop()

        # 4. the run store on PostgreSQL vs SQLite, in-process engine
        try:
            console.print("[bold]4/4[/] the example programs: run store on SQLite vs PostgreSQL")
            stores: dict[str, list[float]] = {"sqlite": [], "postgres": []}
            for rep in range(repeats):
                for side in (("sqlite", "postgres") if rep % 2 == 0 else ("postgres", "sqlite")):
                    store = (SQLiteRunStore(tmp / f"runs-{rep}.db") if side == "sqlite"
                             else PostgresRunStore(cluster.new_database()))
                    try:
                        mean = examples_load(store=store)
                    finally:
                        store.close()
                    stores[side].append(mean)
                    row(part="run store", side=side, repeat=rep + 1, programs=n, mean_s=round(mean, 3))
        finally:
            cluster.close()

    saved_affinity = reuse["2 workers affinity"]["cached_tokens"]
    saved_rr = reuse["2 workers round-robin"]["cached_tokens"]
    single = reuse["1 worker"]["cached_tokens"]
    summary = {
        "remote_engine_overhead": round(statistics.fmean(means["remote"]) / statistics.fmean(means["in-process"]), 3),
        "affinity_prefill_saved": round(saved_affinity / saved_rr, 3) if saved_rr else None,
        "affinity_cached_tokens": saved_affinity, "round_robin_cached_tokens": saved_rr,
        "single_engine_cached_tokens": single,
        "affinity_keeps_of_single": round(saved_affinity / single, 3) if single else None,
        "failover_s": round(failover["failover_s"], 3), "lease_s": args.lease_s,
        "failover_runs_done": sum(s == "done" for s in failover["statuses"]),
        "postgres_vs_sqlite": round(statistics.fmean(stores["postgres"]) / statistics.fmean(stores["sqlite"]), 3),
    }
    notes = [f"load average at the end: {os.getloadavg()[0]:.2f}. Every process (engine workers, replicas, "
             "PostgreSQL, mosquitto, the bench) shares this machine's cores: two engine workers are not faster "
             "than one here, so the figures are ratios, not throughput gains.",
             "goals: remote_engine_overhead <= 1.10; affinity_keeps_of_single >= 0.90; "
             f"failover_s <= lease + 2 s ({args.lease_s + 2:g}); postgres_vs_sqlite <= 1.05"]
    config = {"programs": n, "rate_per_s": args.rate, "max_tokens": max_tokens, "repeats": repeats,
              "lease_s": args.lease_s, "seed": args.seed, "model": args.model, "policy": policy.label}
    return BenchResult(rows, summary, notes, config,
                       line_keys=("remote_engine_overhead", "affinity_prefill_saved", "affinity_keeps_of_single",
                                  "failover_s", "postgres_vs_sqlite"))
