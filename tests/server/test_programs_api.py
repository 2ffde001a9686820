"""The programs API on a scripted engine (ScriptedBackend), through aiohttp's test client: submit,
events (ordered, resumable with Last-Event-ID), wait, cancel, idempotency, admission, keys,
limits, and bad input on every route."""
from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrt.jsonutil import MAX_JSON_DEPTH
from agentrt.runtime.loader import load_example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.runtime.summary import summarize
from agentrt.runtime.trace import read_trace
from agentrt.server.app import create_app
from agentrt.server.config import Limits, ServerConfig

PROGRAM = Path(__file__).parent / "calc_program.py"
REPLIES = {"plan": {"a": 2, "b": 3}, "answer": "The sum is five."}


async def make_client(tmp_path, **config) -> tuple[TestClient, ScriptedBackend]:
    example = load_example(PROGRAM)
    backend = ScriptedBackend(REPLIES, step_s=0.002)
    runtime = Runtime(backend, tools=example.tools)
    cfg = ServerConfig(runs_dir=tmp_path / "runs", access_log=False, **config)
    app = create_app(cfg, "scripted", {example.name: example}, runtime)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, backend


async def submit(client: TestClient, **inputs) -> str:
    """Start a calc run with these inputs; its run id."""
    r = await client.post("/v1/programs/calc/runs", json={"inputs": inputs})
    assert r.status == 201, await r.text()
    return (await r.json())["run_id"]


def parse_sse(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        ev = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            ev[key] = value
        if ev:
            events.append(ev)
    return events


async def test_programs_list_and_run_to_end(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        r = await client.get("/v1/programs")
        assert r.status == 200
        [prog] = (await r.json())["data"]
        assert prog["name"] == "calc" and prog["description"].startswith("Adds two numbers")
        assert prog["input_schema"]["properties"]["delay"]["type"] == "number"
        assert {n["id"] for n in prog["graph"]["nodes"]} >= {"plan", "sum", "answer"}
        assert {"source": "plan", "target": "sum"} in prog["graph"]["edges"]

        r = await client.post("/v1/programs/calc/runs", json={"inputs": {"question": "2 + 3?"}, "metadata": {"who": "t"}})
        assert r.status == 201, await r.text()
        run_id = (await r.json())["run_id"]
        r = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "10"})
        info = await r.json()
        assert info["status"] == "done" and info["output"] == "The sum is five."
        assert info["metadata"] == {"who": "t"}

        # the run's summary is what `agentrt inspect --json` prints for its trace
        trace = await client.get(f"/v1/runs/{run_id}/trace")
        lines = [json.loads(x) for x in (await trace.text()).splitlines()]
        saved = read_trace(tmp_path / "runs" / f"{run_id}.jsonl")
        assert lines == saved
        assert info["summary"] == json.loads(json.dumps(summarize(saved), default=repr))
        [run] = info["summary"]["runs"]
        assert {n["node"] for n in run["nodes"]} == {"plan", "sum", "answer"}
        html = await client.get(f"/v1/runs/{run_id}/timeline")
        assert html.status == 200 and "<html" in (await html.text()).lower()

        listed = await (await client.get("/v1/runs", params={"program": "calc", "status": "done"})).json()
        assert [x["run_id"] for x in listed["data"]] == [run_id]
    finally:
        await client.close()


async def test_events_are_ordered_and_resume_without_gaps(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        run_id = await submit(client, delay=0.05)
        full = parse_sse(await (await client.get(f"/v1/runs/{run_id}/events")).text())
        ids = [int(e["id"]) for e in full]
        assert ids == list(range(1, len(ids) + 1))
        types = [e["event"] for e in full]
        assert types[0] == "run_queued" and types[1] == "run_started" and types[-1] == "run_finished"
        for node in ("plan", "sum", "answer"):
            started = next(i for i, e in enumerate(full) if e["event"] == "node_started" and json.loads(e["data"])["node"] == node)
            finished = next(i for i, e in enumerate(full) if e["event"] == "node_finished" and json.loads(e["data"])["node"] == node)
            assert started < finished
        assert any(e["event"] == "token" for e in full) and any(e["event"] == "step" for e in full)
        assert json.loads(full[-1]["data"])["status"] == "done"
        # reconnect after event 5: exactly the rest, no duplicates
        rest = parse_sse(await (await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": "5"})).text())
        assert [e["id"] for e in rest] == [e["id"] for e in full[5:]]
        assert [e["data"] for e in rest] == [e["data"] for e in full[5:]]
    finally:
        await client.close()


async def test_cancel_mid_run(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        run_id = await submit(client, delay=30)
        for _ in range(200):  # until the slow tool runs
            info = await (await client.get(f"/v1/runs/{run_id}")).json()
            if any(n["node"] == "sum" and n["status"] == "running" for n in info["summary"]["nodes"]):
                break
            await asyncio.sleep(0.01)
        r = await client.post(f"/v1/runs/{run_id}/cancel")
        assert r.status == 200
        info = await r.json()
        assert info["status"] == "cancelled"
        assert (await client.post(f"/v1/runs/{run_id}/cancel")).status == 409
        events = parse_sse(await (await client.get(f"/v1/runs/{run_id}/events")).text())
        cancelled = [json.loads(e["data"]) for e in events if e["event"] == "node_finished"]
        assert {"node": "sum", "status": "cancelled"}.items() <= next(c for c in cancelled if c["node"] == "sum").items()
    finally:
        await client.close()


async def test_idempotency_key_returns_the_same_run(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        body, headers = {"inputs": {"question": "1 + 1?"}}, {"Idempotency-Key": "k-1"}
        first = await client.post("/v1/programs/calc/runs", json=body, headers=headers)
        second = await client.post("/v1/programs/calc/runs", json=body, headers=headers)
        assert first.status == 201 and second.status == 200
        assert (await first.json())["run_id"] == (await second.json())["run_id"]
        other = await client.post("/v1/programs/calc/runs", json={"inputs": {"question": "9?"}}, headers=headers)
        assert other.status == 422 and "Idempotency-Key" in (await other.json())["error"]["message"]
        runs = (await (await client.get("/v1/runs")).json())["data"]
        assert len(runs) == 1
    finally:
        await client.close()


async def test_admission_limits_give_429_and_the_server_keeps_serving(tmp_path):
    client, _ = await make_client(tmp_path, limits=Limits(max_running_runs=1, max_queued_runs=2))
    try:
        statuses = [(await client.post("/v1/programs/calc/runs", json={"inputs": {"delay": 30}})).status for _ in range(5)]
        assert statuses == [201, 201, 201, 429, 429]
        r = await client.post("/v1/programs/calc/runs", json={"inputs": {"delay": 30}})
        assert r.headers["Retry-After"] == "1"
        assert "max_queued_runs=2" in (await r.json())["error"]["message"]
        assert (await client.get("/health")).status == 200
        runs = (await (await client.get("/v1/runs", params={"status": "queued"})).json())["data"]
        assert len(runs) == 2
        for run in (await (await client.get("/v1/runs")).json())["data"]:
            await client.post(f"/v1/runs/{run['run_id']}/cancel")
    finally:
        await client.close()


async def test_api_keys(tmp_path):
    client, _ = await make_client(tmp_path, api_keys=("sekret-1", "sekret-2"))
    try:
        assert (await client.get("/health")).status == 200
        r = await client.get("/v1/programs")
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        assert (await client.get("/v1/programs", headers={"Authorization": "Bearer nope"})).status == 401
        assert (await client.get("/v1/programs", headers={"Authorization": "Basic sekret-1"})).status == 401
        assert (await client.get("/v1/programs", headers={"Authorization": "Bearer sekret-2"})).status == 200
        assert (await client.get("/metrics")).status == 401
    finally:
        await client.close()


async def test_body_limit_and_bad_input_on_every_route(tmp_path):
    client, _ = await make_client(tmp_path, limits=Limits(max_body_bytes=2048))
    try:
        r = await client.post("/v1/programs/calc/runs", data=b"{" + b" " * 4096 + b"}",
                              headers={"Content-Type": "application/json"})
        assert r.status == 413 and "max_body_bytes=2048" in (await r.json())["error"]["message"]
        bad = [
            ("post", "/v1/programs/calc/runs", b"not json", "not valid JSON"),
            ("post", "/v1/programs/calc/runs", b"[1, 2]", "JSON object"),
            ("post", "/v1/programs/calc/runs", json.dumps({"inputs": {"question": 3}}).encode(), "question"),
            ("post", "/v1/programs/calc/runs", json.dumps({"inputs": {"nope": 1}}).encode(), "nope"),
            ("post", "/v1/programs/calc/runs", json.dumps({"inputz": {}}).encode(), "inputz"),
            ("post", "/v1/programs/nothing/runs", b"{}", "no program named 'nothing'"),
            ("post", "/v1/chat/completions", b"{}", "model"),
            ("post", "/v1/chat/completions", json.dumps({"model": "scripted", "messages": "hi"}).encode(), "messages"),
            ("get", "/v1/runs?limit=abc", None, "limit"),
            ("get", "/v1/runs?status=weird", None, "status"),
            ("get", "/v1/runs/run_missing", None, "no run"),
            ("get", "/v1/runs/run_missing/events", None, "no run"),
            ("get", "/v1/nowhere", None, "no route"),
            ("delete", "/v1/runs", None, "not allowed"),
        ]
        for method, path, data, needle in bad:
            r = await getattr(client, method)(path, data=data, headers={"Content-Type": "application/json"})
            body = await r.json()
            assert 400 <= r.status < 500, (path, r.status)
            assert needle in body["error"]["message"], (path, body)
    finally:
        await client.close()


async def test_bodies_nested_past_the_depth_limit_get_a_400_naming_it(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        deep = "[" * 5000 + "]" * 5000  # past Python's recursive JSON parser
        too_deep = f"nested deeper than {MAX_JSON_DEPTH} levels"
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        call = {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": deep}}]}
        bad = [
            ("/v1/chat/completions", '{"model": "scripted", "messages": ' + deep + "}"),
            ("/v1/programs/calc/runs", '{"inputs": {"question": ' + deep + "}}"),
            ("/v1/programs/calc/runs", "{" * 3000),  # never closed: refused before parsing all the same
            ("/v1/chat/completions", json.dumps({**chat, "messages": [call, *chat["messages"]]})),  # inside a string
        ]
        for path, data in bad:
            r = await client.post(path, data=data, headers={"Content-Type": "application/json"})
            body = await r.json()
            assert r.status == 400 and too_deep in body["error"]["message"], (path, data[:60], body)
        r = await client.post("/v1/programs/calc/runs", json={"inputs": {"question": "2 + 3?"}})
        assert r.status == 201  # the server serves on
    finally:
        await client.close()


class nested:
    """A value `depth` levels deep, written as JSON text by json_text (json.dumps recurses too)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"nested({self.depth})"


def json_text(value) -> str:
    if isinstance(value, nested):
        return "[" * value.depth + "]" * value.depth
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {json_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@pytest.mark.parametrize("seed", range(3))
async def test_fuzzed_bodies_never_give_a_5xx(tmp_path, seed):
    import random

    rng = random.Random(seed)
    values = [None, 0, -1, 1.5, "", "x" * 50, [], {}, [1, "a"], {"a": {"b": []}}, True,
              nested(MAX_JSON_DEPTH - 3), nested(MAX_JSON_DEPTH), nested(5000)]
    client, _ = await make_client(tmp_path)
    try:
        routes = ["/v1/chat/completions", "/v1/programs/calc/runs"]
        keys = ["model", "messages", "inputs", "priority", "metadata", "tools", "tool_choice", "stream", "n",
                "max_tokens", "temperature", "response_format", "stop", "seed"]
        for _ in range(40):
            body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, 5))}
            r = await client.post(rng.choice(routes), data=json_text(body), headers={"Content-Type": "application/json"})
            assert r.status < 500, (body, await r.text())
            if r.status >= 400:
                assert "message" in (await r.json())["error"]
            if any(isinstance(v, nested) and 1 + v.depth > MAX_JSON_DEPTH for v in body.values()):
                assert r.status == 400 and "the JSON depth limit" in (await r.json())["error"]["message"], body
    finally:
        await client.close()


async def test_metrics_and_health(tmp_path):
    client, _ = await make_client(tmp_path)
    try:
        run_id = await submit(client)
        await client.get(f"/v1/runs/{run_id}/wait")
        text = await (await client.get("/metrics")).text()
        r = f'replica="{socket.gethostname()}:{ServerConfig().port}"'  # every sample names the replica (labels in name order)
        assert f'agentrt_runs_total{{{r},status="done"}} 1.0' in text
        assert f'agentrt_node_duration_seconds_count{{kind="tool",{r}}} 1.0' in text
        assert f'agentrt_tool_duration_seconds_count{{{r},tool="slow_add"}} 1.0' in text
        assert f'agentrt_engine_steps_total{{engine="in-process",{r}}}' in text
        assert f'agentrt_http_requests_total{{{r},route="/v1/programs/{{name}}/runs",status="201"}} 1.0' in text
        assert (await (await client.get("/ready")).json())["status"] == "ready"
    finally:
        await client.close()


async def test_run_spans_exported_through_opentelemetry(tmp_path):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentrt.runtime.otel import tracer_provider

    exporter = InMemorySpanExporter()
    example = load_example(PROGRAM)
    runtime = Runtime(ScriptedBackend(REPLIES, step_s=0.002), tools=example.tools)
    app = create_app(ServerConfig(runs_dir=tmp_path / "runs", access_log=False), "scripted", {example.name: example},
                     runtime, tracer_provider=tracer_provider(exporter, batch=False))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        run_id = await submit(client)
        await client.get(f"/v1/runs/{run_id}/wait")
        trace = [json.loads(x) for x in (await (await client.get(f"/v1/runs/{run_id}/trace")).text()).splitlines()]
    finally:
        await client.close()
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.parent is None]
    assert root.name == "invoke_agent calc" and root.attributes["agentrt.run_id"] == run_id
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    ours = [r for r in trace if r["type"] == "span"]
    assert sorted(s.name for s in spans if s.parent is not None) == sorted(r["name"] for r in ours)
    tool = next(s for s in spans if s.name == "execute_tool slow_add")
    assert tool.parent.span_id == root.context.span_id and tool.attributes["gen_ai.tool.name"] == "slow_add"
    phases = [s for s in spans if s.parent is not None and s.parent.span_id == tool.context.span_id]
    assert phases and all(tool.start_time <= p.start_time <= p.end_time <= tool.end_time for p in phases)
    chat = next(s for s in spans if s.name.startswith("chat ") and s.attributes["agentrt.node"] == "plan")
    assert chat.attributes["gen_ai.usage.output_tokens"] > 0


async def test_event_stream_cap(tmp_path):
    client, _ = await make_client(tmp_path, limits=Limits(max_sse_connections=1))
    try:
        run_id = await submit(client, delay=30)
        first = await client.get(f"/v1/runs/{run_id}/events")
        assert first.status == 200
        second = await client.get(f"/v1/runs/{run_id}/events")
        assert second.status == 429 and "max_sse_connections=1" in (await second.json())["error"]["message"]
        await client.post(f"/v1/runs/{run_id}/cancel")
        await first.text()  # the stream ends with the run
        third = await client.get(f"/v1/runs/{run_id}/events")
        assert third.status == 200 and "run_finished" in await third.text()
    finally:
        await client.close()


async def test_shutdown_lets_short_runs_finish_and_cancels_the_rest(tmp_path):
    from agentrt.server.app import STATE

    client, _ = await make_client(tmp_path)
    try:
        quick = await submit(client, delay=0.05)
        slow = await submit(client, delay=30)
        state = client.server.app[STATE]
        await state.runs.shutdown(grace_s=1.0)
        assert state.runs.get(quick).status == "done"
        assert state.runs.get(slow).status == "cancelled"
        r = await client.post("/v1/programs/calc/runs", json={})
        assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
        assert (await client.get(f"/v1/runs/{quick}")).status == 200  # finished runs are still served
    finally:
        await client.close()
