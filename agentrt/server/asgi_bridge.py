"""One aiohttp request served by an ASGI application (HTTP only), in the server's own process.

The MCP SDK's Streamable HTTP transport is an ASGI app; `agentrt serve` is aiohttp. This adapter
hands the app the request (scope, body through `receive`) and writes what it sends back to an
aiohttp StreamResponse as it comes, so event streams flow unbuffered.

`receive` gives the body, then blocks until the client goes away (or the response has ended)
and only then answers `http.disconnect`, as the ASGI spec asks: streaming responses (Starlette's,
sse-starlette's) call it in a loop to learn of the disconnect. The aiohttp-asgi package answers
that loop with empty body messages at once, which spins a core for as long as a stream is open;
hence this small adapter rather than that dependency.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Awaitable, Callable, MutableMapping

from aiohttp import web

Message = MutableMapping[str, Any]
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

log = logging.getLogger("agentrt.server")
DISCONNECT_POLL_S = 1.0  # how soon an open stream learns that its client went away
_running: set[asyncio.Task] = set()  # the apps' tasks, held until they end


def asgi_scope(request: web.Request, **extra: Any) -> dict[str, Any]:
    """The ASGI HTTP scope of an aiohttp request (spec 2.3: disconnects come through receive)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    sock = transport.get_extra_info("sockname") if transport is not None else None
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": f"{request.version.major}.{request.version.minor}", "method": request.method,
            "scheme": request.scheme, "path": request.path, "raw_path": request.raw_path.split("?", 1)[0].encode(),
            "query_string": request.query_string.encode(), "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.raw_headers],
            "client": tuple(peer[:2]) if isinstance(peer, tuple) else None,
            "server": tuple(sock[:2]) if isinstance(sock, tuple) else None, "state": {}, **extra}


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def serve_asgi(app: ASGIApp, request: web.Request, **scope_extra: Any) -> web.StreamResponse:
    """Run `app` for this request and return the response it wrote. An app that fails before it
    starts a response raises here (the errors middleware answers); after, the response is ended."""
    response: web.StreamResponse | None = None
    body_read = complete = False
    ended = asyncio.Event()  # the response is complete, the app returned, or the client went away
    gone = asyncio.Event()  # the client went away (this handler was cancelled, or a write failed)

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            chunk = await request.content.readany()
            body_read = request.content.at_eof()
            return {"type": "http.request", "body": chunk, "more_body": not body_read}
        # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow the cancellation that
        # an anyio cancel scope (the SDK's streams) sends to this task
        waiter = asyncio.ensure_future(ended.wait())
        try:
            while not waiter.done() and not _client_gone(request):
                await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
        finally:
            waiter.cancel()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal response, complete
        if message["type"] == "http.response.start":
            if response is not None:
                raise RuntimeError("the ASGI app started its response twice")
            response = web.StreamResponse(status=message["status"])
            for name, value in message.get("headers", ()):
                response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
            await response.prepare(request)  # headers out now: an event stream's client sees it open
        elif message["type"] == "http.response.body":
            if response is None:
                raise RuntimeError("the ASGI app sent a body before starting its response")
            if complete or gone.is_set():
                return
            try:
                body = message.get("body", b"")
                if body:
                    await response.write(body)
                if not message.get("more_body", False):
                    await response.write_eof()
                    complete = True
                    ended.set()
            except ConnectionError:  # as ASGI servers do: what is sent past a disconnect is dropped
                gone.set()
                ended.set()

    # aiohttp cancels a handler whose client closed the connection; an ASGI app is told through
    # receive() instead (a client closing a stream it has read is no reason to cut the app's work
    # short), so the app runs in its own task that this handler's cancellation does not reach.
    # The handler returns once the response is complete, as ASGI servers do: what the app does
    # after it (its clean-up) is not the request's.
    task = asyncio.get_running_loop().create_task(app(asgi_scope(request, **scope_extra), receive, send),
                                                  name=f"asgi:{request.method} {request.path}")
    _running.add(task)
    task.add_done_callback(_running.discard)

    def app_ended(t: asyncio.Task) -> None:
        ended.set()  # a receive() still waiting returns, the handler answers
        if not t.cancelled() and t.exception() is not None and response is not None:  # else the handler raises it
            log.error("the ASGI app failed on %s %s after it started its response", request.method, request.path,
                      exc_info=t.exception())

    task.add_done_callback(app_ended)
    answered = asyncio.ensure_future(ended.wait())
    try:
        await asyncio.wait({task, answered}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        gone.set()  # the app's receive() answers http.disconnect now
        ended.set()
        if response is None:
            raise
        # its status went out: an SSE client that closes as soon as it has read its answer
        # (before the last chunk) is logged with that status, as ASGI servers log it, not as 499
        asyncio.current_task().uncancel()
        return response
    finally:
        answered.cancel()
    if task.done() and not task.cancelled() and task.exception() is not None and response is None:
        raise task.exception()  # failed before answering: the errors middleware answers
    if response is None:
        raise RuntimeError(f"the ASGI app sent no response to {request.method} {request.path}")
    if not complete:  # the app returned (or failed) mid-stream: end the body the client reads
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    return response

