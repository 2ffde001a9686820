"""Client: the programs API of an `agentrt serve` server, blocking (httpx2).

    from agentrt.client import Client

    with Client("http://127.0.0.1:8000") as c:           # key: api_key=..., else $AGENTRT_API_KEY
        run = c.start_run("approve", {"sql": "..."}, idempotency_key="order-7")
        for ev in c.events(run.run_id):                 # resumes with Last-Event-ID on its own
            if ev.type == "input_wanted":
                c.provide_input(run.run_id, ev.data["node"], {"approved": True})
        print(c.output(run.run_id))
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Iterator, Mapping

import httpx2

from agentrt.client import _calls as calls
from agentrt.client._base import (DEFAULT_TIMEOUT, RECONNECT_PAUSE_S, STREAM_LOST, STREAM_TIMEOUT, ClientBase,
                                  EventFollower)
from agentrt.client._calls import Call, RunEvent, StartedRun
from agentrt.client.errors import WaitTimedOut
from agentrt.client.schemas import ProgramInfo, RunInfo, RunList


class Client(ClientBase):
    __doc__ = ClientBase.__doc__

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: httpx2.Timeout | float = DEFAULT_TIMEOUT, max_retries: int = 2,
                 reconnect_s: float = 30.0) -> None:
        super().__init__(base_url, api_key, max_retries, reconnect_s)
        self._http = httpx2.Client(base_url=self.base_url, timeout=timeout, headers=self._headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _do(self, call: Call) -> Any:
        for attempt in itertools.count():
            try:
                r = self._http.request(call.method, call.path, params=call.params, json=call.json,
                                       headers=call.headers, timeout=call.timeout or httpx2.USE_CLIENT_DEFAULT)
            except httpx2.TransportError as e:
                pause = self._retry_after(call, attempt, exc=e)
            else:
                if r.status_code < 400:
                    return call.read(r)
                pause = self._retry_after(call, attempt, response=r, text=r.text)
            time.sleep(pause)

    # -- programs and runs --
    def programs(self) -> list[ProgramInfo]:
        """The programs the server loaded: name, description, input schema, graph, tools."""
        return self._do(calls.list_programs())

    def start_run(self, program: str, inputs: Mapping[str, Any] | None = None, *, priority: float | None = None,
                  metadata: Mapping[str, str] | None = None, idempotency_key: str | None = None) -> StartedRun:
        """Start a run. The same idempotency_key returns the run it started before (created
        False); without one the client makes a key, so its own retries never start two runs."""
        return self._do(calls.start_run(program, inputs, priority, metadata, idempotency_key))

    def get_run(self, run_id: str) -> RunInfo:
        return self._do(calls.get_run(run_id))

    def list_runs(self, *, program: str | None = None, status: str | None = None, limit: int = 20,
                  cursor: str | None = None) -> RunList:
        """Newest first; the page's next_cursor gets the next page."""
        return self._do(calls.list_runs(program, status, limit, cursor))

    def wait(self, run_id: str, timeout: float | None = None) -> RunInfo:
        """The run once it has ended; WaitTimedOut after timeout seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = calls.WAIT_CHUNK_S if deadline is None else deadline - time.monotonic()
            info = self._do(calls.wait_once(run_id, left))
            if info.ended:
                return info
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimedOut(info, timeout)

    def provide_input(self, run_id: str, node: str, value: Any, *, by: str | None = None) -> RunInfo:
        """Answer the wait_for node `node` (the value must fit the schema it asked with); by:
        who answers (a person's or a system's name, kept in the run's trace)."""
        return self._do(calls.provide_input(run_id, node, value, by))

    def cancel(self, run_id: str) -> RunInfo:
        return self._do(calls.cancel(run_id))

    def output(self, run_id: str) -> Any:
        """A done run's output; RunFailed for a failed or cancelled run, RunNotEnded before the end."""
        return calls.output_of(self.get_run(run_id))

    def summary(self, run_id: str) -> dict[str, Any] | None:
        """Once ended, the run's summary (what `agentrt inspect --json` prints); before, each
        node's state and phase."""
        return self.get_run(run_id).summary

    def trace(self, run_id: str) -> list[dict[str, Any]]:
        """The run's trace records (JSON lines `agentrt inspect` reads): the whole trace of an
        ended run, what ran so far of one still going."""
        return self._do(calls.trace(run_id))

    # -- events --
    def events(self, run_id: str, last_event_id: int = 0) -> Iterator[RunEvent]:
        """The run's events after last_event_id, live, until run_finished. A broken stream, or a
        server restart, is picked up again with Last-Event-ID: no event is lost or repeated; a
        server gone for longer than reconnect_s raises ConnectionFailed."""
        follow = EventFollower(self, run_id, last_event_id)
        while True:
            try:
                with self._http.sse(follow.path, headers=follow.headers, timeout=STREAM_TIMEOUT) as source:
                    if source.response.status_code >= 400:
                        raise self._error_of(source.response, source.response.read().decode("utf-8", "replace"))
                    for sse in source:
                        ev = follow.take(sse)
                        if ev is not None:
                            yield ev
                            if ev.type == "run_finished":
                                return
                if self.get_run(run_id).ended:  # it had ended before last_event_id: nothing more comes
                    return
            except STREAM_LOST as e:
                follow.lost(e)
            time.sleep(RECONNECT_PAUSE_S)
