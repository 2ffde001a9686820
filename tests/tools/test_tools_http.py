"""HTTP tools against a local aiohttp server with injected 5xx, 4xx, timeouts and slow answers."""
from __future__ import annotations

import asyncio
import collections

import pytest
from aiohttp import web

from agentrt.tools import ToolDefinitionError, ToolRegistry
from agentrt.tools.http import http_tool
from agentrt.tools.mosquitto import free_port

PARAMS = {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]}


@pytest.fixture
async def server():
    """Base URL of a local server; `hits` counts requests per path."""
    hits: collections.Counter = collections.Counter()
    flaky_left = {"n": 2}
    stopping = asyncio.Event()

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json(), "method": request.method})

    async def query(request: web.Request) -> web.Response:
        return web.json_response(dict(request.query))

    async def flaky(request: web.Request) -> web.Response:
        if flaky_left["n"] > 0:
            flaky_left["n"] -= 1
            return web.Response(status=503, text="overloaded, try later")
        return web.json_response({"ok": True})

    async def always_500(request: web.Request) -> web.Response:
        return web.Response(status=500, text="internal error")

    async def bad_request(request: web.Request) -> web.Response:
        return web.Response(status=422, text="q must not be empty")

    async def slow(request: web.Request) -> web.Response:
        try:  # the teardown's `stopping` ends a long delay early, so cleanup does not wait on it
            await asyncio.wait_for(stopping.wait(), float(request.query.get("delay", "0")))
        except TimeoutError:
            pass
        return web.Response(text="slow but here")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 5000, content_type="text/plain")

    async def big_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # chunked: no Content-Length to refuse it early
        await resp.prepare(request)
        for _ in range(10):
            await resp.write(b"y" * 1000)
        await resp.write_eof()
        return resp

    @web.middleware
    async def count(request: web.Request, handler):
        hits[request.path] += 1
        return await handler(request)

    app = web.Application(middlewares=[count])
    app.add_routes([
        web.post("/echo", echo), web.get("/query", query), web.post("/flaky", flaky), web.post("/500", always_500),
        web.post("/422", bad_request), web.get("/slow", slow), web.get("/big", big), web.get("/stream", big_stream),
    ])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    server = type("Server", (), {"url": f"http://127.0.0.1:{port}", "hits": hits})
    yield server
    stopping.set()
    await runner.cleanup()


def make(server, path: str, **kw):
    kw.setdefault("backoff_s", 0.001)
    kw.setdefault("parameters", PARAMS)
    name = path.split("?")[0].strip("/")
    return http_tool(name, server.url + path, description="test endpoint", **kw)


async def test_post_json_round_trip(server):
    async with ToolRegistry([make(server, "/echo")]) as registry:
        result = await registry.call("echo", {"q": "héllo", "n": 3})
    assert result.ok and result.value == {"got": {"q": "héllo", "n": 3}, "method": "POST"}
    assert result.attempts[0].executor == "http"


async def test_get_sends_query_parameters(server):
    async with ToolRegistry([make(server, "/query", method="GET")]) as registry:
        result = await registry.call("query", {"q": "a b", "n": 2})
    assert result.value == {"q": "a b", "n": "2"}


async def test_5xx_is_retried_then_succeeds(server):
    async with ToolRegistry([make(server, "/flaky", retries=2, idempotent=True)]) as registry:
        result = await registry.call("flaky", {"q": "x"})
    assert result.ok and result.value == {"ok": True}
    assert [a.error_kind for a in result.attempts] == ["http_error", "http_error", None]
    assert "503" in result.attempts[0].error and server.hits["/flaky"] == 3


async def test_5xx_exhausts_retries(server):
    async with ToolRegistry([make(server, "/500", retries=2, idempotent=True)]) as registry:
        result = await registry.call("500", {"q": "x"})
    assert result.error.kind == "http_error" and result.error.status == 500
    assert "tool '500'" in result.error.message and "internal error" in result.error.message
    assert len(result.attempts) == 3 and server.hits["/500"] == 3


async def test_4xx_is_not_retried(server):
    async with ToolRegistry([make(server, "/422", retries=3)]) as registry:
        result = await registry.call("422", {"q": ""})
    assert result.error.kind == "http_error" and result.error.status == 422
    assert "q must not be empty" in result.error.message and "not retried" in result.error.message
    assert len(result.attempts) == 1 and server.hits["/422"] == 1


async def test_slow_answer_within_timeout(server):
    t = make(server, "/slow?delay=0.2", method="GET", timeout_s=10, parameters=None)
    async with ToolRegistry([t]) as registry:
        result = await registry.call(t.name, {})
    assert result.ok and result.value == "slow but here"


async def test_timeout_is_retried_then_fails(server):
    t = make(server, "/slow?delay=5", method="GET", timeout_s=0.1, retries=1, parameters=None, idempotent=True)
    async with ToolRegistry([t]) as registry:
        result = await registry.call(t.name, {})
    assert result.error.kind == "timeout" and t.name in result.error.message
    assert len(result.attempts) == 2 and server.hits["/slow"] == 2


async def test_connection_refused_is_retried(server):
    t = http_tool("down", f"http://127.0.0.1:{free_port()}/x", description="nobody listens", retries=2, backoff_s=0.001)
    async with ToolRegistry([t]) as registry:
        result = await registry.call("down", {})
    assert result.error.kind == "http_error" and "cannot reach" in result.error.message
    assert len(result.attempts) == 3


async def test_a_non_idempotent_post_is_retried_only_when_it_never_reached_the_endpoint(server):
    """A 5xx may come after the endpoint acted: a POST not declared idempotent is not sent again,
    while a refused connection (nothing was sent) is retried."""
    async with ToolRegistry([make(server, "/500", retries=2)]) as registry:
        result = await registry.call("500", {"q": "x"})
    assert len(result.attempts) == 1 and server.hits["/500"] == 1
    assert "retry_on (ClientConnectorError) does not cover HttpToolError" in result.attempts[0].not_retried
    down = http_tool("down", f"http://127.0.0.1:{free_port()}/x", description="nobody listens", retries=1,
                     backoff_s=0.001)
    async with ToolRegistry([down]) as registry:
        assert len((await registry.call("down", {})).attempts) == 2


async def test_response_size_limit(server):
    tools = [make(server, "/big", method="GET", max_response_bytes=1000, parameters=None),
             make(server, "/stream", method="GET", max_response_bytes=1000, parameters=None)]
    async with ToolRegistry(tools) as registry:
        sized = await registry.call("big", {})
        streamed = await registry.call("stream", {})
    assert sized.error.kind == "payload_too_large" and "5000 bytes" in sized.error.message
    assert streamed.error.kind == "payload_too_large" and "over the limit of 1000 bytes" in streamed.error.message
    assert len(sized.attempts) == 1  # not retried: the answer will not shrink


async def test_invalid_arguments_never_reach_the_server(server):
    async with ToolRegistry([make(server, "/echo")]) as registry:
        result = await registry.call("echo", {"n": "three"})
    assert result.error.kind == "invalid_arguments" and server.hits["/echo"] == 0


def test_bad_http_tool_declarations():
    with pytest.raises(ToolDefinitionError, match="url must start with http"):
        http_tool("x", "ftp://host/x", description="d")
    with pytest.raises(ToolDefinitionError, match="unsupported HTTP method 'TRACE'"):
        http_tool("x", "http://host/x", description="d", method="trace")
