"""AsyncClient: the programs API of an `agentrt serve` server, for asyncio (httpx2). The same
calls as Client (agentrt/client/sync.py, where each is described), awaited; events() is an
async iterator.

    async with AsyncClient("http://127.0.0.1:8000") as c:
        run = await c.start_run("calc", {"question": "2 + 3?"})
        async for ev in c.events(run.run_id):
            ...
        info = await c.wait(run.run_id)
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncIterator, Mapping

import httpx2

from agentrt.client import _calls as calls
from agentrt.client._base import (DEFAULT_TIMEOUT, RECONNECT_PAUSE_S, STREAM_LOST, STREAM_TIMEOUT, ClientBase,
                                  EventFollower)
from agentrt.client._calls import Call, RunEvent, StartedRun
from agentrt.client.errors import WaitTimedOut
from agentrt.client.schemas import ProgramInfo, RunInfo, RunList


class AsyncClient(ClientBase):
    __doc__ = ClientBase.__doc__

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: httpx2.Timeout | float = DEFAULT_TIMEOUT, max_retries: int = 2,
                 reconnect_s: float = 30.0) -> None:
        super().__init__(base_url, api_key, max_retries, reconnect_s)
        self._http = httpx2.AsyncClient(base_url=self.base_url, timeout=timeout, headers=self._headers)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _do(self, call: Call) -> Any:
        for attempt in itertools.count():
            try:
                r = await self._http.request(call.method, call.path, params=call.params, json=call.json,
                                             headers=call.headers, timeout=call.timeout or httpx2.USE_CLIENT_DEFAULT)
            except httpx2.TransportError as e:
                pause = self._retry_after(call, attempt, exc=e)
            else:
                if r.status_code < 400:
                    return call.read(r)
                pause = self._retry_after(call, attempt, response=r, text=r.text)
            await asyncio.sleep(pause)

    # -- programs and runs --
    async def programs(self) -> list[ProgramInfo]:
        return await self._do(calls.list_programs())

    async def start_run(self, program: str, inputs: Mapping[str, Any] | None = None, *,
                        priority: float | None = None,
                        metadata: Mapping[str, str] | None = None, idempotency_key: str | None = None) -> StartedRun:
        return await self._do(calls.start_run(program, inputs, priority, metadata, idempotency_key))

    async def get_run(self, run_id: str) -> RunInfo:
        return await self._do(calls.get_run(run_id))

    async def list_runs(self, *, program: str | None = None, status: str | None = None, limit: int = 20,
                        cursor: str | None = None) -> RunList:
        return await self._do(calls.list_runs(program, status, limit, cursor))

    async def wait(self, run_id: str, timeout: float | None = None) -> RunInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = calls.WAIT_CHUNK_S if deadline is None else deadline - time.monotonic()
            info = await self._do(calls.wait_once(run_id, left))
            if info.ended:
                return info
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimedOut(info, timeout)

    async def provide_input(self, run_id: str, node: str, value: Any, *, by: str | None = None) -> RunInfo:
        return await self._do(calls.provide_input(run_id, node, value, by))

    async def cancel(self, run_id: str) -> RunInfo:
        return await self._do(calls.cancel(run_id))

    async def output(self, run_id: str) -> Any:
        return calls.output_of(await self.get_run(run_id))

    async def summary(self, run_id: str) -> dict[str, Any] | None:
        return (await self.get_run(run_id)).summary

    async def trace(self, run_id: str) -> list[dict[str, Any]]:
        return await self._do(calls.trace(run_id))

    # -- events --
    async def events(self, run_id: str, last_event_id: int = 0) -> AsyncIterator[RunEvent]:
        follow = EventFollower(self, run_id, last_event_id)
        while True:
            try:
                async with self._http.sse(follow.path, headers=follow.headers, timeout=STREAM_TIMEOUT) as source:
                    if source.response.status_code >= 400:
                        body = await source.response.aread()
                        raise self._error_of(source.response, body.decode("utf-8", "replace"))
                    async for sse in source:
                        ev = follow.take(sse)
                        if ev is not None:
                            yield ev
                            if ev.type == "run_finished":
                                return
                if (await self.get_run(run_id)).ended:  # it had ended before last_event_id: nothing more comes
                    return
            except STREAM_LOST as e:
                follow.lost(e)
            await asyncio.sleep(RECONNECT_PAUSE_S)
