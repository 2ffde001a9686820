"""`agentrt run examples/X.py [--input key=value ...] [--trace PATH]`: run an agent program on the
embedded engine with a live progress display, then print its output, the α table, the stall
totals and a timeline; the trace is saved as JSON lines (`agentrt inspect` re-renders it)."""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console

from agentrt.runtime.loader import Example, load_example, resolve_inputs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", help="a Python file defining `program` (and `tools`, `DEFAULT_INPUTS`)")
    p.add_argument("--input", "-i", action="append", default=[], metavar="KEY=VALUE",
                   help="a program input (repeatable); typed by the program's declared inputs")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="where to save the trace (default: runs/<timestamp>-<program>.jsonl)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or a local HF directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bf16 where the hardware multiplies bf16 natively, else fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--spec", default="template",
                   help="drafter: none | suffix | template (suffix + grammar-forced drafts) | layerskip:N | draft:PATH")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on every LLM call's max_tokens")
    p.add_argument("--policy", default="las", choices=["las", "fcfs"],
                   help="engine priorities: least attained service per program (las) or first come first served")
    p.add_argument("--no-live", action="store_true", help="no live progress display")


def default_trace_path(program: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{program}.jsonl"


async def run_example(example: Example, inputs: Mapping[str, Any], backend: Any, *, trace_path: str | Path | None = None,
                      console: Console | None = None, max_tokens: int | None = None, live: bool = True,
                      meta: Mapping[str, Any] | None = None, policy: str = "las") -> tuple[Any, Path]:
    """Run one example program on `backend`, print the report, save the trace. Returns
    (RunResult, trace path)."""
    from agentrt.runtime.live import LiveProgress
    from agentrt.runtime.runtime import Runtime
    from agentrt.runtime.summary import summarize
    from agentrt.runtime.terminal import render_report
    from agentrt.runtime.trace import Trace

    console = console or Console()
    trace = Trace(name=example.name, meta={"model": backend.model_name, "example": str(example.path),
                                           "max_tokens_cap": max_tokens, **(meta or {})})
    runtime = Runtime(backend, tools=example.tools, trace=trace, max_tokens=max_tokens, policy=policy)
    try:
        if live:
            async with LiveProgress(runtime, console):
                result = await runtime.run(example.program, inputs)
        else:
            result = await runtime.run(example.program, inputs)
    finally:
        await runtime.aclose()
        await runtime.tools.aclose()
    path = trace.write(trace_path or default_trace_path(example.name))
    records = trace.records()
    render_report(console, summarize(records), records)
    console.print(f"trace: {path}   (agentrt inspect {path} --html timeline.html)")
    return result, path


def run(args: argparse.Namespace) -> int:
    example = load_example(args.program)
    inputs = resolve_inputs(example, args.input)
    console = Console()
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig
    from agentrt.runtime.engine_backend import EngineBackend

    with console.status(f"loading {args.model} ..."):
        t0 = time.perf_counter()
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, spec=SpecConfig(drafter=args.spec))
        engine = AsyncEngine(LLMEngine(config))
        load_s = time.perf_counter() - t0
        # the first call of a fresh engine pays one-off costs: not inside the program's first LLM node
        warmup_s = asyncio.run(engine.warm_up())
    backend = EngineBackend(engine, model_name=args.model)
    dtype = str(engine.engine.model.dtype).removeprefix("torch.")
    meta = {"engine_load_s": round(load_s, 3), "engine_warmup_s": round(warmup_s, 3), "dtype": dtype, "device": args.device, "drafter": args.spec, "policy": args.policy}
    try:
        result, _ = asyncio.run(run_example(example, inputs, backend, trace_path=args.trace, console=console,
                                            max_tokens=args.max_tokens, live=not args.no_live, meta=meta,
                                            policy=args.policy))
    finally:
        backend.close()
        engine.close()
    return 0 if result.ok else 1
