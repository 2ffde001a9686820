"""Agent loops in the runtime: tool_choice reaches the backend as the response format, how each
loop ended is on the span of the step that ended it (and in the summary and the report), and on
the embedded engine a required first step calls a tool where the model would answer in text,
with the prompt every step shares unchanged."""
from __future__ import annotations

import io

from rich.console import Console

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.summary import summarize
from agentrt.runtime.terminal import render_report
from agentrt.tools import tool


@tool
def get_weather(city: str) -> str:
    """Weather for a city."""
    return f"4 C, rain in {city}"


def loop_program(max_steps=3, **kw):
    p = Program("weather", inputs={"q": str}, tools=[get_weather])
    p.output(p.agent_loop("agent", prompt="{q}", tools=["get_weather"], max_steps=max_steps, max_tokens=32, **kw))
    return p


def node_spans(rt: Runtime) -> dict[str, dict]:
    return {r["attributes"]["agentrt.node"]: r for r in rt.trace.records() if r["type"] == "span" and r["parent_id"] is None}


def loop_attrs(span: dict) -> dict:
    return {k: v for k, v in span["attributes"].items() if k.startswith("agentrt.loop")}


def call_only_when_required(request):
    """A model that answers in text whenever the grammar would let it."""
    if request.response_format.get("tool_choice") == "required":
        return {"name": "get_weather", "arguments": {"city": "Oslo"}}
    return "Hello!"


async def test_required_first_calls_once_then_the_model_answers(scripted):
    backend = scripted(call_only_when_required)
    rt = Runtime(backend, tools=[get_weather])
    result = await rt.run(loop_program(3, tool_choice="required_first"), {"q": "Say hello."})
    assert result.status == "done" and result.output == "Hello!"
    assert [r.response_format.get("tool_choice") for r in backend.requests] == ["required", None]
    spans = node_spans(rt)
    assert loop_attrs(spans["agent#1.llm"]) == loop_attrs(spans["agent#1.tool"]) == {"agentrt.loop": "agent"}
    assert loop_attrs(spans["agent#2.llm"]) == {"agentrt.loop": "agent", "agentrt.loop.ended": "answered",
                                                "agentrt.loop.llm_steps": 2, "agentrt.loop.tool_steps": 1}
    assert spans["agent#1.llm"]["attributes"]["agentrt.output_spec"] == "tool call (required): get_weather"
    (run,) = summarize(rt.trace.records())["runs"]
    assert run["loops"] == [{"loop": "agent", "ended": "answered", "llm_steps": 2, "tool_steps": 1}]
    assert run["warnings"] == []  # step 1's value is its call, not text shaped like one
    buf = io.StringIO()
    render_report(Console(file=buf, width=140), summarize(rt.trace.records()), rt.trace.records())
    assert "agent loop agent: answered at step 2, after 1 tool call" in buf.getvalue()


async def test_a_loop_that_answers_at_once_says_so(scripted):
    rt = Runtime(scripted(call_only_when_required), tools=[get_weather])
    result = await rt.run(loop_program(3, output="detail"), {"q": "Say hello."})
    assert result.output == {"answer": "Hello!", "ended": "answered", "steps": 1, "tool_calls": []}
    buf = io.StringIO()
    render_report(Console(file=buf, width=140), summarize(rt.trace.records()), rt.trace.records())
    assert "agent loop agent: answered at step 1, without calling a tool" in buf.getvalue()


async def test_required_runs_to_the_last_step_and_detail_says_it_had_to_answer(scripted):
    backend = scripted(call_only_when_required)
    rt = Runtime(backend, tools=[get_weather])
    result = await rt.run(loop_program(3, tool_choice="required", output="detail"), {"q": "Say hello."})
    assert [r.response_format.get("tool_choice") for r in backend.requests] == ["required", "required", "none"]
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}, "ok": True}
    assert result.output == {"answer": "Hello!", "ended": "answered_at_max_steps", "steps": 3,
                             "tool_calls": [call, call]}
    assert loop_attrs(node_spans(rt)["agent#3.llm"])["agentrt.loop.ended"] == "answered_at_max_steps"


async def test_a_loop_failing_at_max_steps_records_why(scripted):
    rt = Runtime(scripted({"agent#*": {"name": "get_weather", "arguments": {"city": "Oslo"}}}), tools=[get_weather])
    result = await rt.run(loop_program(2, on_max_steps="error"), {"q": "Say hello."})
    assert result.status == "failed" and result.failed_node == "agent"
    assert loop_attrs(node_spans(rt)["agent#2.llm"]) == {
        "agentrt.loop": "agent", "agentrt.loop.ended": "exceeded_max_steps", "agentrt.loop.llm_steps": 2,
        "agentrt.loop.tool_steps": 1}


async def test_on_the_embedded_engine_a_required_first_step_calls_where_the_model_would_answer(engine):
    """SmolLM2 greeted with a weather tool at hand answers in text (auto). With
    tool_choice="required_first" the grammar makes step 1 a call, the tool runs and the last
    step answers. Step 1's prompt is the same under either choice (the tools and the text
    instruction stay described), and step 2 reuses its KV."""
    from agentrt.runtime.engine_backend import EngineBackend

    backend = EngineBackend(engine)
    question = {"q": "Say hello to Ana in one short sentence."}
    try:
        runs = {}
        for choice in ("auto", "required_first", "get_weather"):
            rt = Runtime(backend, tools=[get_weather])
            runs[choice] = (await rt.run(loop_program(2, tool_choice=choice, output="detail"), question), node_spans(rt))
            await rt.aclose()
    finally:
        backend.close()
    auto, auto_spans = runs["auto"]
    assert auto.output["ended"] == "answered" and auto.output["tool_calls"] == []  # the model's own choice
    block = engine.engine.blocks.block_size
    for choice in ("required_first", "get_weather"):
        result, spans = runs[choice]
        assert result.status == "done", result.error
        assert result.values["agent#1.llm"]["name"] == "get_weather"
        assert result.output["ended"] == "answered_at_max_steps" and result.output["tool_calls"][0]["ok"]
        first, second = (spans[f"agent#{k}.llm"]["attributes"] for k in (1, 2))
        assert first["gen_ai.usage.input_tokens"] == auto_spans["agent#1.llm"]["attributes"]["gen_ai.usage.input_tokens"]
        assert second["gen_ai.usage.cache_read.input_tokens"] >= \
            (first["gen_ai.usage.input_tokens"] // block - 1) * block
