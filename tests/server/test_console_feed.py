"""What the web console reads from the server, on a scripted engine: the static files (open
without a key), the server-wide live feed (/v1/events: runs changing, engine steps, snapshots),
the engine snapshot (/v1/engine), the graph in run_started/graph events and in the trace."""
from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from agentrt.runtime.trace import read_trace
from agentrt.server.feed import generated_tokens

# the programs API tests' client helpers (tests/ is not a package: --import-mode=importlib)
_spec = importlib.util.spec_from_file_location("programs_api_tests", Path(__file__).parent / "test_programs_api.py")
_api = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_api)
make_client, parse_sse, submit = _api.make_client, _api.parse_sse, _api.submit


async def read_events(resp, until: str, limit_s: float = 10.0) -> list[tuple[str, dict]]:
    """Read SSE events from an open response until one of type `until` (or the time is up)."""
    events, buf = [], ""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while loop.time() < deadline:
        chunk = await asyncio.wait_for(resp.content.readany(), deadline - loop.time())
        if not chunk:
            break
        buf += chunk.decode()
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            [ev] = parse_sse(block + "\n\n") or [{}]
            if "event" in ev:
                events.append((ev["event"], json.loads(ev["data"])))
                if ev["event"] == until:
                    return events
    return events


async def test_console_files_are_served_without_a_key(tmp_path):
    client, _ = await make_client(tmp_path, api_keys=("k1",))
    try:
        index = await client.get("/")
        assert index.status == 200 and "text/html" in index.headers["Content-Type"]
        text = await index.text()
        assert "/console/app.js" in text and "http://" not in text and "https://" not in text  # no CDN
        for path in ("/console/app.js", "/console/api.js", "/view/timeline.js", "/view/model.js"):
            r = await client.get(path)
            assert r.status == 200, path
            assert "javascript" in r.headers["Content-Type"], path
            assert r.headers["Cache-Control"] == "no-cache"  # an upgrade never mixes cached and new modules
        for path in ("/view/../html_timeline.py", "/view/%2e%2e/html_timeline.py", "/console/..%2fapp.py"):
            r = await client.get(path)  # never a file outside the two folders
            assert r.status in (401, 403, 404) and "import" not in await r.text(), path
        assert (await client.get("/v1/events")).status == 401  # the data still needs the key
        assert (await client.get("/v1/engine")).status == 401
    finally:
        await client.close()


async def test_the_feed_tells_of_runs_and_engine_steps(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        feed = await client.get("/v1/events")
        assert feed.status == 200 and feed.headers["Content-Type"].startswith("text/event-stream")
        [(kind, hello)] = await read_events(feed, "hello")
        assert kind == "hello" and hello["model"] == "scripted" and "engine" in hello
        run_id = await submit(client, question="2 + 3?")
        events = await read_events(feed, "engine", limit_s=15)
        while not any(t == "run" and d["run_id"] == run_id and d["status"] == "done" for t, d in events):
            more = await read_events(feed, "run", limit_s=15)
            assert more, events
            events += more
        statuses = [d["status"] for t, d in events if t == "run" and d["run_id"] == run_id]
        assert statuses[0] == "queued" and "running" in statuses and statuses[-1] == "done"
        done = next(d for t, d in events if t == "run" and d["status"] == "done")
        assert done["summary"]["runs"][0]["run_id"] == run_id  # the table's split and α come with it
        steps = [s for t, d in events if t == "engine_steps" for s in d["steps"]]
        assert steps and all(s["end"] >= s["start"] and len(s["ks"]) == s["batch_size"] for s in steps)
        # the engine steps of the feed are those the run's trace recorded, on the same clock
        saved = {r["step"]: r for r in read_trace(tmp_path / "runs" / f"{run_id}.jsonl") if r["type"] == "engine_step"}
        assert {s["step"] for s in steps} <= set(saved)
        for s in steps:
            assert s == saved[s["step"]]
        feed.close()
    finally:
        await client.close()


async def test_engine_snapshot(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        run_id = await submit(client, question="2 + 3?")
        await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "10"})
        snap = await (await client.get("/v1/engine")).json()
        assert set(snap) >= {"time", "batch_size", "steps_per_s", "tokens_per_s", "alpha_60s", "k_hist_60s", "kv",
                             "runs"}
        assert snap["runs"] == {"running": 0, "queued": 0, "waiting": 0}
        assert snap["steps_per_s"] > 0 and snap["tokens_per_s"] > 0
        assert sum(snap["k_hist_60s"].values()) > 0
    finally:
        await client.close()


def test_generated_tokens_counts_what_a_step_emits():
    # 2 sequences decoding with k=3 drafts each (8 fed), 4 drafts accepted, plus a 10-token prefill row
    assert generated_tokens({"num_tokens": 18, "num_prefill_tokens": 10, "drafted": 6, "accepted": 4}) == 6
    assert generated_tokens({"num_tokens": 1, "num_prefill_tokens": 0}) == 1


async def test_run_events_and_trace_carry_the_graph(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        run_id = await submit(client, question="2 + 3?")
        await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "10"})
        events = parse_sse(await (await client.get(f"/v1/runs/{run_id}/events")).text())
        started = json.loads(next(e["data"] for e in events if e["event"] == "run_started"))
        assert {n["id"] for n in started["graph"]["nodes"]} >= {"plan", "sum", "answer"}
        step = json.loads(next(e["data"] for e in events if e["event"] == "step"))
        records = read_trace(tmp_path / "runs" / f"{run_id}.jsonl")
        # the node's step event is the engine step the trace recorded, told once that step ended
        [engine_step] = [r for r in records if r["type"] == "engine_step" and r["step"] == step["step"]]
        assert step["start"] == engine_step["start"] and step["time"] >= engine_step["end"]
        assert step["duration_s"] == pytest.approx(engine_step["end"] - engine_step["start"], abs=2e-6)
        assert (step["batch_size"], step["num_new"]) == (engine_step["batch_size"], engine_step["num_tokens"])
        [program] = [r for r in records if r["type"] == "program"]
        assert {n["id"]: n.get("state") for n in program["graph"]["nodes"]}["answer"] == "done"
    finally:
        await client.close()
