"""MCP tools in programs: tool nodes and agent loops call them like any tool (a scripted backend
for the plumbing; the embedded model for a tool call constrained by the server's input schema),
progress lands in the trace and the run's events, a failing MCP tool fails its run only."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.tools.mcp import mcp_tools

FIXTURE = str(Path(__file__).parent / "mcp_server_fixture.py")


@pytest.fixture(scope="module")
def fx():
    return mcp_tools("fx", command=[sys.executable, FIXTURE])


@pytest.fixture
async def scripted():
    made = []

    def make(replies):
        made.append(ScriptedBackend(replies, step_s=0.001))
        return made[-1]

    yield make
    for backend in made:
        await backend.aclose()


def spans(rt: Runtime) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rt.trace.records():
        if r["type"] == "span":
            out.setdefault(r["attributes"].get("agentrt.node"), []).append(r)
    return out


async def test_tool_nodes_call_mcp_tools_and_progress_reaches_the_trace(fx, scripted):
    p = Program("counts", inputs={"a": int}, tools=list(fx))
    total = p.tool("sum", "fx.add", args={"a": p.input("a"), "b": 2})
    counted = p.tool("count", "fx.slow", args={"steps": 3})
    p.output({"total": total["total"], "counted": counted["result"]})  # the output schema types the references
    rt = Runtime(scripted({}), tools=fx)
    events = []
    rt.subscribe_events(lambda ev: events.append(ev) if ev.type == "tool_progress" else None)
    try:
        result = await rt.run(p, {"a": 40})
    finally:
        await rt.tools.aclose()
    assert result.status == "done" and result.output == {"total": 42, "counted": "counted to 3"}
    assert [(e.data["node"], e.data["progress"], e.data["total"]) for e in events] == [
        ("count", 1, 3), ("count", 2, 3), ("count", 3, 3)]
    node, *phases = spans(rt)["count"]
    assert node["attributes"]["agentrt.tool.progress"] == {"progress": 3, "total": 3, "message": "step 3 of 3"}
    (running,) = [s for s in phases if s["attributes"]["agentrt.phase"] == "tool_running"]
    shown = [e for e in running["events"] if e["name"] == "tool_progress"]
    assert [e["attributes"]["agentrt.tool.progress_message"] for e in shown] == [
        "step 1 of 3", "step 2 of 3", "step 3 of 3"]


async def test_an_agent_loop_uses_mcp_tools_and_a_failing_one_fails_its_run_only(fx, scripted):
    p = Program("ask", inputs={"q": str}, tools=list(fx))
    p.output(p.agent_loop("agent", prompt="{q}", tools=["fx.lookup", "fx.fail"], max_steps=3, max_tokens=32))
    backend = scripted({"agent#1.llm": {"name": "fx.lookup", "arguments": {"key": "alpha"}},
                        "agent#2.llm": "alpha is first."})
    rt = Runtime(backend, tools=fx)
    bad = Program("bad", inputs={"why": str}, tools=list(fx))
    bad.output(bad.tool("refuse", "fx.fail", args={"reason": bad.input("why")}))
    try:
        good, failed = await asyncio.gather(rt.run(p, {"q": "What is alpha?"}), rt.run(bad, {"why": "closed"}))
    finally:
        await rt.tools.aclose()
    assert good.status == "done" and good.output == "alpha is first."
    step2 = backend.requests[1].messages
    assert any('"first"' in str(m.get("content")) for m in step2)  # the tool's result went back to the model
    tools_sent = backend.requests[0].response_format["tools"]
    assert [t["function"]["name"] for t in tools_sent] == ["fx.lookup", "fx.fail"]
    assert tools_sent[0]["function"]["parameters"]["properties"]["key"]["type"] == "string"
    assert failed.status == "failed" and failed.failed_node == "refuse"
    assert "MCP server 'fx' tool 'fail' failed" in failed.error and "refused: closed" in failed.error


@pytest.mark.slow
async def test_on_the_embedded_model_a_tool_call_is_constrained_by_the_mcp_input_schema(fx):
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig
    from agentrt.runtime.engine_backend import EngineBackend

    engine = AsyncEngine(LLMEngine(EngineConfig(spec=SpecConfig(drafter="template"))))
    backend = EngineBackend(engine)
    p = Program("sum", inputs={"q": str}, tools=list(fx))
    p.output(p.agent_loop("agent", prompt="{q}", tools=["fx.add"], max_steps=2, max_tokens=24,
                          tool_choice="required_first", on_max_steps="answer", output="detail"))
    rt = Runtime(backend, tools=fx)
    try:
        result = await rt.run(p, {"q": "What is 2 plus 3? Use the add tool."})
    finally:
        await rt.tools.aclose()
        backend.close()
        engine.close()
    assert result.status == "done", result.error
    (call,) = result.output["tool_calls"][:1]
    assert call["name"] == "fx.add"
    assert set(call["arguments"]) == {"a", "b"} and all(isinstance(v, int) for v in call["arguments"].values())
    tool_span = spans(rt)["agent#1.tool"][0]
    assert tool_span["status"] == "ok"  # the server ran it: the grammar kept the arguments valid
    assert tool_span["attributes"]["agentrt.tool.attempt_log"][0]["executor"] == "mcp"


@pytest.mark.parametrize("idempotent", [None, ["slow"]], ids=["by-annotations", "declared-idempotent"])
async def test_resume_runs_an_interrupted_mcp_tool_again_only_when_it_is_idempotent(fx, scripted, tmp_path, idempotent):
    from agentrt.runtime.store import SQLiteRunStore

    # as mcp_tools("fx", ..., idempotent=["slow"]) declares it (tested in test_mcp_stdio.py)
    tools = [t.bind("mcp", idempotent=True) if idempotent and t.mcp.tool in idempotent else t for t in fx]
    p = Program("durable", inputs={"n": int}, tools=tools)
    p.output(p.tool("count", "fx.slow", args={"steps": p.input("n")}))
    store = SQLiteRunStore(tmp_path / "runs.db")
    try:
        rt = Runtime(scripted({}), tools=tools, store=store)
        running = asyncio.Event()
        rt.subscribe_events(lambda ev: running.set() if ev.type == "tool_progress" else None)
        handle = rt.submit(p, {"n": 12}, run_id="r1")
        await asyncio.wait_for(running.wait(), 20)
        rt.interrupt("r1")  # as a crash would: the call was in flight
        await handle.wait()
        await rt.aclose()
        await rt.tools.aclose()
        assert store.recorded("r1").interrupted == {"count"}
        rt = Runtime(scripted({}), tools=tools, store=store)
        try:
            result = await rt.run(p, {"n": 12}, run_id="r1", resume=store.recorded("r1"))
        finally:
            await rt.tools.aclose()
    finally:
        store.close()
    if idempotent is None:  # fx.slow has no idempotentHint: it may or may not have run
        assert result.status == "failed" and "may or may not have run" in result.error and "fx.slow" in result.error
    else:
        assert result.status == "done" and result.output == {"result": "counted to 12"}
