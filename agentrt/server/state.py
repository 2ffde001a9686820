"""What every handler of `agentrt serve` shares: the server state (config, programs, metrics, and
once the engine is loaded the runtime, runs, chat and the live feed), JSON responses, the cap on
open event streams, and a run as the API shows it."""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from pydantic import BaseModel

from agentrt.runtime.loader import Example
from agentrt.runtime.node_events import Subscriber
from agentrt.runtime.runtime import Runtime
from agentrt.server.config import ServerConfig
from agentrt.server.errors import ApiError
from agentrt.server.feed import ServerFeed
from agentrt.server.metrics import IN_PROCESS, RunMetrics, ServerMetrics
from agentrt.server.openai_chat import ChatService
from agentrt.server.runs import RunManager, ServedRun
from agentrt.server.schemas import InputWanted, RunError, RunInfo
from agentrt.structured.tool_formats import HOUSE


@dataclass
class ServerState:
    config: ServerConfig
    model: str
    programs: dict[str, Example]
    metrics: ServerMetrics
    runtime: Runtime | None = None
    runs: RunManager | None = None
    feed: ServerFeed | None = None
    chat: ChatService | None = None
    kv_blocks: Callable[[], Awaitable[Mapping[str, int]]] | None = None
    tracer_provider: Any = None  # an OpenTelemetry TracerProvider: each ended run's spans go to it (OtelExport)
    started: float = field(default_factory=time.time)
    sse_open: int = 0
    stopping: bool = False
    resumed: list[str] = field(default_factory=list)  # run ids resumed from the store at start
    precision: str | None = None  # what runs (LoadedModel.precision), once the model is loaded

    def attach(self, runtime: Runtime) -> None:
        """The engine is loaded: serve requests on this runtime."""
        self.runtime = runtime
        self.runs = RunManager(runtime, self.programs, self.config.limits, self.config.runs_dir,
                               self.config.keep_runs, on_end=self._run_ended,
                               allow_changed_programs=self.config.allow_changed_programs,
                               prune_after_s=self.config.prune_after_s, prune_keep=self.config.prune_keep,
                               store_retry_s=self.config.store_retry_s, lease_s=self.config.lease_s,
                               replica_id=replica_id(self.config))
        self.chat = ChatService(runtime, self.model, self.config.limits, on_response=self.metrics.on_response,
                                tool_format=getattr(runtime.backend, "tool_format", HOUSE))  # no model: house
        runtime.backend.subscribe_steps(self.metrics.on_step)  # engine steps are not node events
        for subscriber in server_subscribers(self.metrics, self.tracer_provider, runtime):
            runtime.events.subscribe(subscriber)
        self.kv_blocks = runtime.backend.kv_blocks
        runs = self.runs
        feed = self.feed = ServerFeed(runtime, lambda: {"running": runs.running, "queued": runs.queued,
                                                        "waiting": runs.waiting}, self.kv_blocks)

        def tell_feed(run: ServedRun) -> None:
            if feed.clients:  # a RunInfo (with the whole summary of an ended run) only when someone listens
                feed.on_run(run_info(runs, run).model_dump(mode="json", by_alias=True))

        runs.watchers.append(tell_feed)
        self.resumed = runs.recover()  # stored runs that had not ended go on

    async def kv_blocks_by_engine(self) -> dict[str, Mapping[str, int]]:
        """KV blocks by state of each engine: the engine workers' (their last status reports) or
        this process's own engine."""
        backend = self.runtime.backend if self.runtime is not None else None
        workers = getattr(backend, "workers", None)
        if callable(workers):  # RemoteEngineBackend
            return {w: status.get("kv") or {} for w, status in workers().items()}
        kv = await self.kv_blocks() if self.kv_blocks is not None else None
        return {IN_PROCESS: kv} if kv else {}

    def _run_ended(self, run: ServedRun) -> None:
        if run.handle is None:  # it never reached the runtime: no node events tell of it
            self.metrics.run_ended(run.status)

    def ready(self) -> tuple[RunManager, ChatService]:
        if self.stopping:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.runs is None or self.chat is None:
            raise ApiError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "1"})
        return self.runs, self.chat


def server_subscribers(metrics: ServerMetrics, tracer_provider: Any, runtime: Runtime) -> list[Subscriber]:
    """The server's subscribers of its runtime's node events, heard after the runtime's own
    (runtime/subscribers.py: `node_subscribers`): the run metrics, then, with a tracer provider,
    the OpenTelemetry export of each ended run's spans."""
    subscribers: list[Subscriber] = [RunMetrics(metrics)]
    if tracer_provider is not None:
        from agentrt.runtime.otel import OtelExport

        subscribers.append(OtelExport(tracer_provider, runtime.trace.run_records))
    return subscribers


def replica_id(config: ServerConfig) -> str:
    """This server's replica id (HOST:PORT: the same on each start), under which it holds its runs
    in a PostgreSQL lease store and labels its metrics."""
    return f"{socket.gethostname()}:{config.port}"


STATE = web.AppKey("agentrt_state", ServerState)
RUN_ID = web.RequestKey("agentrt_run_id", str)  # for the access log


def server_state(request: web.Request) -> ServerState:
    return request.app[STATE]


def json_response(model: BaseModel | dict[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    body = model.model_dump(mode="json", by_alias=True) if isinstance(model, BaseModel) else model
    return web.Response(text=json.dumps(body, ensure_ascii=False, default=repr), status=status,
                        content_type="application/json", headers=headers)


class sse_slot:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def __enter__(self) -> None:
        limit = self.state.config.limits.max_sse_connections
        if self.state.sse_open >= limit:
            raise ApiError(429, f"too many open event streams (limit max_sse_connections={limit})",
                           code="too_many_streams", headers={"Retry-After": str(self.state.config.limits.retry_after_s)})
        self.state.sse_open += 1

    def __exit__(self, *exc: Any) -> None:
        self.state.sse_open -= 1


def run_info(runs: RunManager, run: ServedRun) -> RunInfo:
    summary = run.summary if run.ended else {"nodes": runs.live_nodes(run)}
    end = run.ended_at
    return RunInfo(run_id=run.run_id, program=run.program, status=run.status, created_at=run.created_at,
                   started_at=run.started_at, ended_at=end,
                   duration_s=None if end is None or run.started_at is None else round(end - run.started_at, 6),
                   inputs=run.inputs, metadata=run.metadata, output=run.output,
                   error=None if run.error is None else RunError(node=run.error.get("node"), message=run.error["message"]),
                   waiting_for=[InputWanted(node=n, schema=w.schema, prompt=w.prompt) for n, w in runs.waiting_for(run).items()],
                   summary=summary)


