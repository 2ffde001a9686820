"""Chat completions with tools in a model family's own call format: the streaming parser's deltas
per format, and the whole path (prompt, grammar, template drafter, parser, OpenAI response and
stream) through the server on the embedded SmolLM2 with its engine forced to Qwen's and to
Mistral's format (its own chat template has no tools, so the family's description of them goes
in the system message)."""
from __future__ import annotations

import json
from itertools import count

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrt.server.tool_stream import FamilyToolCallStream
from agentrt.structured.tool_formats import GEMMA3, LLAMA3, MISTRAL, QWEN

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CALLS = [{"name": "get_weather", "arguments": {"city": "Oslo {north}"}},
         {"name": "get_time", "arguments": {"city": "Rome \"old\""}}]


def collect(items) -> tuple[str, list[dict]]:
    """(content, calls) from FamilyToolCallStream items, checking OpenAI's order: per call, the id
    and name once, first, then argument fragments."""
    content, calls = "", {}
    for item in items:
        if isinstance(item, str):
            content += item
            continue
        index, cid, name, fragment = item
        if cid is not None:
            assert index not in calls and name
            calls[index] = {"id": cid, "name": name, "arguments": fragment}
        else:
            calls[index]["arguments"] += fragment
    return content, [{"name": calls[i]["name"], "arguments": json.loads(calls[i]["arguments"])} for i in sorted(calls)]


@pytest.mark.parametrize("syntax, before", [(QWEN, "Let me check both.\n"), (LLAMA3, ""), (GEMMA3, ""),
                                            (MISTRAL, ""), (MISTRAL, "Sure. ")])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_stream_deltas_per_format(syntax, before, piece):
    ids = count()
    stream = FamilyToolCallStream(syntax, lambda: f"call_{next(ids)}")
    text = before + syntax.calls_text(CALLS, parallel=True)
    items = [d for i in range(0, len(text), piece) for d in stream.feed(text[i:i + piece])] + stream.end()
    content, calls = collect(items)
    assert content == before and calls == CALLS


def test_stream_of_text_holds_back_only_what_could_open_a_call():
    stream = FamilyToolCallStream(QWEN, lambda: "call_0")
    assert stream.feed("a < b, and <tool") == ["a < b, and "]
    assert stream.feed("kit>") == ["<toolkit>"]
    assert stream.feed(" done <") == [" done "]
    assert stream.end() == ["<"]
    blank = FamilyToolCallStream(LLAMA3, lambda: "call_0")
    assert blank.feed("  ") == [] and blank.feed("It is") == ["  It is"]


@pytest.fixture(scope="module")
def loaded(smollm2_source):
    from agentrt.engine.loading.model_loader import load_model

    return load_model("smollm2-135m-instruct", "auto", progress=False)


async def served(loaded, tool_format: str) -> tuple[TestClient, object]:
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig
    from agentrt.runtime import EngineBackend
    from agentrt.runtime.runtime import Runtime
    from agentrt.server.app import create_app
    from agentrt.server.config import ServerConfig

    engine = LLMEngine(EngineConfig(tool_format=tool_format, spec=SpecConfig(drafter="template"),
                                    kv_cache_tokens=4096), loaded=loaded)
    assert engine.tool_format.name == tool_format
    app = create_app(ServerConfig(access_log=False, db=None), "m", {}, Runtime(EngineBackend(AsyncEngine(engine))))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, app


def sse_chunks(text: str) -> list[dict]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("tool_format", ["qwen", "mistral"])
async def test_chat_completion_with_tools_in_a_family_format(loaded, tool_format):
    client, app = await served(loaded, tool_format)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "What is the weather in 'Oslo'?"}],
                "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": 40, "temperature": 0}
        r = await client.post("/v1/chat/completions", json=body)
        out = await r.json()
        assert r.status == 200, out
        [choice] = out["choices"]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert call["function"]["name"] in ("get_weather", "get_time")
        args = json.loads(call["function"]["arguments"])
        assert isinstance(args["city"], str)
        # streamed: the same call, name first, then the arguments in fragments
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = sse_chunks(await r.text())
        deltas = [tc for c in chunks if c["choices"] for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
        assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == call["function"]["name"]
        assert json.loads("".join(d["function"].get("arguments") or "" for d in deltas)) == args
        assert not any(c["choices"][0]["delta"].get("content") for c in chunks[1:] if c["choices"])
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the call comes back in the next turn's history, with its result; the answer may be text
        follow = {**body, "tool_choice": "none", "messages": body["messages"] + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]}
        r = await client.post("/v1/chat/completions", json=follow)
        answer = await r.json()
        assert r.status == 200, answer
        assert answer["choices"][0]["message"]["content"] and not answer["choices"][0]["message"].get("tool_calls")
        # what the model wrote: the family's call syntax, after the family's description of the tools
        from agentrt.runtime import LLMRequest, NodeIdentity
        from agentrt.server.state import STATE

        rf = {"type": "tool_call", "tools": [WEATHER, TIME], "tool_choice": "required"}
        raw = await app[STATE].runtime.backend.complete(LLMRequest(tuple(body["messages"]), rf, 40, 0.0,
                                                                   NodeIdentity("r", "chat", "call")))
        opening = {"qwen": '<tool_call>\n{"name": "get_', "mistral": '[TOOL_CALLS][{"name": "get_'}[tool_format]
        assert raw.text.startswith(opening) and raw.parsed["name"] in ("get_weather", "get_time")
        assert {"qwen": "<tools>", "mistral": "[AVAILABLE_TOOLS]"}[tool_format] in raw.prompt.messages[0]["content"]
    finally:
        await client.close()


async def test_a_programs_tool_call_node_in_a_family_format(loaded):
    """A program's LLM node that calls a tool, on an engine writing Llama 3's format: the node's
    value and the tool call it feeds are what they are in the house format."""
    from agentrt.dag import Program, ToolCall
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine
    from agentrt.runtime import EngineBackend, Runtime
    from agentrt.tools import tool

    @tool
    def weather(city: str) -> dict:
        """The weather in a city."""
        return {"city": city, "sky": "clear"}

    p = Program("forecast", inputs={"request": str}, tools=[weather])
    pick = p.llm("pick", prompt="{request}", output=ToolCall(["weather"]), max_tokens=40)
    p.output(p.tool("run", "weather", args={"city": pick["arguments"]["city"]}))
    engine = AsyncEngine(LLMEngine(EngineConfig(tool_format="llama3", kv_cache_tokens=4096), loaded=loaded))
    rt = Runtime(EngineBackend(engine), tools=[weather])
    try:
        result = await rt.run(p, {"request": "Is it warm in 'Lisbon' today?"})
    finally:
        await rt.aclose()
        engine.close()
    assert result.status == "done", result.error
    assert result.output["sky"] == "clear" and isinstance(result.output["city"], str)
    [span] = [r for r in rt.trace.records() if r["type"] == "span" and r["attributes"].get("agentrt.node") == "pick"
              and r["parent_id"] is None]
    system = span["attributes"]["agentrt.prompt.messages"][0]["content"]
    assert system.startswith("Given the following functions") and '"parameters": dictionary' in system  # Llama 3's words


@pytest.mark.parametrize("syntax, parallel, text", [
    (GEMMA3, False, "[1] Pack light. [2] Bring water."),  # starts like a list, and the turn writes one call
    (QWEN, True, "<think>\nNo tool needed.\n</think>\n\nIt is sunny."),
    (QWEN, True, "a <b>bold</b> claim"),
    (LLAMA3, False, "Sunny, 21 C."),
])
def test_a_streamed_text_answer_comes_through_whole(syntax, parallel, text):
    stream = FamilyToolCallStream(syntax, lambda: "call_0", parallel)
    items = [d for ch in text for d in stream.feed(ch)] + stream.end()
    assert all(isinstance(d, str) for d in items) and "".join(items) == text


def test_a_conversation_with_tool_turns_renders_without_tools_too(loaded):
    """The last request of an agent loop may come without tools: the earlier calls and results
    are still put as the family's template takes them."""
    from agentrt.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(tool_format="gemma3", kv_cache_tokens=2048), loaded=loaded)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    text = engine.prepare(messages, SamplingParams(max_tokens=4)).prompt_text
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Oslo"}}<|im_end|>' in text
    assert "<|im_start|>user\n```tool_output\nSunny\n```<|im_end|>" in text
