"""Parallel calls in one agent-loop turn on the runtime: each idempotent call's tool starts the
moment its own arguments close (before the next call's do, long before the turn ends), all run at
once, non-idempotent ones start at the turn's end; the next step gets the results in the order
the calls were made; a turn cut after its calls started cancels the running ones and keeps the
finished ones recorded; the result is the one the non-streamed path gives."""
from __future__ import annotations

import asyncio
import io
import json
import time

from rich.console import Console

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.node_report import render_node
from agentrt.runtime.store import SQLiteRunStore
from agentrt.tools import tool

EVENTS: list[str] = []


@tool(idempotent=True)
async def lookup(q: str, wait_s: float = 0.0) -> str:
    """Look something up."""
    EVENTS.append(f"lookup {q}")
    await asyncio.sleep(wait_s)
    return f"found {q}"


@tool(idempotent=True)
async def slow_lookup(q: str) -> str:
    """Look something up, slowly."""
    EVENTS.append(f"slow {q} started")
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        EVENTS.append(f"slow {q} cancelled")
        raise
    return "late"


@tool
async def send_mail(to: str) -> str:
    """Send a mail (not idempotent: never started early)."""
    EVENTS.append(f"mail {to}")
    return "sent"


WORDS = " ".join(["because"] * 20)  # after a call's arguments close the model still writes (~20 steps)


def call(name: str, **args) -> dict:
    return {"name": name, "arguments": args, "why": WORDS}


def turn(*calls) -> list[dict]:
    return list(calls)


def loop_program(*tools, max_steps: int = 2) -> Program:
    p = Program("agent", inputs={"q": str}, tools=list(tools))
    p.output(p.agent_loop("agent", prompt="{q}", tools=[t.name for t in tools], max_steps=max_steps, max_tokens=256,
                          parallel_calls=True, output="detail"))
    return p


def script(first_turn: list[dict]) -> dict:
    return {"agent#1.llm": first_turn, "agent#2.llm": "Both found."}


async def test_each_call_starts_at_its_own_arguments_and_results_come_back_in_order(scripted, span_reader):
    EVENTS.clear()
    # the first call is the slower one: it ends after the second, yet its result comes first
    backend = scripted(script(turn(call("lookup", q="a", wait_s=0.4), call("lookup", q="b"))), step_s=0.005)
    rt = Runtime(backend, tools=[lookup])
    seen: list[tuple[str, str]] = []
    rt.subscribe_events(lambda ev: seen.append((ev.type, ev.data.get("node"), ev.data.get("text", ""))))
    result = await rt.run(loop_program(lookup), {"q": "?"})
    assert result.status == "done", result.error
    assert result.output["tool_calls"] == [
        {"name": "lookup", "arguments": {"q": "a", "wait_s": 0.4}, "ok": True, "step": 1},
        {"name": "lookup", "arguments": {"q": "b"}, "ok": True, "step": 1}]
    # the first call's tool started before the text closing the second call's arguments was written
    text, first_started = "", None
    for kind, node, delta in seen:
        if kind == "node_started" and node == "agent#1.tool[0]":
            first_started = len(text)
        elif kind == "token" and node == "agent#1.llm":
            text += delta
    second_closed = json.dumps(turn(call("lookup", q="a", wait_s=0.4), call("lookup", q="b"))).rindex('"b"}') + 4
    assert first_started is not None and first_started < second_closed
    trace = span_reader(rt)
    spans = trace.node_spans()
    llm_end = spans["agent#1.llm"]["end"]
    first, second = (spans[f"agent#1.tool[{i}]"]["attributes"] for i in (0, 1))
    assert first["agentrt.started_early"] and second["agentrt.started_early"]
    assert trace.started("agent#1.tool[0]") < trace.started("agent#1.tool[1]") < llm_end - 0.05
    assert first["agentrt.started_before_caller_end_s"] > second["agentrt.started_before_caller_end_s"] > 0.05
    shown = render_node(Console(file=io.StringIO()), trace.records, "agent#1.tool[0]")
    assert shown["started_before_caller_end_s"] == first["agentrt.started_before_caller_end_s"]
    assert render_node(Console(file=io.StringIO()), trace.records, "agent#1.llm")["tool_calls"] == ["lookup", "lookup"]
    at = spans["agent#1.llm"]["attributes"]["agentrt.calls_streamed_at_chars"]
    assert len(at) == 2 and at[0] < at[1] and spans["agent#1.llm"]["attributes"]["agentrt.call_streamed_at_chars"] == at[0]
    # both ran at once: the second ended while the first (started earlier, slower) still ran
    assert spans["agent#1.tool[1]"]["end"] < spans["agent#1.tool[0]"]["end"]
    messages = backend.requests[-1].messages
    assert [c["function"]["name"] for c in messages[-3]["tool_calls"]] == ["lookup", "lookup"]
    assert [m["content"] for m in messages[-2:]] == ["found a", "found b"]


async def test_a_non_idempotent_call_waits_for_the_turn_to_end(scripted, span_reader):
    EVENTS.clear()
    backend = scripted(script(turn(call("send_mail", to="x"), call("lookup", q="y"))), step_s=0.005)
    rt = Runtime(backend, tools=[lookup, send_mail])
    result = await rt.run(loop_program(lookup, send_mail), {"q": "?"})
    assert result.status == "done", result.error
    trace = span_reader(rt)
    spans = trace.node_spans()
    assert trace.started("agent#1.tool[0]") >= spans["agent#1.llm"]["end"]
    assert "agentrt.started_early" not in spans["agent#1.tool[0]"]["attributes"]
    assert trace.started("agent#1.tool[1]") < spans["agent#1.llm"]["end"]
    assert EVENTS == ["lookup y", "mail x"]


async def test_a_turn_cut_after_its_calls_started_cancels_the_running_and_records_the_finished(scripted, span_reader,
                                                                                               tmp_path):
    """Both calls' arguments closed and their tools started; max_tokens then cuts the turn: the
    step fails, the running call is cancelled, the finished one stays finished (trace and store)."""
    EVENTS.clear()
    first = turn(call("lookup", q="a"), call("slow_lookup", q="b"))
    words = json.dumps(first).split()
    cut = next(i for i in range(len(words)) if '"b"}' in words[i]) + 4  # a few words past the second's arguments
    store = SQLiteRunStore(tmp_path / "runs.db")
    backend = scripted(script(first), step_s=0.005)
    rt = Runtime(backend, tools=[lookup, slow_lookup], max_tokens=cut, store=store)
    t0 = time.monotonic()
    result = await rt.run(loop_program(lookup, slow_lookup), {"q": "?"}, run_id="r1")
    assert time.monotonic() - t0 < 2
    recorded = store.recorded("r1").outcomes
    store.close()
    assert result.status == "failed" and result.failed_node == "agent#1.llm"
    assert sorted(EVENTS) == ["lookup a", "slow b cancelled", "slow b started"]
    assert recorded["agent#1.tool[0]"].ok and recorded["agent#1.tool[0]"].value == "found a"
    assert "agent#1.tool[1]" not in recorded
    spans = span_reader(rt).node_spans()
    assert spans["agent#1.tool[0]"]["status"] == "ok"
    assert spans["agent#1.tool[1]"]["status"] == "cancelled"
    assert [r.node.node for r in backend.requests] == ["agent#1.llm"]


async def test_the_result_is_the_one_the_non_streamed_path_gives(scripted):
    replies = script(turn(call("lookup", q="a", wait_s=0.02), call("send_mail", to="b"), call("lookup", q="c")))
    outcomes = []
    for stream in (True, False):
        backend = scripted(replies, step_s=0.002)
        rt = Runtime(backend, tools=[lookup, send_mail], stream_outputs=stream)
        result = await rt.run(loop_program(lookup, send_mail), {"q": "?"})
        assert result.status == "done", result.error
        outcomes.append((result.output, [r.messages for r in backend.requests]))
    assert outcomes[0] == outcomes[1]
    assert len(outcomes[0][0]["tool_calls"]) == 3


@tool(idempotent=True)
def weather(city: str) -> str:
    """Weather for a city."""
    return f"4 C, rain in {city}"


async def test_on_the_embedded_engine_each_call_of_the_list_starts_from_the_streamed_text(engine, span_reader):
    """The engine writes the list of calls under the parallel grammar; every call's tool starts
    from the streamed text, inside the turn, with the arguments the parsed turn has."""
    from agentrt.runtime.engine_backend import EngineBackend

    backend = EngineBackend(engine)
    p = Program("weather", inputs={"q": str}, tools=[weather])
    p.output(p.agent_loop("agent", prompt="{q}", tools=["weather"], max_steps=2, max_tokens=64,
                          tool_choice="required_first", parallel_calls=True, output="detail"))
    rt = Runtime(backend, tools=[weather])
    try:
        result = await rt.run(p, {"q": "What is the weather in Oslo and in Paris?"})
        trace = span_reader(rt)
        await rt.aclose()
    finally:
        backend.close()
    assert result.status == "done", result.error
    made = result.values["agent#1.llm"]["calls"]
    assert made and [c["arguments"] for c in made] == [c["arguments"] for c in result.output["tool_calls"]]
    spans = trace.node_spans()
    llm = spans["agent#1.llm"]["attributes"]
    assert len(llm["agentrt.calls_streamed_at_chars"]) == len(made)
    for i, c in enumerate(made):
        tool_span = spans[f"agent#1.tool[{i}]"]
        assert tool_span["attributes"]["agentrt.started_early"] is True
        assert trace.started(f"agent#1.tool[{i}]") <= spans["agent#1.llm"]["end"]
        assert tool_span["attributes"]["gen_ai.tool.call.arguments"] == c["arguments"]
