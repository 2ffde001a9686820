"""Calls the model makes itself start as their arguments close: a ToolCall node's call (and an
agent loop step's) starts its idempotent tool while the node still writes the rest of its
output; non-idempotent tools wait for the node's end; a node that then fails, or a run that is
cancelled, cancels the early call; the output must be the call that started."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from agentrt.dag import Program, ToolCall
from agentrt.dag.streamed_calls import StreamedCalls
from agentrt.errors import ProgramRunError
from agentrt.runtime import Runtime
from agentrt.runtime.store import SQLiteRunStore
from agentrt.tools import tool

EVENTS: list[tuple[str, float]] = []


@tool(idempotent=True)
async def lookup(q: str) -> str:
    """Look something up."""
    EVENTS.append((f"lookup {q}", time.monotonic()))
    return f"found {q}"


@tool(idempotent=True)
async def slow_lookup(q: str) -> str:
    """Look something up, slowly."""
    EVENTS.append(("slow started", time.monotonic()))
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        EVENTS.append(("slow cancelled", time.monotonic()))
        raise
    return "late"


@tool
async def send_mail(q: str) -> str:
    """Send a mail (not idempotent: never started early)."""
    EVENTS.append(("send_mail", time.monotonic()))
    return "sent"


# After the arguments close the model still writes (a trailing member: ~30 engine steps).
TAIL = {"why": " ".join(["because"] * 30)}


def call(name: str, **args) -> dict:
    return {"name": name, "arguments": args, **TAIL}


def pick_program(tool_fn) -> Program:
    p = Program("pick", inputs={"q": str}, tools=[tool_fn])
    pick = p.llm("pick", prompt="{q}", output=ToolCall([tool_fn.name]))
    p.output(p.tool("run", tool_fn.name, args=pick))
    return p


def loop_program(tool_fn, max_steps: int = 3) -> Program:
    p = Program("agent", inputs={"q": str}, tools=[tool_fn])
    p.output(p.agent_loop("agent", prompt="{q}", tools=[tool_fn.name], max_steps=max_steps, max_tokens=128))
    return p


async def test_a_tool_call_node_starts_its_tool_when_the_arguments_close(scripted, span_reader):
    EVENTS.clear()
    rt = Runtime(scripted({"pick": call("lookup", q="bees")}, step_s=0.005), tools=[lookup])
    result = await rt.run(pick_program(lookup), {"q": "?"})
    assert result.status == "done", result.error
    assert result.output == "found bees"
    trace = span_reader(rt)
    spans = trace.node_spans()
    # the tool's span starts (and here ends) ~30 steps before the call node's ends
    assert trace.started("run") < spans["pick"]["end"] - 0.08
    assert spans["run"]["end"] < spans["pick"]["end"]
    assert spans["run"]["attributes"]["agentrt.started_early"] is True
    assert spans["run"]["attributes"]["agentrt.waited_on"] == "pick"
    assert spans["pick"]["attributes"]["agentrt.call_streamed_at_chars"] == \
        len(json.dumps({"name": "lookup", "arguments": {"q": "bees"}})) - 1  # at the arguments' "}"


async def test_an_agent_loop_step_starts_its_tool_before_the_step_ends(scripted, span_reader):
    EVENTS.clear()
    backend = scripted({"agent#1.llm": call("lookup", q="hives"), "agent#2.llm": "Bees live in hives."}, step_s=0.005)
    rt = Runtime(backend, tools=[lookup])
    result = await rt.run(loop_program(lookup), {"q": "where?"})
    assert result.status == "done", result.error
    assert result.output == "Bees live in hives."
    trace = span_reader(rt)
    spans = trace.node_spans()
    assert trace.started("agent#1.tool") < spans["agent#1.llm"]["end"] - 0.08
    assert spans["agent#1.tool"]["attributes"]["agentrt.started_early"] is True
    # the tool ended first, yet the next step waited for the step it continues
    assert spans["agent#1.tool"]["end"] < spans["agent#1.llm"]["end"] <= trace.started("agent#2.llm")
    assert "found hives" in backend.requests[-1].messages[-1]["content"]


async def test_a_non_idempotent_tool_waits_for_the_call_to_end(scripted, span_reader):
    EVENTS.clear()
    rt = Runtime(scripted({"agent#1.llm": call("send_mail", q="hi"), "agent#2.llm": "Sent."}, step_s=0.005),
                 tools=[send_mail])
    result = await rt.run(loop_program(send_mail), {"q": "mail"})
    assert result.status == "done", result.error
    trace = span_reader(rt)
    spans = trace.node_spans()
    assert trace.started("agent#1.tool") >= spans["agent#1.llm"]["end"]
    assert "agentrt.started_early" not in spans["agent#1.tool"]["attributes"]


async def test_a_call_cut_by_length_after_its_tool_started_cancels_the_tool(scripted, span_reader):
    """The arguments closed and the tool started; then max_tokens cut the output: the node fails
    (its output is not a call), and the early call is cancelled as a call of a failed run."""
    EVENTS.clear()
    rt = Runtime(scripted({"pick": call("slow_lookup", q="x")}, step_s=0.005), tools=[slow_lookup], max_tokens=12)
    t0 = time.monotonic()
    result = await rt.run(pick_program(slow_lookup), {"q": "?"})
    assert time.monotonic() - t0 < 2
    assert result.status == "failed" and result.failed_node == "pick"
    assert [e for e, _ in EVENTS] == ["slow started", "slow cancelled"]
    trace = span_reader(rt)
    spans = trace.node_spans()
    assert spans["run"]["status"] == "cancelled" and spans["run"]["attributes"]["agentrt.started_early"] is True


async def test_an_early_tool_that_finished_before_its_step_failed_stays_finished(scripted, span_reader, tmp_path):
    """In a loop the early tool ends first and the next step is added, waiting on the step that
    is still writing; that step is then cut: the run fails naming it, the tool stays a finished
    call (in the trace and the run store), the next step never runs."""
    EVENTS.clear()
    backend = scripted({"agent#1.llm": call("lookup", q="x"), "agent#2.llm": "never"}, step_s=0.005)
    store = SQLiteRunStore(tmp_path / "runs.db")
    rt = Runtime(backend, tools=[lookup], max_tokens=12, store=store)
    result = await rt.run(loop_program(lookup), {"q": "?"}, run_id="r1")
    recorded = store.recorded("r1").outcomes
    assert recorded["agent#1.tool"].ok and recorded["agent#1.tool"].value == "found x"
    assert store.get_run("r1").status == "failed"
    store.close()
    assert result.status == "failed" and result.failed_node == "agent#1.llm"
    # cut, the call reads as a text answer: not the call whose tool started
    assert "differs from the members it streamed (the call of 'lookup' it streamed" in result.error
    assert [e for e, _ in EVENTS] == ["lookup x"]
    spans = span_reader(rt).node_spans()
    assert spans["agent#1.tool"]["status"] == "ok" and spans["agent#1.tool"]["end"] < spans["agent#1.llm"]["end"]
    assert spans["agent#2.llm"]["status"] == "cancelled"
    assert [r.node.node for r in backend.requests] == ["agent#1.llm"]


async def test_cancelling_the_run_cancels_an_early_call(scripted):
    EVENTS.clear()
    rt = Runtime(scripted({"pick": call("slow_lookup", q="x")}, step_s=0.005), tools=[slow_lookup])
    handle = rt.submit(pick_program(slow_lookup), {"q": "?"})
    for _ in range(200):
        if EVENTS:
            break
        await asyncio.sleep(0.005)
    assert [e for e, _ in EVENTS] == ["slow started"]
    handle.cancel()
    result = await handle.wait()
    assert result.status == "cancelled"
    assert [e for e, _ in EVENTS] == ["slow started", "slow cancelled"]


def test_the_output_must_be_the_call_that_started():
    run = pick_program(lookup).compile().start({"q": "?"})
    run.begin("pick")
    assert run.stream_call("pick", {"name": "lookup", "arguments": {"q": "a"}})
    assert run.ready() == ["run"] and run.is_early("run")
    run.begin("run")
    with pytest.raises(ProgramRunError, match="differs from the members it streamed"):
        run.complete("pick", {"name": "lookup", "arguments": {"q": "b"}})
    assert run.status == "failed"


def test_a_call_the_node_may_not_make_is_not_streamed():
    run = pick_program(lookup).compile().start({"q": "?"})
    run.begin("pick")
    assert not run.stream_call("pick", {"name": "send_mail", "arguments": {"q": "a"}})
    assert run.ready() == []


def test_parallel_calls_each_close_at_their_own_arguments():
    calls = [{"name": "lookup", "arguments": {"q": "a " * 10}}, {"name": "lookup", "arguments": {"q": "b"}}]
    text = json.dumps(calls)
    scanner, got = StreamedCalls(), []
    for i, word in enumerate(text.split(" ")):
        got += [(index, c, i) for index, c in scanner.feed(word if i == 0 else " " + word)]
    assert scanner.kind == "list" and scanner.broken is None
    assert [(index, c) for index, c, _ in got] == list(enumerate(calls))
    assert got[0][2] < got[1][2]  # the first call was known words before the second
    assert scanner.closed_at[0] == text.index("}") + 1
    assert scanner.closed_at[1] == len(text) - 2


@pytest.mark.parametrize("text, why", [
    ('Sure: {"name": "a", "arguments": {}}', "not a call turn"),
    ('{"name": "a", "arguments": {"x": tru}}', "not valid JSON"),
    ('{"name": "a", "arguments": {"x": 1]}', "mismatched"),
])
def test_text_that_is_no_call_turn_stops_the_scan(text, why):
    scanner = StreamedCalls()
    assert scanner.feed(text) == [] and why in scanner.broken


def test_wrapped_calls_and_parameters_are_read():
    text = '<tool_call>\n{"name": "a", "parameters": {"x": 1}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "b"}'
    assert StreamedCalls().feed(text) == [(0, {"name": "a", "arguments": {"x": 1}}), (1, {"name": "b", "arguments": {}})]


@tool(idempotent=True)
def weather(city: str) -> str:
    """Weather for a city."""
    return f"4 C, rain in {city}"


async def test_on_the_embedded_engine_the_step_call_starts_its_tool_from_the_streamed_text(engine, span_reader):
    """The engine streams the call as the model writes it (the house format under the grammar):
    the step's tool starts from that text, with the arguments the parsed call has."""
    from agentrt.runtime.engine_backend import EngineBackend

    backend = EngineBackend(engine)
    p = Program("weather", inputs={"q": str}, tools=[weather])
    p.output(p.agent_loop("agent", prompt="{q}", tools=["weather"], max_steps=2, max_tokens=48,
                          tool_choice="required_first"))
    rt = Runtime(backend, tools=[weather])
    try:
        result = await rt.run(p, {"q": "Weather in Oslo?"})
        trace = span_reader(rt)
        await rt.aclose()
    finally:
        backend.close()
    assert result.status == "done", result.error
    spans = trace.node_spans()
    tool_span, llm_span = spans["agent#1.tool"], spans["agent#1.llm"]
    assert tool_span["attributes"]["agentrt.started_early"] is True
    assert trace.started("agent#1.tool") <= llm_span["end"]
    assert 0 < llm_span["attributes"]["agentrt.call_streamed_at_chars"] <= len(llm_span["attributes"]["agentrt.output.text"])
    assert tool_span["attributes"]["gen_ai.tool.call.arguments"] == result.values["agent#1.llm"]["arguments"]
