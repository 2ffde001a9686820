"""Node executors tell what happens as typed node events; the trace's content, the run store (a
no-op stand-in without one) and the live feed are their subscribers."""
from __future__ import annotations

import dataclasses

import pytest

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.node_events import (NodeDispatched, NodeFinished, NodeOutcome, NodePhase, NodeStarted,
                                         NodeValue, RunFinished, RunStarted, RunSubmitted, ToolAttempted,
                                         ToolReturned)
from agentrt.runtime.store import SQLiteRunStore
from agentrt.runtime.subscribers import LiveFeed, StoreRecorder, TraceRecorder
from agentrt.tools import tool


@tool
def weather(city: str) -> dict:
    """The weather in a city."""
    return {"city": city, "sky": "clear"}


def program() -> Program:
    p = Program("trip", inputs={"city": str}, tools=[weather])
    p.tool("forecast", "weather", args={"city": p.input("city")})
    p.output(p.llm("plan", prompt="Plan a day in {city}: {forecast}", max_tokens=8))
    return p


async def test_a_run_emits_typed_frozen_events_in_the_order_things_happen(scripted):
    seen = []
    async with Runtime(scripted({"plan": "Walk."}), tools=[weather]) as rt:
        rt.events.subscribe(seen.append)
        result = await rt.run(program(), {"city": "Lisbon"}, run_id="r")
    assert result.status == "done"
    kinds = [type(e) for e in seen]
    assert kinds[:2] == [RunSubmitted, RunStarted] and kinds[-1] is RunFinished
    tool_events = [type(e) for e in seen if getattr(e, "node", None) == "forecast"]
    assert tool_events[:3] == [NodeStarted, NodeDispatched, NodePhase]
    assert tool_events.index(ToolAttempted) < tool_events.index(ToolReturned) < tool_events.index(NodeValue) \
        < tool_events.index(NodeOutcome) < tool_events.index(NodeFinished)
    dispatched = next(e for e in seen if isinstance(e, NodeDispatched) and e.node == "forecast")
    assert dispatched.kind == "tool" and dispatched.args == {"city": "Lisbon"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        dispatched.kind = "llm"  # type: ignore[misc]


async def test_one_subscriber_per_concern_and_a_no_op_store_without_one(scripted, tmp_path):
    async with Runtime(scripted({"plan": "Walk."}), tools=[weather]) as bare:
        kinds = [type(s) for s in bare.events.subscribers]
        assert kinds == [TraceRecorder, LiveFeed] and not bare.env.records_seeds
        result = await bare.run(program(), {"city": "Lisbon"})
        assert result.status == "done"
        assert not bare.store.durable and bare.store.runs() == []  # a null store: nothing kept, nothing found
    store = SQLiteRunStore(tmp_path / "runs.db")
    async with Runtime(scripted({"plan": "Walk."}), tools=[weather], store=store) as rt:
        assert [type(s) for s in rt.events.subscribers] == [TraceRecorder, StoreRecorder, LiveFeed] and rt.store.durable
        assert rt.env.records_seeds and rt.env.backend is rt.backend and rt.env.clock is rt.trace
        await rt.run(program(), {"city": "Lisbon"}, run_id="r")
    recorded = store.recorded("r")
    assert set(recorded.outcomes) == {"forecast", "plan"} and store.get_run("r").status == "done"
    assert [a.status for a in store.tool_attempts("r")] == ["finished"]
