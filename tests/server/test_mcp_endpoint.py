"""The served programs as MCP tools at /mcp, through the official SDK's client (Streamable HTTP,
ClientSession) against the real aiohttp app on a scripted engine with a SQLite run store: tools
and their schemas, a call's structured result and progress, cancelling a call cancels its run,
a waiting program returns its run and node and takes the answer, bad tools and arguments are
refused by name while other runs go on, and the API keys hold (401, sessions bound to a key)."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import AsyncIterator

import httpx2
import pytest
from aiohttp.test_utils import TestServer
from mcp import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from agentrt.dag import JsonSchema, Program
from agentrt.runtime.loader import load_example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.runtime.store import SQLiteRunStore
from agentrt.server.app import STATE, create_app
from agentrt.server.config import ServerConfig
from agentrt.server.mcp_endpoint import PROVIDE_INPUT, output_schema

HERE = Path(__file__).parent
KEY, OTHER_KEY = "mcp-test-key", "another-key"
SSE_TIMEOUT = httpx2.Timeout(30, read=300)  # the SDK's own: its event streams stay open between events
REPLIES = {"plan": {"a": 2, "b": 3}, "answer": "The sum is five.", "draft": "Rain falls softly."}


@contextlib.asynccontextmanager
async def served(tmp_path: Path, **config) -> AsyncIterator[TestServer]:
    """The app over a scripted engine and a SQLite run store, on a port (closed at the end)."""
    calc, review = load_example(HERE / "calc_program.py"), load_example(HERE / "review_program.py")
    store = SQLiteRunStore(tmp_path / "runs.db")
    runtime = Runtime(ScriptedBackend(REPLIES, step_s=0.002), tools=calc.tools, store=store)
    config = ServerConfig(runs_dir=tmp_path / "runs", db=tmp_path / "runs.db", access_log=False,
                          api_keys=(KEY, OTHER_KEY), **config)
    srv = TestServer(create_app(config, "scripted", {calc.name: calc, review.name: review}, runtime))
    await srv.start_server()
    try:
        yield srv
    finally:
        await srv.close()
        await runtime.aclose()
        store.close()


@pytest.fixture
async def server(tmp_path) -> AsyncIterator[TestServer]:
    async with served(tmp_path) as srv:
        yield srv


def mcp_url(srv: TestServer) -> str:
    return f"http://127.0.0.1:{srv.port}/mcp"


@contextlib.asynccontextmanager
async def session(srv: TestServer, key: str = KEY) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=SSE_TIMEOUT) as http:
        async with streamable_http_client(mcp_url(srv), http_client=http) as (read, write, *_):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s


async def run_info(srv: TestServer, run_id: str) -> dict:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = await http.get(f"http://127.0.0.1:{srv.port}/v1/runs/{run_id}")
        assert r.status_code == 200, r.text
        return r.json()


async def test_each_program_is_a_tool_with_its_input_and_output_schemas(server):
    async with session(server) as s:
        tools = {t.name: t for t in (await s.list_tools()).tools}
    assert set(tools) == {"calc", "review", PROVIDE_INPUT}
    calc = server.app[STATE].programs["calc"]
    assert tools["calc"].description == calc.description
    assert tools["calc"].input_schema == calc.program.input_schema(calc.default_inputs)
    assert tools["calc"].output_schema["properties"]["output"] == {"type": "string"}  # a text LLM node
    assert tools["review"].output_schema["properties"]["output"] == {"type": "boolean"}  # review["approved"]


async def test_a_call_runs_the_program_reports_each_node_and_returns_its_output(server):
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with session(server) as s:
        result = await s.call_tool("calc", {"question": "What is 2 + 3?"}, progress_callback=on_progress)
    assert not result.is_error, result.content
    run_id = result.structured_content["run_id"]
    assert result.structured_content == {"run_id": run_id, "status": "done", "output": "The sum is five."}
    assert result.content[0].text == "The sum is five."
    assert [m for _, _, m in progress] == ["plan ok", "sum ok", "answer ok"]
    assert [d for d, _, _ in progress] == [1, 2, 3] and all(t == 3 for _, t, _ in progress)
    info = await run_info(server, run_id)  # a run like any other: listed, recorded, traced
    assert info["status"] == "done" and info["metadata"] == {"via": "mcp"} and info["output"] == "The sum is five."
    assert server.app[STATE].runtime.store.get_run(run_id).status == "done"


async def test_cancelling_the_call_cancels_its_run(server):
    runs = server.app[STATE].runs
    planned = asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        if message == "plan ok":
            planned.set()

    async with session(server) as s:
        call = asyncio.ensure_future(s.call_tool("calc", {"delay": 60.0}, progress_callback=on_progress))
        await asyncio.wait_for(planned.wait(), 10)  # the run is in its slow tool now
        (run,) = [r for r in runs.runs.values() if r.program == "calc" and not r.ended]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(run.changed(after=1 << 62), 10)
        assert run.status == "cancelled"
        after = await s.call_tool("calc", {})  # the session and the server go on
    assert after.structured_content["status"] == "done"


async def test_a_2026_client_calls_with_progress_and_cancels_by_closing_its_stream(server):
    """mcp.Client probes server/discover and speaks 2026-07-28: one stateless request per call,
    cancelled by closing its response stream."""
    runs, progress, planned = server.app[STATE].runs, [], asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message)
        if message == "plan ok" and len(progress) > 3:  # the second call's plan
            planned.set()

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=SSE_TIMEOUT) as http:
        async with Client(streamable_http_client(mcp_url(server), http_client=http)) as client:
            assert client.protocol_version == "2026-07-28"
            result = await client.call_tool("calc", {}, progress_callback=on_progress)
            assert result.structured_content["output"] == "The sum is five." and progress[-1] == "answer ok"
            call = asyncio.ensure_future(client.call_tool("calc", {"delay": 60.0}, progress_callback=on_progress))
            await asyncio.wait_for(planned.wait(), 10)  # the run is in its slow tool now
            (run,) = [r for r in runs.runs.values() if not r.ended]
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.wait_for(run.changed(after=1 << 62), 10)
    assert run.status == "cancelled"


async def test_a_waiting_program_returns_its_run_and_node_and_takes_the_answer(server):
    async with session(server) as s:
        waiting = await asyncio.wait_for(s.call_tool("review", {"topic": "rain"}), 10)
        assert not waiting.is_error
        run_id = waiting.structured_content["run_id"]
        assert waiting.structured_content["status"] == "waiting"
        (wanted,) = waiting.structured_content["waiting_for"]
        assert wanted["node"] == "review" and wanted["prompt"] == "Publish Rain falls softly.?"
        assert wanted["schema"]["required"] == ["approved"]
        text = waiting.content[0].text
        assert PROVIDE_INPUT in text and f"/v1/runs/{run_id}/input/review" in text
        assert (await run_info(server, run_id))["status"] == "waiting"

        refused = await s.call_tool(PROVIDE_INPUT, {"run_id": run_id, "node": "review", "value": {"approved": "yes"}})
        assert refused.is_error and "approved" in refused.content[0].text  # the schema says no; it still waits
        done = await s.call_tool(PROVIDE_INPUT, {"run_id": run_id, "node": "review", "value": {"approved": True},
                                                 "by": "editor"})
    assert not done.is_error, done.content
    assert done.structured_content == {"run_id": run_id, "status": "done", "output": True}


async def test_a_bad_tool_or_bad_arguments_are_refused_by_name_and_other_runs_go_on(server):
    async with session(server) as s:
        slow = asyncio.ensure_future(s.call_tool("calc", {"delay": 0.3}))
        with pytest.raises(MCPError) as unknown:
            await s.call_tool("calculator", {})
        assert "calculator" in unknown.value.message and "calc" in unknown.value.message
        bad = await s.call_tool("calc", {"question": 3})
        assert bad.is_error and "calc" in bad.content[0].text and "question" in bad.content[0].text
        extra = await s.call_tool("calc", {"questoin": "2 + 3?"})
        assert extra.is_error and "questoin" in extra.content[0].text
        assert (await asyncio.wait_for(slow, 10)).structured_content["status"] == "done"
    assert [r.metadata for r in server.app[STATE].runs.runs.values()] == [{"via": "mcp"}]  # refused calls made none


async def test_a_missing_or_wrong_key_gets_401_and_a_session_stays_with_its_key(server):
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
            r = await http.post(mcp_url(server), json=hello, headers={**accept, **headers})
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
        async with http.stream("POST", mcp_url(server), json=hello,
                               headers={**accept, "Authorization": f"Bearer {KEY}"}) as opened:
            assert opened.status_code == 200
            session_id = opened.headers["mcp-session-id"]
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        r = await http.post(mcp_url(server), json=ping, headers={**accept, "Authorization": f"Bearer {OTHER_KEY}",
                                                                  "Mcp-Session-Id": session_id})
        assert r.status_code == 404  # another key cannot use the session: as if it did not exist


async def test_a_server_that_stops_answers_the_call_in_flight_and_keeps_its_run(tmp_path):
    async with served(tmp_path) as srv:
        state = srv.app[STATE]
        async with session(srv) as s:
            call = asyncio.ensure_future(s.call_tool("calc", {"delay": 60.0}))
            for _ in range(1000):
                if state.runs.running:
                    break
                await asyncio.sleep(0.01)
            (run,) = state.runs.runs.values()
            state.stopping = True  # what SIGTERM does: no new work, the grace, then the app's shutdown
            await state.runs.shutdown(0.05)
            closing = asyncio.ensure_future(srv.close())
            result = await asyncio.wait_for(call, 10)
            await closing
        assert run.status == "running" and state.runtime.store.get_run(run.run_id).status == "running"  # resumable
    assert result.is_error and f"run '{run.run_id}'" in result.content[0].text
    assert "resumes when the server starts again" in result.content[0].text


async def test_an_allowed_browser_origin_may_send_mcp_headers_and_read_the_session_id(tmp_path):
    origin = "http://localhost:5173"
    async with served(tmp_path, cors_origins=(origin,)) as srv, httpx2.AsyncClient() as http:
        r = await http.options(mcp_url(srv), headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == origin
        assert "Mcp-Session-Id" in r.headers["access-control-allow-headers"]
        assert "DELETE" in r.headers["access-control-allow-methods"]
        async with session(srv) as s:
            assert {t.name for t in (await s.list_tools()).tools} >= {"calc"}
        r = await http.post(mcp_url(srv), json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "page", "version": "1"}}},
            headers={"Origin": origin, "Authorization": f"Bearer {KEY}", "Accept": "application/json, text/event-stream"})
        assert r.status_code == 200 and r.headers["access-control-expose-headers"] == "Mcp-Session-Id"
        r = await http.post(mcp_url(srv), json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                            headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}",
                                     "Accept": "application/json, text/event-stream"})
        assert r.status_code == 403  # not an allowed origin: the SDK's DNS-rebinding check says no


def test_the_output_schema_follows_the_output_nodes():
    p = Program("trip", inputs={"city": str})
    plan = p.llm("plan", prompt="Plan a day in {city}", max_tokens=16,
                 output=JsonSchema({"type": "object", "properties": {"stops": {"type": "array", "items": {"type": "string"}}},
                                    "required": ["stops"]}))
    note = p.llm("note", prompt="One line on {plan}", max_tokens=8)
    p.output({"stops": plan["stops"], "note": note})
    assert output_schema(p.compile()) == {
        "type": "object", "required": ["stops", "note"],
        "properties": {"stops": {"type": "array", "items": {"type": "string"}}, "note": {"type": "string"}}}
