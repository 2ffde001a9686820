"""Prefill-ahead in the runtime: while a program waits on its tool, the next call's known prompt
start is computed, shown as its own phase, counted, and reused by the call, whose tokens do not
change."""
from __future__ import annotations

import asyncio

import pytest

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.tools import tool

SYSTEM = "You are a travel agent. Use the weather report to plan one day outdoors. " * 4


@pytest.fixture
def tiny_async_engine(tiny_model_dir):
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine
    from agentrt.engine.loading.model_loader import load_model

    path = tiny_model_dir("smollm")
    loaded = load_model(str(path), "float32", progress=False)
    made = []

    def make() -> AsyncEngine:
        made.append(AsyncEngine(LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=8), loaded=loaded)))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def weather_program(pinned):
    @tool
    async def weather(city: str) -> str:
        """The weather report for a city."""
        await pinned()
        return f"{city}: sunny, 21 C, light wind"

    p = Program("trip", inputs={"city": str}, tools=[weather])
    report = p.tool("report", "weather", args={"city": p.input("city")})
    p.output(p.llm("plan", system=SYSTEM, prompt="Plan a day in {city}. Weather report: {report}. Be brief.",
                   max_tokens=8))
    return p, weather


async def _run(engine, ahead: bool):
    from agentrt.runtime import EngineBackend

    llm = engine.engine

    async def pinned():  # the tool returns once the engine holds the prompt start (or at once without it)
        for _ in range(500 if ahead else 0):
            if llm.blocks.prefix.num_pinned():
                return
            await asyncio.sleep(0.01)

    program, weather = weather_program(pinned)
    backend = EngineBackend(engine)
    rt = Runtime(backend, tools=[weather], prefill_ahead=ahead)
    try:
        result = await asyncio.wait_for(rt.run(program, {"city": "Oslo"}), 60)
    finally:
        await rt.aclose()
        backend.close()
    assert result.ok, result.error
    spans = [r for r in rt.trace.records() if r["type"] == "span"]
    plan = next(s for s in spans if s["parent_id"] is None and s["attributes"]["agentrt.node"] == "plan")
    phases = [s["name"] for s in spans if s["parent_id"] == plan["span_id"]]
    (program_record,) = [r for r in rt.trace.records() if r["type"] == "program"]
    return result.output, plan["attributes"], phases, program_record["service"]


async def test_the_next_calls_prompt_start_is_prefilled_during_the_tool(tiny_async_engine):
    out_on, attrs, phases, service = await _run(tiny_async_engine(), ahead=True)
    out_off, attrs_off, phases_off, service_off = await _run(tiny_async_engine(), ahead=False)
    assert out_on == out_off  # greedy: the same tokens
    computed = attrs["agentrt.prefill_ahead.tokens"]
    assert computed >= 64 and computed % 8 == 0
    # the tool returned once the blocks were pinned: the call may start before the ahead request's end is heard
    assert attrs["agentrt.prefill_ahead.outcome"] in ("prefilled", "interrupted")
    assert service["prefill_ahead_tokens"] == computed
    # the call took every block computed ahead from the cache, and fed only the rest
    assert attrs["gen_ai.usage.cache_read.input_tokens"] >= computed
    assert phases[:2] == ["waiting", "prefill_ahead"] and "decode" in phases
    assert "agentrt.prefill_ahead.tokens" not in attrs_off and "prefill_ahead" not in phases_off
    assert attrs_off["gen_ai.usage.cache_read.input_tokens"] == 0 and service_off["prefill_ahead_tokens"] == 0


async def test_a_tool_that_returns_while_another_runs_extends_the_prompt_start(tiny_async_engine, tmp_path, monkeypatch):
    # plan waits on two tools; `first_report` returns at once, `second_report` only once the prompt start
    # computed ahead covers the first's (long) result: the ahead request grows with what is known
    from agentrt.runtime import EngineBackend

    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))  # no step-cost fit another run cached
    engine = tiny_async_engine()
    llm = engine.engine
    first_text = "sunny, 21 C, light wind from the west, clear evening, " * 6
    covered = len(llm.loaded.tokenizer.encode(SYSTEM + first_text)) - llm.blocks.block_size
    runtime: list[Runtime] = []

    @tool
    async def first_report(city: str) -> str:
        """The first report."""
        return first_text

    @tool
    async def second_report(city: str) -> str:
        """The second report, once plan's prompt start is computed past the first's."""
        for _ in range(500):
            (rs,) = runtime[0].runs.values()
            if rs.nodes["plan"].attributes.get("agentrt.prefill_ahead.tokens", 0) >= covered:
                break
            await asyncio.sleep(0.01)
        return "dry"

    p = Program("two", inputs={"city": str}, tools=[first_report, second_report])
    a = p.tool("a", "first_report", args={"city": p.input("city")})
    b = p.tool("b", "second_report", args={"city": p.input("city")})
    p.output(p.llm("plan", system=SYSTEM, prompt="In {city}: {a}. Then: {b}. Be brief.", max_tokens=4))
    backend = EngineBackend(engine)
    rt = Runtime(backend, tools=[first_report, second_report], prefill_ahead=True)
    runtime.append(rt)
    try:
        result = await asyncio.wait_for(rt.run(p.compile(), {"city": "Oslo"}), 60)
    finally:
        await rt.aclose()
        backend.close()
    assert result.ok, result.error
    spans = [r for r in rt.trace.records() if r["type"] == "span"]
    attrs = next(s for s in spans if s["parent_id"] is None and s["attributes"]["agentrt.node"] == "plan")["attributes"]
    assert attrs["agentrt.prefill_ahead.tokens"] >= covered
    assert attrs["gen_ai.usage.cache_read.input_tokens"] >= covered
