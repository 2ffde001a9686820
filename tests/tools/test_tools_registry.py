"""ToolRegistry: lookup, validation before execution, size limits, output checks, results."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from agentrt.tools import (
    RemoteValue,
    Tool,
    ToolDefinitionError,
    ToolRegistry,
    UnknownToolError,
    tool,
)

calls: list[dict] = []


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    calls.append({"a": a, "b": b})
    return a + b


@tool
def liar(n: int) -> int:
    """Declares int, returns a string."""
    return "not a number"  # type: ignore[return-value]


class Point(BaseModel):
    x: float
    y: float


@tool
def midpoint(p: Point, q: Point) -> Point:
    """Midpoint of two points."""
    return Point(x=(p.x + q.x) / 2, y=(p.y + q.y) / 2)


@pytest.fixture(autouse=True)
def _clear_calls():
    calls.clear()


async def test_call_returns_value_and_timings():
    registry = ToolRegistry([add])
    result = await registry.call("add", {"a": 2, "b": 3})
    assert result.ok and result.value == 5 and result.error is None
    assert result.tool == "add" and len(result.call_id) == 32
    (attempt,) = result.attempts
    assert attempt.ok and attempt.index == 1 and attempt.executor == "inprocess"
    assert result.queued <= result.started == attempt.started <= attempt.finished <= result.finished
    assert result.content() == "5"
    assert result.unwrap() == 5


async def test_pydantic_values_are_converted_both_ways():
    registry = ToolRegistry([midpoint])
    result = await registry.call("midpoint", {"p": {"x": 0, "y": 0}, "q": {"x": 2, "y": 4}})
    assert result.value == {"x": 1.0, "y": 2.0}  # a Point on the way out, JSON in the result
    assert json.loads(result.content()) == {"x": 1.0, "y": 2.0}


async def test_unknown_tool_lists_known_tools():
    registry = ToolRegistry([add, midpoint])
    with pytest.raises(UnknownToolError, match=r"unknown tool 'sub' \(known tools: add, midpoint\)"):
        registry.get("sub")
    result = await registry.call("sub", {})
    assert not result.ok and result.error.kind == "unknown_tool" and result.attempts == ()
    with pytest.raises(UnknownToolError):
        result.unwrap()


async def test_invalid_arguments_do_not_run_the_tool():
    registry = ToolRegistry([add])
    result = await registry.call("add", {"a": "two"})
    assert result.error.kind == "invalid_arguments"
    assert "argument 'a': 'two' is not of type 'integer'" in result.error.message
    assert calls == [] and result.attempts == () and result.started is None
    result = await registry.call("add", '{"a": 1, "c": 2}')
    assert "argument 'c'" in result.error.message and calls == []
    assert json.loads(result.content()) == {"error": "invalid_arguments", "message": result.error.message}


async def test_payload_size_limits():
    registry = ToolRegistry([add, tool(lambda n: "x" * n, name="big", description="n bytes")],
                            max_args_bytes=64, max_result_bytes=100)
    result = await registry.call("add", {"a": 1, "b": 1, **{}}, call_id="c1")
    assert result.ok and result.call_id == "c1"
    too_long = await registry.call("add", json.dumps({"a": 1, "b": int("9" * 80)}))
    assert too_long.error.kind == "payload_too_large" and "arguments (92 bytes)" in too_long.error.message
    assert len(calls) == 1  # only the first call ran
    big = await registry.call("big", {"n": 500})
    assert big.error.kind == "payload_too_large" and "the result (502 bytes) is over the limit of 100 bytes" in big.error.message


async def test_output_schema_is_checked():
    registry = ToolRegistry([liar])
    result = await registry.call("liar", {"n": 1})
    assert result.error.kind == "invalid_output"
    assert "liar" in result.error.message and "'not a number' is not of type 'integer'" in result.error.message


async def test_registration_rules():
    registry = ToolRegistry()
    registry.register(add)
    with pytest.raises(ToolDefinitionError, match="'add' is already registered"):
        registry.register(add)
    registry.register(add, replace=True)

    def plain(text: str) -> str:
        """Upper-case text."""
        return text.upper()

    t = registry.register(plain)  # plain typed functions are made tools
    assert isinstance(t, Tool) and "plain" in registry and len(registry) == 2
    assert registry.openai_schemas() == [add.openai_schema(), t.openai_schema()]
    assert (await registry.call("plain", {"text": "hi"})).value == "HI"
    registry.unregister("plain")
    assert registry.names() == ["add"]


async def test_custom_executor_and_missing_executor():
    class Recorder:
        def __init__(self):
            self.seen = []

        async def execute(self, tool, args, *, timeout):
            self.seen.append((tool.name, args, timeout))
            return RemoteValue(args["a"] * 10, worker="rec-1", started=1.0, finished=2.0)

    rec = Recorder()
    registry = ToolRegistry(executors={"rec": rec})
    registry.register(add, executor="rec")
    result = await registry.call("add", {"a": 4}, timeout_s=7)
    assert result.value == 40 and rec.seen == [("add", {"a": 4}, 7)] and calls == []
    assert (result.attempts[0].worker, result.attempts[0].remote_started) == ("rec-1", 1.0)
    # No broker configured: a tool bound to "mqtt" that has its Python function runs here...
    registry.register(add.bind("mqtt", name="remote_add"))
    embedded = await registry.call("remote_add", {"a": 1})
    assert embedded.value == 2 and embedded.attempts[0].executor == "inprocess"
    # ...one known only by its declaration cannot run anywhere.
    registry.register(Tool.from_declaration(add.declaration() | {"name": "decl_only"}, executor="mqtt"))
    missing = await registry.call("decl_only", {"a": 1})
    assert missing.error.kind == "no_executor" and "mqtt" in missing.error.message
    with pytest.raises(ToolDefinitionError, match="no async execute"):
        registry.add_executor("bad", object())  # type: ignore[arg-type]
