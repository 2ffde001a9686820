"""`agentrt inspect TRACE [--html PATH] [--json]`: re-render a saved run trace, or a served run's
(TRACE = the run's URL, http://HOST:PORT/v1/runs/ID, in any state: what ran, what runs now, and
what waits for input with its question, schema and the command that answers it; the API key
from --api-key, --api-key-file or $AGENTRT_API_KEY).

Default: the report `agentrt run` printed (output, α table, stall totals, timeline).
--json: the machine-readable summary (see agentrt/runtime/summary.py) on stdout.
--html PATH: a self-contained timeline page.
--node ID: one node in full (prompt parts and text, messages, raw output, value; a tool's
arguments and result), with --json its summary and span attributes."""
from __future__ import annotations

import argparse
import io
import json
import sys

from typing import Any

from rich.console import Console
from rich.text import Text

from agentrt.cli.client_args import (add_api_key_arguments, answer_command, client_from_args, waiting_lines,
                                     with_key_hint)
from agentrt.client import Conflict, RunInfo, Unauthorized, split_run_url
from agentrt.errors import RunConfigError
from agentrt.files import write_text_atomic
from agentrt.runtime.html_timeline import render_html
from agentrt.runtime.node_report import render_node
from agentrt.runtime.summary import summarize
from agentrt.runtime.terminal import render_report, report_console
from agentrt.runtime.trace import read_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace saved by `agentrt run` (JSON lines), or a served run's URL")
    p.add_argument("--html", default=None, metavar="PATH", help="write a self-contained HTML timeline")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    add_api_key_arguments(p)
    p.add_argument("--node", default=None, metavar="ID",
                   help="show one node in full: what the model was sent (each part's tokens), its raw output and "
                        "value, or a tool's arguments and result")


def fetch_run(url: str, args: argparse.Namespace) -> tuple[list[dict] | None, RunInfo, str]:
    """A served run (its URL, http://HOST:PORT/v1/runs/ID): its trace records as they stand (None
    while it is queued, or when it ended before it started), the run as the API shows it, and
    its URL as the API names it."""
    base, run_id = split_run_url(url)
    try:
        with client_from_args(args, base) as client:
            info = client.get_run(run_id)
            try:
                records = client.trace(run_id)
            except Conflict:
                records = None
    except Unauthorized as e:
        raise with_key_hint(e) from None
    return records, info, f"{base}/v1/runs/{run_id}"


def live_view(info: RunInfo, run_url: str) -> dict[str, Any]:
    """What a run not yet ended is doing: its nodes running now and those waiting for input."""
    nodes = (info.summary or {}).get("nodes", [])
    return {"run_id": info.run_id, "program": info.program, "status": info.status,
            "running": [n for n in nodes if n.get("status") == "running"
                        and n["node"] not in {w.node for w in info.waiting_for}],
            "waiting_for": [{"node": w.node, "prompt": w.prompt, "schema": w.schema_,
                             "answer": answer_command(run_url, w.node, w.schema_)} for w in info.waiting_for]}


def render_live(console: Console, live: dict[str, Any], run_url: str) -> None:
    console.print(Text("now:", style="bold"))
    for n in live["running"]:
        elapsed = n.get("phase_elapsed_s")
        console.print(Text(f"▶ {n['node']} ({n.get('kind')}) running" + (f": {n['phase']}" if n.get("phase") else "")
                           + (f" for {elapsed:.1f} s" if elapsed is not None else "")))
    for w in live["waiting_for"]:
        first, *rest = waiting_lines(run_url, w["node"], w["prompt"], w["schema"])
        console.print(Text(first, style="bold yellow"))
        for line in rest:
            console.print(Text(line), soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    is_url = args.trace.startswith(("http://", "https://"))
    info, run_url = None, args.trace
    if is_url:
        records, info, run_url = fetch_run(args.trace, args)
        if info.ended and records is None:
            raise RunConfigError(f"{args.trace}: run {info.run_id} ended ({info.status}) before it started: no trace"
                                 + (f" ({info.error.message})" if info.error else ""))
    else:
        records = read_trace(args.trace)
    live = None if info is None or info.ended else live_view(info, run_url)
    if records is None:  # queued: nothing has run
        summary = {"runs": [], "engine": None}
    else:
        try:
            summary = summarize(records)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunConfigError(f"{args.trace}: its records lack what an agentrt trace holds "
                                 f"({type(e).__name__}: {e})") from None
    if live is not None:
        summary["live"] = live  # what runs and waits now; summary["runs"] holds what ran
    if getattr(args, "node", None) is not None:
        if records is None:
            raise RunConfigError(f"{args.trace}: the run is {info.status}: no node of it has run yet")
        shown = render_node(Console(file=io.StringIO()) if args.json else report_console(), records, args.node)
        if args.json:
            json.dump(shown, sys.stdout, indent=2, ensure_ascii=False, default=repr)
            sys.stdout.write("\n")
        return 0
    if args.html and records is not None:
        write_text_atomic(args.html, render_html(summary, records))
    if args.json:
        json.dump(summary, sys.stdout, indent=2, ensure_ascii=False, default=repr)
        sys.stdout.write("\n")
        return 0
    console = report_console()
    if live is not None:
        ran = "nothing has run yet" if records is None else "what has finished so far:"
        console.print(Text(f"run {live['run_id']} ({live['program']}): {live['status']}; {ran}", style="bold"))
    if records is not None:
        render_report(console, summary, records, show_output=live is None)
    if live is not None:
        render_live(console, live, run_url)
    if args.html and records is not None:
        console.print(f"timeline: {args.html}")
    return 0
