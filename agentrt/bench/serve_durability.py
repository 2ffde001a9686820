"""`agentrt bench serve --part durability`: what the SQLite run store costs, and how fast a
restarted server resumes stored runs.

Cost: the three example programs (bench workload's load, seeded tool latencies) submitted over
HTTP to an in-process server (the full runtime) under the same seeded Poisson arrivals, with the
run store on (a SQLite file: every event, node start and outcome committed) and off, the two
alternating; mean completion time of each, and their ratio (goal <= 1.05).

Resume: N runs of a small program (an LLM call, a tool, a tool that waits on a gate, an LLM
answer; the LLM scripted, so this measures the store and the runtime, not the engine) are
submitted and stopped by a shutdown while every one waits in the gated tool; a fresh runtime
and run manager on the same store then recover them. Timed: from recover() to every run back
in its gated tool (its finished nodes replayed from the store, the interrupted tool, declared
idempotent, started again).
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console


def durability_part(args: Any, console: Console, rate: float, n: int, repeats: int,
                    resume_runs: int) -> tuple[list[dict], dict]:
    from agentrt.bench.program_load import program_load
    from agentrt.bench.spec import shared_cost_model
    from agentrt.bench.workload import POLICIES
    from agentrt.bench.workload_load import EXAMPLE_NAMES, EXAMPLES_DIR, ToolLatency, arrival_times, workload
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.runtime.loader import load_example
    from agentrt.runtime.store import NullRunStore, SQLiteRunStore

    loaded = load_model(args.model, args.dtype, progress=False)
    cost_model = shared_cost_model(loaded)
    examples = {name: load_example(EXAMPLES_DIR / f"{name}.py") for name in EXAMPLE_NAMES}
    latency = ToolLatency(seed=args.seed)
    max_tokens = 96 if args.quick else None
    policy = POLICIES[2]
    means: dict[str, list[float]] = {"memory": [], "sqlite": []}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for side in (("memory", "sqlite") if rep % 2 == 0 else ("sqlite", "memory")):
                store = SQLiteRunStore(Path(tmp) / f"runs-{rep}.db") if side == "sqlite" else NullRunStore()
                times = asyncio.run(program_load(policy, loaded, cost_model, examples, arrival_times(n, rate, args.seed),
                                                 workload(n), latency, max_tokens, store=store))
                store.close()
                means[side].append(statistics.fmean(times))
                rows.append({"part": "durability", "store": side, "repeat": rep + 1, "rate_per_s": rate, "programs": n,
                             "mean_s": round(means[side][-1], 3)})
                console.print(f"  {rows[-1]}")
        resume_s = asyncio.run(resume_time(resume_runs, Path(tmp)))
    rows.append({"part": "resume", "runs": resume_runs, "resume_s": round(resume_s, 3)})
    console.print(f"  {rows[-1]}")
    memory, sqlite = statistics.fmean(means["memory"]), statistics.fmean(means["sqlite"])
    return rows, {"durable_vs_memory": round(sqlite / memory, 3), "resume_runs": resume_runs,
                  "resume_s": round(resume_s, 3)}


async def resume_time(num_runs: int, tmp: Path) -> float:
    """Seconds from RunManager.recover() to every one of num_runs interrupted runs back in the
    tool it was interrupted in."""
    from agentrt.dag import JsonSchema, Program
    from agentrt.runtime import Runtime, ScriptedBackend
    from agentrt.runtime.loader import Example
    from agentrt.runtime.store import SQLiteRunStore
    from agentrt.server.config import Limits
    from agentrt.server.runs import RunManager
    from agentrt.tools import tool

    entered = 0
    gate = asyncio.Event()

    @tool
    def record(a: int, b: int) -> dict:
        "Record two numbers."
        return {"a": a, "b": b}

    @tool(idempotent=True)
    async def gated_add(a: int, b: int) -> int:
        "Add once the gate opens."
        nonlocal entered
        entered += 1
        await gate.wait()
        return a + b

    p = Program("gated", inputs={"question": str}, tools=[record, gated_add])
    plan = p.llm("plan", prompt="Pick the numbers in {question}", output=JsonSchema(
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}))
    rec = p.tool("record", "record", args={"a": plan["a"], "b": plan["b"]})
    p.tool("sum", "gated_add", args={"a": rec["a"], "b": rec["b"]})
    p.output(p.llm("answer", prompt="Say that the sum is {sum}"))
    example = Example(Path(__file__), p.compile(), (record, gated_add), {"question": "2 + 3?"})
    limits = Limits(max_running_runs=num_runs, max_queued_runs=num_runs)
    replies = {"plan": {"a": 2, "b": 3}, "answer": "The sum is 5."}

    async def until(cond: Any) -> None:
        while not cond():
            await asyncio.sleep(0.002)

    store = SQLiteRunStore(tmp / "resume.db")
    backend = ScriptedBackend(replies, step_s=0.0005)
    runtime = Runtime(backend, tools=[record, gated_add], store=store)
    first = RunManager(runtime, {"gated": example}, limits, tmp / "resume-runs")
    for _ in range(num_runs):
        first.submit("gated", {})
    await until(lambda: entered == num_runs)
    await first.shutdown(0.0)  # every run stops in the gated tool, unfinished in the store
    await runtime.aclose()
    await backend.aclose()

    backend = ScriptedBackend(replies, step_s=0.0005)
    runtime = Runtime(backend, tools=[record, gated_add], store=store)
    second = RunManager(runtime, {"gated": example}, limits, tmp / "resume-runs")
    t0 = time.perf_counter()
    resumed = second.recover()
    await until(lambda: entered == 2 * num_runs)
    elapsed = time.perf_counter() - t0
    if len(resumed) != num_runs:
        raise RuntimeError(f"resumed {len(resumed)} of {num_runs} runs")
    gate.set()
    await until(lambda: all(r.ended for r in second.runs.values()))
    bad = [r.status for r in second.runs.values() if r.status != "done"]
    if bad:
        raise RuntimeError(f"resumed runs ended {bad[:3]}")
    await second.shutdown(1.0)
    await runtime.aclose()
    await backend.aclose()
    store.close()
    return elapsed
