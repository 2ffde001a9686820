"""`agentrt submit PROGRAM --server URL [--input k=v]...`: run a program on a server and follow
it (agentrt.client): each node as it starts and ends (tool retries too) streamed from the run's
events, a wait_for node's question with the URL and the command that answers it, then the
report `agentrt run` prints (output, α table, stalls, timeline) from the run's trace. Inputs are
typed by the program's input schema. The API key: --api-key, --api-key-file or AGENTRT_API_KEY."""
from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from agentrt.cli.client_args import add_api_key_arguments, client_from_args, waiting_lines, with_key_hint
from agentrt.client import Unauthorized
from agentrt.errors import RunConfigError
from agentrt.runtime.loader import coerce_input


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", help="the name of a program the server loaded (GET /v1/programs lists them)")
    p.add_argument("--server", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--input", "-i", action="append", default=[], metavar="KEY=VALUE")
    add_api_key_arguments(p)
    p.add_argument("--idempotency-key", default=None, metavar="KEY",
                   help="submitting again with the same key follows the run it started instead of starting another")
    p.add_argument("--priority", type=float, default=None)
    p.add_argument("--tokens", action="store_true", help="print LLM output as it is generated")


def typed_inputs(schema: dict[str, Any], pairs: list[str], program: str) -> dict[str, Any]:
    props = schema.get("properties", {})
    inputs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise RunConfigError(f"--input {pair!r}: write key=value")
        if key not in props:
            raise RunConfigError(f"--input {key}: not an input of program '{program}' (inputs: {', '.join(props) or 'none'})")
        inputs[key] = coerce_input(key, props[key].get("type", "string"), raw)
    return inputs


def submit(args: argparse.Namespace, console: Console) -> int:
    from agentrt.runtime.summary import summarize
    from agentrt.runtime.terminal import render_report

    with client_from_args(args, args.server) as client:
        programs = {p.name: p for p in client.programs()}
        if args.program not in programs:
            raise RunConfigError(f"the server has no program '{args.program}' "
                                 f"(it has: {', '.join(programs) or 'none'})")
        inputs = typed_inputs(programs[args.program].input_schema, args.input, args.program)
        run = client.start_run(args.program, inputs, priority=args.priority, idempotency_key=args.idempotency_key)
        run_url = f"{client.base_url}/v1/runs/{run.run_id}"
        again = "" if run.created else " (started before with this key)"
        console.print(f"run {run.run_id} on {client.base_url}{again}")
        for ev in client.events(run.run_id):
            show(console, ev.type, ev.data, args.tokens, run_url)
        records = client.trace(run.run_id)
    if args.tokens:
        console.print()
    render_report(console, summarize(records), records)
    status = next(r["status"] for r in records if r["type"] == "program")
    console.print(f"trace: {run_url}/trace   (agentrt inspect {run_url})")
    return 0 if status == "done" else 1


def show(console: Console, event: str, data: dict[str, Any], tokens: bool, run_url: str) -> None:
    if event == "token":
        if tokens:
            console.print(data["text"], end="", markup=False, highlight=False)
    elif event == "node_started":
        console.print(f"[dim]▶ {data['node']}[/dim] ({data['kind']}{' ' + data['tool'] if data.get('tool') else ''})")
    elif event == "node_finished":
        mark = "[green]✔[/green]" if data["status"] == "ok" else "[red]✘[/red]"
        console.print(f"{mark} {data['node']}" + (f": {data['error']}" if data.get("error") else ""))
    elif event == "node_retried":
        console.print(f"[yellow]↻ {data['node']}[/yellow] attempt {data['attempt']} failed: {data['error']}")
    elif event == "input_wanted":
        first, *rest = waiting_lines(run_url, data["node"], data.get("prompt"), data["schema"])
        console.print(first, style="bold yellow", markup=False, highlight=False)
        for line in rest:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    elif event == "run_resumed":
        console.print("[dim]… the server restarted; the run goes on from its run store[/dim]")


def run(args: argparse.Namespace) -> int:
    try:
        return submit(args, Console())
    except Unauthorized as e:
        raise with_key_hint(e) from None
