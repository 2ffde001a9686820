"""AsyncClient: the programs API of an `agentrt serve` server, for asyncio (httpx2). The same
calls as Client (agentrt/client/sync.py), awaited; events() is an async iterator.

    async with AsyncClient("http://127.0.0.1:8000") as c:
        run = await c.start_run("calc", {"question": "2 + 3?"})
        async for ev in c.events(run.run_id):
            ...
        info = await c.wait(run.run_id)
"""
from __future__ import annotations

import asyncio
import time
import warnings
from typing import Any, AsyncIterator, Mapping

import httpx2

from agentrt.client import _calls as calls
from agentrt.client._calls import Call, RunEvent, StartedRun
from agentrt.client.errors import ConnectionFailed, ServiceUnavailable, WaitTimedOut
from agentrt.client.keys import env_api_key
from agentrt.client.schemas import ProgramInfo, RunInfo, RunList


class AsyncClient:
    """base_url: http://HOST:PORT. api_key: sent as a bearer token (None: $AGENTRT_API_KEY).
    max_retries: how often a call that failed to connect, or got 429/503, is tried again (a
    POST only when sending it twice does no harm: a start with its Idempotency-Key)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: httpx2.Timeout | float = calls.DEFAULT_TIMEOUT, max_retries: int = 2,
                 reconnect_s: float = 30.0) -> None:
        if api_key is None:
            api_key, note = env_api_key()
            if note:
                warnings.warn(note, stacklevel=2)
        self.base_url, self.max_retries, self.reconnect_s = calls.base_url(base_url), max_retries, reconnect_s
        self._http = httpx2.AsyncClient(base_url=self.base_url, timeout=timeout,
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _do(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                r = await self._http.request(call.method, call.path, params=call.params, json=call.json,
                                       headers=call.headers, timeout=call.timeout or httpx2.USE_CLIENT_DEFAULT)
            except httpx2.TransportError as e:
                delay = calls.retry_delay(call, attempt, nothing_sent=isinstance(e, httpx2.ConnectError))
                if delay is None or attempt >= self.max_retries:
                    raise calls.connection_failed(self.base_url, call, e) from None
            else:
                if r.status_code < 400:
                    return call.read(r)
                error = calls.error_of(r, r.text)
                delay = calls.retry_delay(call, attempt, status=r.status_code, retry_after=error.retry_after)
                if delay is None or attempt >= self.max_retries:
                    raise error
            await asyncio.sleep(delay)
            attempt += 1

    # -- programs and runs --
    async def programs(self) -> list[ProgramInfo]:
        """The programs the server loaded: name, description, input schema, graph, tools."""
        return await self._do(calls.list_programs())

    async def start_run(self, program: str, inputs: Mapping[str, Any] | None = None, *, priority: float | None = None,
                  metadata: Mapping[str, str] | None = None, idempotency_key: str | None = None) -> StartedRun:
        """Start a run. The same idempotency_key returns the run it started before (created
        False); without one the client makes a key, so its own retries never start two runs."""
        return await self._do(calls.start_run(program, inputs, priority, metadata, idempotency_key))

    async def get_run(self, run_id: str) -> RunInfo:
        return await self._do(calls.get_run(run_id))

    async def list_runs(self, *, program: str | None = None, status: str | None = None, limit: int = 20,
                  cursor: str | None = None) -> RunList:
        """Newest first; the page's next_cursor gets the next page."""
        return await self._do(calls.list_runs(program, status, limit, cursor))

    async def wait(self, run_id: str, timeout: float | None = None) -> RunInfo:
        """The run once it has ended; WaitTimedOut after timeout seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = calls.WAIT_CHUNK_S if deadline is None else deadline - time.monotonic()
            info = await self._do(calls.wait_once(run_id, left))
            if info.ended:
                return info
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimedOut(info, timeout)

    async def provide_input(self, run_id: str, node: str, value: Any) -> RunInfo:
        """Answer the wait_for node `node` (the value must fit the schema it asked with)."""
        return await self._do(calls.provide_input(run_id, node, value))

    async def cancel(self, run_id: str) -> RunInfo:
        return await self._do(calls.cancel(run_id))

    async def output(self, run_id: str) -> Any:
        """A done run's output; RunFailed for a failed or cancelled run, RunNotEnded before the end."""
        return calls.output_of(await self.get_run(run_id))

    async def summary(self, run_id: str) -> dict[str, Any] | None:
        """Once ended, the run's summary (what `agentrt inspect --json` prints); before, each
        node's state and phase."""
        return (await self.get_run(run_id)).summary

    async def trace(self, run_id: str) -> list[dict[str, Any]]:
        """The run's trace records (JSON lines `agentrt inspect` reads): the whole trace of an
        ended run, what ran so far of one still going."""
        return await self._do(calls.trace(run_id))

    # -- events --
    async def events(self, run_id: str, last_event_id: int = 0) -> AsyncIterator[RunEvent]:
        """The run's events after last_event_id, live, until run_finished. A broken stream, or a
        server restart, is picked up again with Last-Event-ID: no event is lost or repeated; a
        server gone for longer than reconnect_s raises ConnectionFailed."""
        last, lost_since = last_event_id, None
        while True:
            path, headers = calls.stream_request(run_id, last)
            try:
                async with self._http.sse(path, headers=headers, timeout=calls.STREAM_TIMEOUT) as source:
                    if source.response.status_code >= 400:
                        raise calls.error_of(source.response, (await source.response.aread()).decode("utf-8", "replace"))
                    async for sse in source:
                        ev = calls.to_event(sse)
                        if ev is None:
                            continue
                        lost_since, last = None, ev.id
                        yield ev
                        if ev.type == "run_finished":
                            return
                if (await self.get_run(run_id)).ended:  # it had ended before last_event_id: nothing more comes
                    return
            except (httpx2.TransportError, ServiceUnavailable, ConnectionFailed) as e:
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > self.reconnect_s:
                    raise calls.stream_lost(self.base_url, run_id, self.reconnect_s, e) from None
            await asyncio.sleep(0.2)
