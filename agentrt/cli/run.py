"""`agentrt run examples/X.py [--input key=value ...] [--trace PATH] [--db PATH]`: run an agent
program on the embedded engine with a live progress display, then print its output, the α table,
the stall totals and a timeline; the trace is saved as JSON lines (`agentrt inspect` re-renders
it). With --db the run is recorded in a run store as it goes, and `agentrt resume RUN_ID` picks it
up after a crash without running its finished nodes again."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.text import Text

from agentrt.cli.engine_args import add_model_arguments, engine_config
from agentrt.errors import RunConfigError
from agentrt.jsonutil import JsonDepthError, parse_json
from agentrt.runtime.loader import Example, load_example, resolve_inputs
from agentrt.runtime.store_location import db_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", help="a Python file defining `program` (and `tools`, `DEFAULT_INPUTS`)")
    p.add_argument("--input", "-i", action="append", default=[], metavar="KEY=VALUE",
                   help="a program input (repeatable); typed by the program's declared inputs")
    p.add_argument("--db", default=None, metavar="PATH", type=db_argument,
                   help="record the run in this run store: a SQLite file (a path or sqlite:///PATH) or postgresql://USER@HOST/DB "
                        "(resumable with `agentrt resume RUN_ID --db ...`)")
    add_engine_arguments(p)


def parse_answers(pairs: Sequence[str]) -> dict[str, Any]:
    """--answer NODE=JSON pairs -> {node: value}."""
    answers = {}
    for pair in pairs:
        node, sep, raw = pair.partition("=")
        if not sep:
            raise RunConfigError(f"--answer {pair!r}: write NODE=JSON, e.g. approval='{{\"approved\": true}}'")
        try:
            answers[node.strip()] = parse_json(raw)
        except JsonDepthError as e:
            raise RunConfigError(f"--answer {node.strip()}: the value is {e}") from None
        except ValueError as e:
            raise RunConfigError(f"--answer {node.strip()}: the value is not JSON ({e})") from None
    return answers


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """What a run is executed with: model, drafter, policy, trace and display."""
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="where to save the trace (default: runs/<timestamp>-<program>.jsonl)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name, a .gguf file or a local HF directory")
    add_model_arguments(p)
    p.add_argument("--spec", default="template",
                   help="drafter: none | suffix | template (suffix + grammar-forced drafts) | layerskip:N | draft:PATH")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on every LLM call's max_tokens")
    p.add_argument("--policy", default="las", choices=["las", "fcfs"],
                   help="engine priorities: least attained service per program (las) or first come first served")
    p.add_argument("--no-live", action="store_true", help="no live progress display")
    p.add_argument("--verbose", "-v", action="store_true", help="print each node's value (or error) as it finishes")
    p.add_argument("--redact", action="store_true",
                   help="keep prompts, outputs, tool arguments and results out of the trace (only their sizes)")
    from agentrt.tools.mcp.spec import add_mcp_argument

    add_mcp_argument(p)
    p.add_argument("--answer", action="append", default=[], metavar="NODE=JSON",
                   help="the value a wait_for node asks for (repeatable). Without it: on a terminal the value is "
                        "asked field by field (yes/no, text within its length, a numbered choice, a number within "
                        "its bounds; defaults taken on Enter; JSON for a nested field), each answer checked against "
                        "the schema; from piped stdin it is read as one JSON value per line")


def print_finished_node(event: Any, console: Console) -> None:
    """`run -v`: one line per finished node, its value as a prompt would show it, or its error;
    and one per failed tool attempt that is tried again, with its error and the wait."""
    from agentrt.runtime.summary import value_preview

    d = event.data
    if event.type == "node_retried":
        console.print(Text(f"[{event.time:7.2f}s] {d['node']} (tool) attempt {d['attempt']} failed "
                           f"({d.get('error_kind')}): {d.get('error')}; retrying in {d.get('backoff_s') or 0:.3f} s",
                           style="yellow"))
        return
    if event.type != "node_finished":
        return
    head = f"[{event.time:7.2f}s] {d['node']} ({d['kind']})"
    if d["status"] == "ok":
        shown = value_preview(d["value"])
        console.print(Text(f"{head} = {'null' if shown is None else shown}"))
    else:
        console.print(Text(f"{head} {d['status']}: {d.get('error')}", style="red"))


def default_trace_path(program: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{program}.jsonl"


async def run_example(example: Example, inputs: Mapping[str, Any], backend: Any, *, trace_path: str | Path | None = None,
                      console: Console | None = None, max_tokens: int | None = None, live: bool = True,
                      meta: Mapping[str, Any] | None = None, policy: str = "las", store: Any = None,
                      run_id: str | None = None, resume: Any = None,
                      answers: Mapping[str, Any] | None = None, verbose: bool = False,
                      redact: bool = False) -> tuple[Any, Path]:
    """Run one example program on `backend`, print the report, save the trace. Returns
    (RunResult, trace path). store: a RunStore the run is recorded in (resume: what it recorded
    of run_id, to go on from there). redact: the trace keeps the sizes of prompts, outputs and
    tool arguments and results, not their content."""
    from agentrt.runtime.input_prompt import answer_inputs
    from agentrt.runtime.live import LiveProgress
    from agentrt.runtime.runtime import Runtime
    from agentrt.runtime.summary import summarize
    from agentrt.runtime.terminal import render_report, report_console
    from agentrt.runtime.trace import Trace
    from agentrt.runtime.trace_content import TraceContent

    console = console or report_console()
    trace = Trace(name=example.name, meta={"model": backend.model_name, "example": str(example.path),
                                           "max_tokens_cap": max_tokens, **(meta or {})})
    runtime = Runtime(backend, tools=example.tools, trace=trace, max_tokens=max_tokens, policy=policy, store=store,
                      trace_content=TraceContent(redact=redact))
    progress = LiveProgress(runtime, console) if live else None
    answer_inputs(runtime, answers or {}, console, paused=progress.paused if progress is not None else None)
    if verbose:
        runtime.subscribe_events(lambda ev: print_finished_node(ev, console))
    stored = {}
    if runtime.store.durable:  # named and recorded, so that `agentrt resume` can go on with it
        from agentrt.runtime.store import file_hash

        run_id = run_id or f"{example.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        stored = {"run_id": run_id, "resume": resume, "program_hash": file_hash(example.path),
                  "metadata": {"path": str(Path(example.path).resolve())}}
        console.print(f"run {run_id} recorded in {runtime.store.location}" + (" (resumed)" if resume is not None else ""))
    try:
        if progress is not None:
            async with progress:
                result = await runtime.run(example.program, inputs, **stored)
        else:
            result = await runtime.run(example.program, inputs, **stored)
    finally:
        await runtime.aclose()
        await runtime.tools.aclose()
    path = trace.write(trace_path or default_trace_path(example.name))
    records = trace.records()
    render_report(console, summarize(records), records)
    console.print(f"trace: {path}   (agentrt inspect {path} --html timeline.html)")
    return result, path


def check_writable(path: str | Path, flag: str) -> None:
    """Before a run starts: its output file can be written (else the run's report is lost)."""
    path = Path(path)
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunConfigError(f"{flag} {path}: cannot create the folder {folder} ({e.strerror})") from None
    if path.is_dir() or not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise RunConfigError(f"{flag} {path}: cannot be written")


def run(args: argparse.Namespace) -> int:
    from agentrt.tools.mcp.spec import configure_from_flags

    servers = configure_from_flags(args.mcp)  # before the program file's mcp_tools(...) run
    example = load_example(args.program)
    for spec in servers:
        if not any(getattr(t, "mcp", None) is not None and t.mcp.server == spec for t in example.tools):
            print(f"warning: --mcp {spec.name}: {example.path.name} declares no mcp_tools('{spec.name}'), so no "
                  "node can call its tools", file=sys.stderr)
    inputs = resolve_inputs(example, args.input)
    if args.trace:
        check_writable(args.trace, "--trace")
    from agentrt.runtime.store import NullRunStore, open_store

    store = open_store(args.db) if args.db else NullRunStore()
    try:
        return run_on_engine(args, example, inputs, store)
    finally:
        store.close()


def run_on_engine(args: argparse.Namespace, example: Example, inputs: Mapping[str, Any], store: Any = None,
                  run_id: str | None = None, resume: Any = None) -> int:
    """Load the engine the arguments name and run the example on it (agentrt run and resume)."""
    from agentrt.runtime.terminal import report_console

    console = report_console()
    from agentrt.engine import AsyncEngine, LLMEngine
    from agentrt.runtime.engine_backend import EngineBackend

    with console.status(f"loading {args.model} ..."):
        t0 = time.perf_counter()
        engine = AsyncEngine(LLMEngine(engine_config(args)))
        load_s = time.perf_counter() - t0
        # the first call of a fresh engine pays one-off costs: not inside the program's first LLM node
        warmup_s = asyncio.run(engine.warm_up())
    backend = EngineBackend(engine, model_name=args.model)
    precision = engine.info.precision
    console.print(f"model: {args.model} ({precision}; {args.device}), loaded in {load_s:.1f} s", markup=False, highlight=False)
    meta = {"engine_load_s": round(load_s, 3), "engine_warmup_s": round(warmup_s, 3),
            "precision": precision, "device": args.device, "drafter": args.spec, "policy": args.policy}
    try:
        result, _ = asyncio.run(run_example(example, inputs, backend, trace_path=args.trace, console=console,
                                            max_tokens=args.max_tokens, live=not args.no_live, meta=meta,
                                            policy=args.policy, store=store, run_id=run_id, resume=resume,
                                            answers=parse_answers(args.answer), verbose=getattr(args, "verbose", False),
                                            redact=getattr(args, "redact", False)))
    finally:
        backend.close()
        engine.close()
    return 0 if result.ok else 1
