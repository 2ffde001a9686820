"""One live connection to one MCP server, kept up by a supervising task.

The task enters the SDK's `Client` (its transport: `stdio_client`, which starts the server as a
child process, or `streamable_http_client`), lists the tools, then waits until the connection
is lost or closed. A lost connection (the child exited, the HTTP server went away) is made again
after a back-off that doubles from `backoff_s` up to `backoff_max_s` and resets once a connection
holds; calls made meanwhile wait for the next attempt (within their own timeout) and fail with
its error if it fails. Tool-list changes, announced by notifications/tools/list_changed (older
servers) or a `subscriptions/listen` stream (2026-07-28 servers), re-list the tools.

Closing cancels the task: the SDK's stdio transport then closes the child's stdin, waits, and
kills its process tree, so no server outlives the connection.
"""
from __future__ import annotations

import asyncio
import logging
import math
import sys
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
import mcp_types as types
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from agentrt.tools.mcp.spec import McpServerSpec

log = logging.getLogger("agentrt.tools.mcp")

_LIST_PAGES = 100  # a server whose tools/list never ends its pagination cannot hang a connection


class ServerUnavailable(Exception):
    """The server could not be started or reached (the message says why)."""


@asynccontextmanager
async def _watched(transport: Any, lost: asyncio.Event) -> AsyncIterator[Any]:
    """The transport's streams, with `lost` set when its read stream ends: the child exited or
    the connection dropped, which the SDK's session only tells the requests then in flight."""
    async with transport as (read, write):
        relay_send, relay_receive = anyio.create_memory_object_stream[Any](0)

        async def relay() -> None:
            try:
                async with relay_send:
                    async for item in read:
                        await relay_send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                lost.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(relay)
            try:
                yield relay_receive, write
            finally:
                tg.cancel_scope.cancel()


def _transport(spec: McpServerSpec, on_http_error: Callable[[str], None]) -> Any:
    if spec.url is not None:
        import httpx2  # the SDK's HTTP client; headers (auth) go on every request

        async def note(response: Any) -> None:  # the SDK's error for a 4xx/5xx does not say which
            if response.status_code >= 400:
                on_http_error(f"HTTP {response.status_code} {response.reason_phrase}".strip())

        client = httpx2.AsyncClient(headers=dict(spec.headers), timeout=httpx2.Timeout(30.0, read=300.0),
                                    event_hooks={"response": [note]})
        return _http(spec.url, client)
    params = StdioServerParameters(command=spec.command[0], args=list(spec.command[1:]),
                                   env=dict(spec.env) or None, cwd=spec.cwd)
    return stdio_client(params, errlog=_stderr())  # the server's own log lines go to ours


def _stderr() -> Any:
    """This process's stderr as a file the child can write to (a captured or replaced sys.stderr
    has no file descriptor: the original one then)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return sys.__stderr__


@asynccontextmanager
async def _http(url: str, client: Any) -> AsyncIterator[Any]:
    async with client, streamable_http_client(url, http_client=client) as streams:
        yield streams


class McpConnection:
    """on_tools(listed tools): called with every listing, the first one and each after a change.
    restart: make the connection again when it is lost or cannot be made (False: one attempt).
    give_up_after: consecutive failed attempts after which, while no call waits, the supervisor
    stops trying (a command that cannot start is not spawned every few seconds for ever); the
    next call starts it again."""

    def __init__(self, spec: McpServerSpec, on_tools: Callable[[list[types.Tool]], None], *,
                 backoff_s: float = 0.1, backoff_max_s: float = 5.0, connect_timeout_s: float = 30.0,
                 restart: bool = True, give_up_after: int = 5) -> None:
        self.spec = spec
        self.on_tools = on_tools
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.connect_timeout_s = connect_timeout_s
        self.restart = restart  # False: one attempt (listing the tools at declaration)
        self.give_up_after = give_up_after
        self._waiting = 0  # calls waiting in ready()
        self.client: Client | None = None
        self.starts = 0  # connections made (a restart after a crash counts)
        self.last_error: str | None = None
        self._http_error: str | None = None  # the last 4xx/5xx answer of an HTTP server, for errors
        self._task: asyncio.Task | None = None
        self._next: asyncio.Future | None = None  # the outcome of the next connection attempt
        self._lost = asyncio.Event()
        self._relist = asyncio.Event()
        self._closing = False

    # -- for callers ---------------------------------------------------------------------------
    async def ready(self) -> Client:
        """The connected client; starts the server on first use, waits for a restart in progress.
        Raises ServerUnavailable when the attempt it waits for fails."""
        if self._closing:
            raise ServerUnavailable("the connection is closed")
        if self._task is None or self._task.done():
            self._next = asyncio.get_running_loop().create_future()
            self._task = asyncio.get_running_loop().create_task(self._supervise(), name=f"agentrt-mcp:{self.spec.name}")
        if self.client is not None and not self._lost.is_set():
            return self.client
        if self._next is None:
            raise ServerUnavailable("the connection is closed")
        self._waiting += 1
        try:
            await asyncio.shield(self._next)
        finally:
            self._waiting -= 1
        if self.client is None:  # it connected and was lost again at once
            raise ServerUnavailable(self.last_error or "the connection was lost")
        return self.client

    def connection_lost(self) -> None:
        """A call saw the connection close: reconnect (the reader may not have noticed yet)."""
        self._lost.set()

    async def aclose(self) -> None:
        self._closing = True
        self._lost.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing: its errors are logged
                pass
        self._settle(ServerUnavailable("the connection was closed"))

    # -- the supervising task --------------------------------------------------------------------
    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            self._lost.clear()
            try:
                await self._connected_session()
                failures = 0  # it held, then was lost: restart soon
                why = "the connection was lost" if not self._closing else None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - anyio groups wrap the transport's errors
                log.debug("MCP server %s: connection ended", self.spec.name, exc_info=e)
                failures += 1
                why = _describe(e) + (f" ({self._http_error})" if self._http_error else "")
                self._http_error = None
                self._settle(ServerUnavailable(why))
            self.client = None
            if self._closing or not self.restart:
                self._settle(ServerUnavailable(why or "the connection was closed"))
                return
            self.last_error = why
            if failures >= self.give_up_after and not self._waiting:
                log.warning("MCP server '%s' (%s): %s; %d attempts failed, the next call tries again",
                            self.spec.name, self.spec.where, why, failures)
                return
            wait = min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1))
            log.warning("MCP server '%s' (%s): %s; starting it again in %.2f s", self.spec.name, self.spec.where,
                        why, wait)
            await asyncio.sleep(wait)

    async def _connected_session(self) -> None:
        # the handshake's deadline is lifted once it is done; the scope encloses the session's
        # task groups, as anyio wants of a scope that cancels them
        with anyio.CancelScope(deadline=anyio.current_time() + self.connect_timeout_s) as handshake:
            await self._session(handshake)
        if handshake.cancelled_caught:
            raise TimeoutError("handshake")

    async def _session(self, handshake: anyio.CancelScope) -> None:
        async with _watched(_transport(self.spec, self._note_http_error), self._lost) as streams, \
                Client(_StreamPair(streams), message_handler=self._on_message, cache=None) as client:
            try:
                async with anyio.create_task_group() as tg:
                    if client.protocol_version in MODERN_PROTOCOL_VERSIONS and _announces_changes(client):
                        await tg.start(self._listener, client)  # subscribed before listing: no change is missed
                    self.on_tools(await list_tools(client))
                    handshake.deadline = math.inf
                    self.client = client
                    self.starts += 1
                    self._settle(None)
                    tg.start_soon(self._relister, client)
                    await self._lost.wait()
                    tg.cancel_scope.cancel()
            finally:
                self.client = None

    def _note_http_error(self, status: str) -> None:
        self._http_error = status

    def take_http_error(self) -> str | None:
        """The last 4xx/5xx answer of an HTTP server since the last call of this (None: none)."""
        status, self._http_error = self._http_error, None
        return status

    def _settle(self, error: Exception | None) -> None:
        """Resolve the outcome callers wait for, and arm the next one."""
        fut = self._next
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
                fut.exception()  # nobody may be waiting: not an unretrieved error
        self._next = None if self._closing else asyncio.get_running_loop().create_future()

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._relist.set()  # listing here would block the session's reader: the relister does it

    async def _relister(self, client: Client) -> None:
        while True:
            await self._relist.wait()
            self._relist.clear()
            try:
                self.on_tools(await list_tools(client))
            except Exception as e:  # noqa: BLE001 - keep the last listing; the next change tries again
                log.warning("MCP server '%s': listing its tools after a change failed: %s", self.spec.name, e)

    async def _listener(self, client: Client, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        try:
            async with client.listen(tools_list_changed=True) as sub:
                task_status.started()
                started = True
                async for _ in sub:
                    self._relist.set()
        except Exception as e:  # noqa: BLE001 - changes are then seen on the next connection only
            log.info("MCP server '%s': no tool-list subscription (%s)", self.spec.name, e)
        finally:
            if not started:
                task_status.started()


class _StreamPair:
    """Already-open streams as the Transport the SDK's Client enters (the supervising task owns
    the real transport, so that its end is watched)."""

    def __init__(self, streams: Any) -> None:
        self.streams = streams

    async def __aenter__(self) -> Any:
        return self.streams

    async def __aexit__(self, *exc: Any) -> None:
        return None


def _announces_changes(client: Client) -> bool:
    tools = client.server_capabilities.tools
    return tools is not None and tools.list_changed is True


async def list_tools(client: Client) -> list[types.Tool]:
    """Every tool the server lists, over all pages."""
    out: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(_LIST_PAGES):
        page = await client.list_tools(cursor=cursor)
        out += page.tools
        cursor = page.next_cursor
        if cursor is None:
            break
    return out


def _describe(e: BaseException) -> str:
    """One line for an error the transport or handshake raised (anyio wraps them in groups)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    if isinstance(e, TimeoutError):
        return "it did not answer the MCP handshake in time"
    if isinstance(e, FileNotFoundError):
        return f"cannot run the command: {e.strerror}: {e.filename}"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text
