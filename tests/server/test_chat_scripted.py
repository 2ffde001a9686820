"""Chat completions on a scripted engine: several tool calls in one turn, their streamed deltas,
n choices, the prefix of a stream, limits and CORS. (The same API against the real model and
the official openai client: test_openai_client.py.)"""
from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.server.app import create_app
from agentrt.server.config import Limits, ServerConfig

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}} for n in ("weather", "time")]
CALLS = [{"name": "weather", "arguments": {"city": "Oslo {north}"}}, {"name": "time", "arguments": {"city": "Rome"}}]


async def make_client(replies, **config) -> tuple[TestClient, ScriptedBackend]:
    backend = ScriptedBackend(lambda req: replies(req) if callable(replies) else replies, step_s=0.001)
    app = create_app(ServerConfig(access_log=False, **config), "m", {}, Runtime(backend))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, backend


def sse_data(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def test_several_tool_calls_in_one_turn_and_streamed():
    client, backend = await make_client(CALLS)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "weather and time?"}], "tools": TOOLS}
        r = await client.post("/v1/chat/completions", json=body)
        out = await r.json()
        assert r.status == 200, out
        msg = out["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
            [(c["name"], c["arguments"]) for c in CALLS]
        rf = backend.requests[-1].response_format
        assert rf["type"] == "tool_call" and rf["parallel"] and rf["allow_text"]

        r = await client.post("/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}})
        data = sse_data(await r.text())
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        calls: dict[int, dict] = {}
        for c in chunks:
            for tc in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
                entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                if tc.get("id"):
                    assert entry["id"] is None  # the id and name come once, first
                    entry.update(id=tc["id"], name=tc["function"]["name"])
                entry["arguments"] += tc["function"].get("arguments") or ""
        assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
            [(c["name"], c["arguments"]) for c in CALLS]
        finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        assert [f["choices"][0]["finish_reason"] for f in finals] == ["tool_calls"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    finally:
        await client.close()


async def test_tool_choice_mapping_and_text_answers():
    client, backend = await make_client("Just text.")
    try:
        base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        r = await client.post("/v1/chat/completions", json={**base, "tool_choice": "none"})
        assert (await r.json())["choices"][0]["message"]["content"] == "Just text."
        assert backend.requests[-1].response_format["tool_choice"] == "none"
        await client.post("/v1/chat/completions", json={**base, "tool_choice": "required", "parallel_tool_calls": False})
        rf = backend.requests[-1].response_format
        assert not rf["allow_text"] and not rf["parallel"]
        await client.post("/v1/chat/completions", json={**base, "tool_choice": {"type": "function", "function": {"name": "time"}}})
        assert [t["function"]["name"] for t in backend.requests[-1].response_format["tools"]] == ["time"]
        r = await client.post("/v1/chat/completions", json={**base, "tool_choice": {"type": "function", "function": {"name": "x"}}})
        assert r.status == 400 and "not among the tools" in (await r.json())["error"]["message"]
        r = await client.post("/v1/chat/completions", json={**base, "n": 3})
        assert [c["index"] for c in (await r.json())["choices"]] == [0, 1, 2]
        r = await client.post("/v1/chat/completions", json={**base, "stream": True})
        text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                       for d in sse_data(await r.text())[:-1])
        assert text.strip() == "Just text."
    finally:
        await client.close()


async def test_limits_name_themselves():
    limits = Limits(max_messages=2, max_tool_schema_bytes=200, max_n=2, max_tokens=50, max_inflight_chats=1)
    client, _ = await make_client("ok", limits=limits)
    try:
        msg = [{"role": "user", "content": "hi"}]
        cases = [({"messages": msg * 3}, "max_messages=2"), ({"messages": msg, "tools": TOOLS}, "max_tool_schema_bytes=200"),
                 ({"messages": msg, "n": 3}, "max_n=2"), ({"messages": msg, "max_tokens": 51}, "max_tokens=50"),
                 ({"messages": msg, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
                 ({"messages": msg, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
                 ({"messages": [{"role": "assistant", "content": None}]}, "needs content")]
        for body, needle in cases:
            r = await client.post("/v1/chat/completions", json={"model": "m", **body})
            assert r.status == 400 and needle in (await r.json())["error"]["message"], (body, await r.text())
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": msg, "n": 2})
        assert r.status == 429 and "max_inflight_chats=1" in (await r.json())["error"]["message"]
    finally:
        await client.close()


async def test_cors_only_when_enabled():
    client, _ = await make_client("ok", cors_origins=("http://console.example",))
    try:
        r = await client.options("/v1/models", headers={"Origin": "http://console.example"})
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "http://console.example"
        r = await client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in r.headers
        r = await client.post("/v1/chat/completions", headers={"Origin": "http://console.example"},
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.headers["Access-Control-Allow-Origin"] == "http://console.example"  # an event stream too
        assert (await r.text()).rstrip().endswith("[DONE]")
        r = await client.post("/v1/chat/completions", headers={"Origin": "http://console.example"}, json={})
        assert r.status == 400 and r.headers["Access-Control-Allow-Origin"] == "http://console.example"  # errors too
    finally:
        await client.close()
    client, _ = await make_client("ok")
    try:
        r = await client.get("/v1/models", headers={"Origin": "http://console.example"})
        assert "Access-Control-Allow-Origin" not in r.headers
    finally:
        await client.close()


async def test_a_client_that_goes_away_aborts_its_generation():
    import asyncio

    import aiohttp

    client, backend = await make_client("word " * 3000)  # ~3000 steps of 1 ms
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "talk"}], "max_tokens": 4000}
        for stream in (False, True):
            with pytest.raises((asyncio.TimeoutError, aiohttp.ClientError)):
                async with client.session.post(client.make_url("/v1/chat/completions"), json={**body, "stream": stream},
                                               timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            for _ in range(100):
                if len(backend.aborted) == (2 if stream else 1):
                    break
                await asyncio.sleep(0.02)
            assert backend.aborted == ["completion"] * (2 if stream else 1)
    finally:
        await client.close()
