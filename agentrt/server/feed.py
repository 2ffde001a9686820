"""The server-wide live feed behind the web console: `GET /v1/events` (SSE) and `GET /v1/engine`.

    hello         {now, model, engine}: the first event of a stream
    run           a RunInfo, whenever a run is queued, starts, waits or goes on, or ends
    engine_steps  {steps: [engine_step records, as in a trace]}, batched at most every 0.25 s
    engine        the engine snapshot, every second

Nothing here is stored: a client that reconnects lists the runs again and goes on from what comes
next. The engine snapshot reads the same step stream as /metrics (and the KV block counts /metrics
reads at scrape time), over sliding windows instead of counters since start.
"""
from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp_sse import sse_response

from agentrt.runtime.backend import EngineStep

if TYPE_CHECKING:
    from agentrt.runtime.runtime import Runtime

RATE_WINDOW_S = 10.0  # tokens/s and steps/s
HIST_WINDOW_S = 60.0  # α and the k histogram
STEP_FLUSH_S = 0.25
SNAPSHOT_S = 1.0
QUEUE_LIMIT = 2000  # events waiting for one slow client; past it the client is dropped (it reconnects)


def generated_tokens(step: Mapping[str, Any]) -> int:
    """Tokens a step emitted: each decoding sequence feeds 1 + k tokens and emits 1 + accepted, so
    emitted = decode tokens fed - drafted + accepted (a prefill row's first token is not counted)."""
    return max(0, step["num_tokens"] - step.get("num_prefill_tokens", 0) - step.get("drafted", 0)
               + step.get("accepted", 0))


class ServerFeed:
    """Fans the engine's steps and the runs' changes out to every open /v1/events stream."""

    def __init__(self, runtime: Runtime, run_counts: Callable[[], Mapping[str, int]],
                 kv_blocks: Callable[[], Awaitable[Mapping[str, int]]] | None) -> None:
        self.runtime, self.run_counts, self.kv_blocks = runtime, run_counts, kv_blocks
        self.recent: deque[dict[str, Any]] = deque()  # engine step records of the last HIST_WINDOW_S
        self.clients: set[asyncio.Queue[tuple[str, Any] | None]] = set()
        self._pending_steps: list[dict[str, Any]] = []
        self._flusher: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None  # one snapshot a second for all clients, while there are any
        self._kv: Mapping[str, int] = {}  # the last KV block counts read
        self._kv_reading: asyncio.Task | None = None  # at most one read on the engine thread at a time
        self._snapshot: tuple[float, dict[str, Any]] | None = None  # (loop time, snapshot)
        self._unsubscribe = runtime.backend.subscribe_steps(self.on_step)

    def close(self) -> None:
        self._unsubscribe()
        for task in (self._flusher, self._ticker, self._kv_reading):
            if task is not None:
                task.cancel()
        for q in list(self.clients):
            q.put_nowait(None)

    # -- inputs --
    def on_step(self, step: EngineStep) -> None:
        rec = step.to_record()
        start = self.runtime.trace.at(step.start)
        rec.update(type="engine_step", start=round(start, 6), end=round(start + step.duration_s, 6))
        del rec["duration_s"]
        self.recent.append(rec)
        self._trim(rec["end"])
        if not self.clients:
            return
        self._pending_steps.append(rec)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_steps())

    def on_run(self, info: Mapping[str, Any]) -> None:
        self._broadcast("run", info)

    # -- outputs --
    def _broadcast(self, type: str, data: Any) -> None:
        for q in list(self.clients):
            if q.qsize() >= QUEUE_LIMIT:  # a client that stopped reading: drop it, it reconnects
                self.clients.discard(q)
                q.put_nowait(None)
            else:
                q.put_nowait((type, data))

    async def _flush_steps(self) -> None:
        await asyncio.sleep(STEP_FLUSH_S)
        steps, self._pending_steps = self._pending_steps, []
        if steps:
            self._broadcast("engine_steps", {"steps": steps})

    def _trim(self, now: float) -> None:
        while self.recent and self.recent[0]["end"] < now - HIST_WINDOW_S:
            self.recent.popleft()

    async def snapshot(self) -> dict[str, Any]:
        """What the engine is doing now: the figures of the console's engine panel. One built less
        than a second ago is reused, so clients and /v1/engine never add work on the engine thread."""
        if self._snapshot is not None and asyncio.get_running_loop().time() - self._snapshot[0] < SNAPSHOT_S:
            return self._snapshot[1]
        return await self._fresh_snapshot()

    async def _fresh_snapshot(self) -> dict[str, Any]:
        snap = self._build(await self._read_kv())
        self._snapshot = (asyncio.get_running_loop().time(), snap)
        return snap

    async def _read_kv(self) -> Mapping[str, int]:
        """The KV block counts, read on the engine thread between steps; while a read is pending
        (a long step) the last counts stand in, and no second read is queued behind it."""
        if self.kv_blocks is None:
            return {}
        if self._kv_reading is None or self._kv_reading.done():
            self._kv_reading = asyncio.ensure_future(self.kv_blocks())
        try:
            self._kv = dict(await asyncio.wait_for(asyncio.shield(self._kv_reading), 0.5))
        except Exception:  # noqa: BLE001 - slow or closing engine: the last counts (or none) stand in
            pass
        return self._kv

    def _build(self, kv: Mapping[str, int]) -> dict[str, Any]:
        now = self.runtime.trace.now()
        self._trim(now)
        rate = [s for s in self.recent if s["end"] >= now - RATE_WINDOW_S]
        span = min(RATE_WINDOW_S, max(now, 1e-9))
        drafted = sum(s.get("drafted", 0) for s in self.recent)
        k_hist: dict[str, int] = {}
        for s in self.recent:
            k = str(s.get("max_k", 0))
            k_hist[k] = k_hist.get(k, 0) + 1
        last = self.recent[-1] if self.recent else None
        return {
            "time": round(now, 6),
            "batch_size": last["batch_size"] if last is not None and last["end"] >= now - 1.0 else 0,
            "steps_per_s": round(len(rate) / span, 3),
            "tokens_per_s": round(sum(generated_tokens(s) for s in rate) / span, 3),
            "alpha_60s": round(sum(s.get("accepted", 0) for s in self.recent) / drafted, 4) if drafted else None,
            "k_hist_60s": dict(sorted(k_hist.items(), key=lambda kv_: int(kv_[0]))),
            "kv": dict(kv),
            "runs": dict(self.run_counts()),
        }

    async def _tick(self) -> None:
        while self.clients:
            await asyncio.sleep(SNAPSHOT_S)
            if self.clients:
                self._broadcast("engine", await self._fresh_snapshot())

    async def stream(self, request: web.Request, hello: Mapping[str, Any]) -> web.StreamResponse:
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        self.clients.add(queue)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        try:
            async with sse_response(request, sep="\n") as sse:
                await sse.send(_dumps({**hello, "now": round(self.runtime.trace.now(), 6),
                                       "engine": await self.snapshot()}), event="hello")
                while (item := await queue.get()) is not None:
                    await sse.send(_dumps(item[1]), event=item[0])
            return sse
        finally:
            self.clients.discard(queue)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, default=repr)
