"""`agentrt inspect TRACE [--html PATH] [--json]`: re-render a saved run trace, or a served run's
(TRACE = the run's URL, http://HOST:PORT/v1/runs/ID; the API key from $AGENTRT_API_KEY).

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

from rich.console import Console


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
    p.add_argument("--node", default=None, metavar="ID",
                   help="show one node in full: what the model was sent (each part's tokens), its raw output and "
                        "value, or a tool's arguments and result")


def fetch_trace(url: str) -> list[dict]:
    """A served run's trace (GET <run URL>/trace)."""
    import os
    import urllib.error
    import urllib.request


    key = os.environ.get("AGENTRT_API_KEY")
    request = urllib.request.Request(url.rstrip("/") + "/trace", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            text = r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        raise RunConfigError(f"{url}: {e.code} {e.read().decode('utf-8', 'replace')[:300]}") from None
    except urllib.error.URLError as e:
        raise RunConfigError(f"{url}: cannot reach it ({e.reason})") from None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run(args: argparse.Namespace) -> int:
    is_url = args.trace.startswith(("http://", "https://"))
    records = fetch_trace(args.trace) if is_url else read_trace(args.trace)
    try:
        summary = summarize(records)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RunConfigError(f"{args.trace}: its records lack what an agentrt trace holds "
                             f"({type(e).__name__}: {e})") from None
    if getattr(args, "node", None) is not None:
        shown = render_node(Console(file=io.StringIO()) if args.json else report_console(), records, args.node)
        if args.json:
            json.dump(shown, sys.stdout, indent=2, ensure_ascii=False, default=repr)
            sys.stdout.write("\n")
        return 0
    if args.html:
        write_text_atomic(args.html, render_html(summary, records))
    if args.json:
        json.dump(summary, sys.stdout, indent=2, ensure_ascii=False, default=repr)
        sys.stdout.write("\n")
    else:
        console = report_console()
        render_report(console, summary, records)
        if args.html:
            console.print(f"timeline: {args.html}")
    return 0
