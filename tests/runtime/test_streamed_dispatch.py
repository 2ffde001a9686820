"""Streamed dispatch: while an LLM node still generates JSON, idempotent tools that read only its
final members start, and a fan-out over its list grows branches per final item; non-idempotent
tools wait for the node's end; the final output must agree with what was streamed."""
from __future__ import annotations

import time

import pytest

from agentrt.dag import JsonSchema, Program
from agentrt.errors import ProgramRunError
from agentrt.runtime import Runtime
from agentrt.tools import tool

CALLS: list[tuple[str, float]] = []


@tool(idempotent=True)
async def weather(city: str) -> str:
    """Weather in a city."""
    CALLS.append(("weather", time.monotonic()))
    return f"sunny in {city}"


@tool
async def book(city: str, days: int) -> str:
    """Book a stay (not idempotent: never started early)."""
    CALLS.append(("book", time.monotonic()))
    return f"booked {days} days in {city}"


@tool(idempotent=True)
async def search(query: str) -> str:
    """Search."""
    CALLS.append((f"search {query}", time.monotonic()))
    return f"found {query}"


PLAN = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                          "notes": {"type": "string"}}, "required": ["city", "days", "notes"]}


def trip_program():
    p = Program("trip", inputs={"request": str}, tools=[weather, book])
    plan = p.llm("plan", prompt="Plan {request}", output=JsonSchema(PLAN))
    w = p.tool("weather", "weather", args={"city": plan["city"]})
    b = p.tool("book", "book", args={"city": plan["city"], "days": plan["days"]})
    p.output(p.llm("summary", prompt="{weather} {book}"))
    return p, w, b


def node_spans(rt: Runtime) -> dict[str, dict]:
    return {r["attributes"]["agentrt.node"]: r for r in rt.trace.records()
            if r["type"] == "span" and r["parent_id"] is None}


def started(rt: Runtime, node: str) -> float:
    """When the node left its waiting phase (its span opens when the node appears)."""
    span = node_spans(rt)[node]["span_id"]
    return min(r["start"] for r in rt.trace.records()
               if r["type"] == "span" and r["parent_id"] == span and r["attributes"].get("agentrt.phase") != "waiting")


# A long "notes" member keeps the plan generating (one word per engine step) after city and days.
PLAN_REPLY = {"city": "Oslo", "days": 3, "notes": " ".join(["word"] * 40)}


@pytest.mark.parametrize("stream", [True, False])
async def test_an_idempotent_tool_starts_on_final_members_and_others_wait(scripted, stream):
    CALLS.clear()
    p, _, _ = trip_program()
    backend = scripted({"plan": PLAN_REPLY, "summary": "ok"}, step_s=0.005)
    rt = Runtime(backend, tools=[weather, book], stream_outputs=stream)
    result = await rt.run(p, {"request": "a trip"})
    assert result.status == "done", result.error
    spans = node_spans(rt)
    plan_end = spans["plan"]["end"]
    weather_start, book_start = started(rt, "weather"), started(rt, "book")
    if stream:
        assert weather_start < plan_end - 0.05  # ~40 steps of notes were still to come
        assert spans["weather"]["attributes"]["agentrt.started_early"] is True
        assert spans["weather"]["attributes"]["agentrt.waited_on"] == "plan"
        # and is reported when it ends, not when its source does: the run's drive loop hears of
        # tasks started while it waited
        assert spans["weather"]["end"] < plan_end - 0.05
    else:
        assert weather_start >= plan_end
    assert book_start >= plan_end  # not idempotent: only once plan has ended
    assert "agentrt.started_early" not in spans["book"]["attributes"]
    assert backend.requests[-1].messages[-1]["content"] == "sunny in Oslo booked 3 days in Oslo"


async def test_fan_out_branches_start_per_final_item(scripted, research_program):
    CALLS.clear()
    p = research_program(search)
    items = ["first query " + "x " * 20, "second query " + "y " * 20, "third"]
    backend = scripted({"split": items, "answers*": "summary", "synthesis": "done"}, step_s=0.005)
    rt = Runtime(backend, tools=[search])
    result = await rt.run(p, {"question": "bees"})
    assert result.status == "done", result.error
    spans = node_spans(rt)
    split_end = spans["split"]["end"]
    assert started(rt, "answers[0].search") < split_end - 0.05  # ~40 more steps of items 1 and 2
    assert started(rt, "answers[1].search") < split_end
    assert started(rt, "answers[0].search") < started(rt, "answers[1].search")
    # synthesis still sees every branch, in item order
    assert backend.requests[-1].messages[-1]["content"].count("summary") == 3
    assert [c for c, _ in CALLS] == [f"search {q}" for q in items]


def test_program_run_readiness_on_streamed_members():
    p, _, _ = trip_program()
    run = p.compile().start({"request": "x"})
    assert run.ready() == ["plan"]
    run.begin("plan")
    run.stream("plan", [])
    assert run.ready() == []
    run.stream("plan", [("city", "Oslo")])
    assert run.ready() == ["weather"] and run.is_early("weather")  # book also needs days
    assert run.known["plan"] == {"city": "Oslo"} and "plan" not in run.values
    run.stream("plan", [("days", 2)])
    assert run.ready() == ["weather", "book"]
    run.begin("weather")
    run.complete("weather", "sunny")
    run.complete("plan", {"city": "Oslo", "days": 2, "notes": "n"})
    assert run.ready() == ["book"] and not run.is_early("book")


def test_final_output_must_agree_with_streamed_members():
    p, _, _ = trip_program()
    run = p.compile().start({"request": "x"})
    run.begin("plan")
    run.stream("plan", [("city", "Oslo")])
    with pytest.raises(ProgramRunError, match="differs from the members it streamed"):
        run.complete("plan", {"city": "Rome", "days": 2, "notes": "n"})
    assert run.status == "failed"


def test_only_running_llm_nodes_stream():
    p, _, _ = trip_program()
    run = p.compile().start({"request": "x"})
    with pytest.raises(ProgramRunError, match="running LLM node"):
        run.stream("plan", [("city", "Oslo")])


async def test_a_failed_llm_after_an_early_start_fails_the_run(scripted):
    """The plan streams city, then its output is cut (max_tokens): the run fails naming plan,
    though weather (idempotent) had started on the streamed city."""
    CALLS.clear()
    p, _, _ = trip_program()
    backend = scripted({"plan": PLAN_REPLY, "summary": "ok"}, step_s=0.005)
    rt = Runtime(backend, tools=[weather, book], max_tokens=10)
    result = await rt.run(p, {"request": "a trip"})
    assert result.status == "failed" and result.failed_node == "plan"
    assert ("weather" in [c for c, _ in CALLS]) and "book" not in [c for c, _ in CALLS]
