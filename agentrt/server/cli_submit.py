"""`agentrt submit PROGRAM --server URL [--input k=v]...`: run a program on a server and follow
it: each node as it starts and ends (tool retries too) streamed from the run's events, then the
report `agentrt run` prints (output, α table, stalls, timeline) from the run's trace. Inputs are
typed by the program's input schema. The API key comes from --api-key or AGENTRT_API_KEY."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from rich.console import Console

from agentrt.errors import RunConfigError
from agentrt.runtime.loader import coerce_input


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", help="the name of a program the server loaded (GET /v1/programs lists them)")
    p.add_argument("--server", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--input", "-i", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--api-key", default=None, help="default: $AGENTRT_API_KEY")
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


async def submit(args: argparse.Namespace, console: Console) -> int:
    import aiohttp

    from agentrt.runtime.summary import summarize
    from agentrt.runtime.terminal import render_report

    key = args.api_key or os.environ.get("AGENTRT_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.server.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as http:
        async def call(method: str, path: str, **kw: Any) -> Any:
            async with http.request(method, base + path, **kw) as r:
                body = await r.json(content_type=None)
                if r.status >= 400:
                    raise RunConfigError(f"{method} {path}: {r.status} {body.get('error', {}).get('message', body)}")
                return body

        programs = {p["name"]: p for p in (await call("GET", "/v1/programs"))["data"]}
        if args.program not in programs:
            raise RunConfigError(f"the server has no program '{args.program}' (it has: {', '.join(programs) or 'none'})")
        body: dict[str, Any] = {"inputs": typed_inputs(programs[args.program]["input_schema"], args.input, args.program)}
        if args.priority is not None:
            body["priority"] = args.priority
        run_id = (await call("POST", f"/v1/programs/{args.program}/runs", json=body))["run_id"]
        console.print(f"run {run_id} on {base}")
        last = 0
        while True:  # reconnect with Last-Event-ID until the run ends
            try:
                async with http.get(f"{base}/v1/runs/{run_id}/events", headers={"Last-Event-ID": str(last)}) as r:
                    event = None
                    async for raw in r.content:
                        line = raw.decode().rstrip("\n")
                        if line.startswith("id: "):
                            last = int(line[4:])
                        elif line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: ") and event:
                            show(console, event, json.loads(line[6:]), args.tokens)
                if event == "run_finished":
                    break
            except aiohttp.ClientPayloadError:
                continue
        text = await (await http.get(f"{base}/v1/runs/{run_id}/trace")).text()
        records = [json.loads(x) for x in text.splitlines() if x.strip()]
    if args.tokens:
        console.print()
    render_report(console, summarize(records), records)
    status = next(r["status"] for r in records if r["type"] == "program")
    console.print(f"trace: {base}/v1/runs/{run_id}/trace   (agentrt inspect {base}/v1/runs/{run_id})")
    return 0 if status == "done" else 1


def show(console: Console, event: str, data: dict[str, Any], tokens: bool) -> None:
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
        console.print(f"[bold yellow]? {data['node']}[/bold yellow] waits for input: {data.get('prompt') or ''} "
                      f"(POST /v1/runs/RUN_ID/input/{data['node']} with {{\"value\": ...}}; schema "
                      f"{json.dumps(data['schema'])})", markup=True, highlight=False)
    elif event == "run_resumed":
        console.print("[dim]… the server restarted; the run goes on from its run store[/dim]")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(submit(args, Console()))
