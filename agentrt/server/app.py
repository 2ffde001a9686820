"""The aiohttp application of `agentrt serve`: routes, and the middlewares every request passes
(errors in OpenAI's shape, API keys, CORS, the access log and HTTP metrics).

    GET  /health /ready /metrics /v1/models
    POST /v1/chat/completions
    GET  /v1/programs
    POST /v1/programs/{name}/runs
    GET  /v1/runs  /v1/runs/{id}  /v1/runs/{id}/events (SSE)  /v1/runs/{id}/wait
    POST /v1/runs/{id}/cancel
    GET  /v1/runs/{id}/trace  /v1/runs/{id}/timeline
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp_sse import sse_response
from pydantic import BaseModel, ValidationError

from agentrt.errors import InputValueError, RunConfigError
from agentrt.runtime.html_timeline import render_html
from agentrt.runtime.loader import Example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.trace import read_trace
from agentrt.server.config import ServerConfig
from agentrt.server.errors import ApiError, error_body, validation_message
from agentrt.server.metrics import ServerMetrics
from agentrt.server.openai_chat import ChatService, prepare_chat
from agentrt.server.runs import RunManager, ServedRun
from agentrt.server.schemas import (ChatCompletionRequest, InputWanted, RunInput, ModelCard, ModelList, ProgramInfo, ProgramList,
                                    RunCreate, RunCreated, RunError, RunInfo, RunList)

log = logging.getLogger("agentrt.server")
access_log = logging.getLogger("agentrt.access")
OPEN_PATHS = ("/health", "/ready")


@dataclass
class ServerState:
    config: ServerConfig
    model: str
    programs: dict[str, Example]
    metrics: ServerMetrics
    runtime: Runtime | None = None
    runs: RunManager | None = None
    chat: ChatService | None = None
    kv_blocks: Callable[[], Awaitable[Mapping[str, int]]] | None = None
    tracer_provider: Any = None  # an OpenTelemetry TracerProvider: each finished run's spans go to it
    started: float = field(default_factory=time.time)
    sse_open: int = 0
    stopping: bool = False
    resumed: list[str] = field(default_factory=list)  # run ids resumed from the store at start

    def attach(self, runtime: Runtime) -> None:
        """The engine is loaded: serve requests on this runtime."""
        self.runtime = runtime
        self.runs = RunManager(runtime, self.programs, self.config.limits, self.config.runs_dir,
                               self.config.keep_runs, on_end=self._run_ended,
                               allow_changed_programs=self.config.allow_changed_programs,
                               prune_after_s=self.config.prune_after_s, prune_keep=self.config.prune_keep)
        self.chat = ChatService(runtime, self.model, self.config.limits, on_response=self.metrics.on_response)
        runtime.backend.subscribe_steps(self.metrics.on_step)
        self.resumed = self.runs.recover()  # stored runs that had not ended go on
        self.kv_blocks = runtime.backend.kv_blocks

    def _run_ended(self, run: ServedRun, records: list[dict[str, Any]] | None) -> None:
        self.metrics.on_run_end(run.status, run.summary)
        if self.tracer_provider is not None and records is not None:
            from agentrt.runtime.otel import export_run

            try:
                export_run(self.tracer_provider, records)
            except Exception:  # noqa: BLE001 - telemetry never fails a run
                log.exception("exporting the spans of %s failed", run.run_id)

    def ready(self) -> tuple[RunManager, ChatService]:
        if self.stopping:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.runs is None or self.chat is None:
            raise ApiError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "1"})
        return self.runs, self.chat


STATE = web.AppKey("agentrt_state", ServerState)
RUN_ID = web.RequestKey("agentrt_run_id", str)  # for the access log


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


def _json(model: BaseModel | dict[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    body = model.model_dump(mode="json", by_alias=True) if isinstance(model, BaseModel) else model
    return web.Response(text=json.dumps(body, ensure_ascii=False, default=repr), status=status,
                        content_type="application/json", headers=headers)


async def read_body(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await request.read()  # past client_max_size: 413, turned into our error shape below
    if not raw:
        raise ApiError(400, "the request has no body: send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None


# ---- middlewares ---------------------------------------------------------------------------------
@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _json(e.body(), e.status, e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"the request body is over the limit max_body_bytes={_state(request).config.limits.max_body_bytes}"
                   }.get(e.status, e.reason)
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return _json(error_body(e.status, message), e.status, headers)
    except Exception:  # noqa: BLE001 - logged here; the client gets no internals
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json(error_body(500, "internal server error"), 500)


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    keys = _state(request).config.api_keys
    if keys and request.path not in OPEN_PATHS and request.method != "OPTIONS":
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = token.strip().encode()
        # compare against every key, each in constant time, so timing tells nothing of which matched
        if not any([hmac.compare_digest(given, k.encode()) for k in keys]):
            raise ApiError(401, "invalid API key", code="invalid_api_key")
    return await handler(request)


def _route_name(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def access_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    state, t0, status = _state(request), time.perf_counter(), 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        seconds = time.perf_counter() - t0
        route = _route_name(request)
        state.metrics.on_http(route, status, seconds)
        if state.config.access_log:
            run_id = request.match_info.get("run_id") or request.get(RUN_ID) or "-"
            access_log.info("%s %s %d %.1fms run=%s", request.method, route, status, 1000 * seconds, run_id)


def _allowed_origin(request: web.Request, origins: tuple[str, ...]) -> str | None:
    origin = request.headers.get("Origin")
    return origin if origin and ("*" in origins or origin in origins) else None


def cors_middleware(origins: tuple[str, ...]) -> Callable:
    """Answers preflight requests of allowed origins (the headers go on through cors_headers)."""

    @web.middleware
    async def cors(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.method == "OPTIONS" and _allowed_origin(request, origins):
            return web.Response(status=204)
        return await handler(request)

    return cors


def cors_headers(origins: tuple[str, ...]) -> Callable:
    """An on_response_prepare hook: CORS headers on every response to an allowed origin, event
    streams included (their headers go out before the handler returns)."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        allowed = _allowed_origin(request, origins)
        if allowed:
            response.headers.update({
                "Access-Control-Allow-Origin": allowed, "Vary": "Origin",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, Idempotency-Key, Last-Event-ID",
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS"})

    return add


# ---- service routes ------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = _state(request)
    if state.runtime is None or state.stopping:
        return _json({"status": "stopping" if state.stopping else "loading"}, 503)
    return _json({"status": "ready", "model": state.model})


async def metrics(request: web.Request) -> web.Response:
    state = _state(request)
    kv = (await state.kv_blocks() if state.kv_blocks is not None else None) or {}
    runs = {"running": state.runs.running, "queued": state.runs.queued,
            "waiting": state.runs.waiting} if state.runs is not None else {}
    return web.Response(body=state.metrics.render(kv, runs), headers={"Content-Type": state.metrics.content_type})


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    return _json(ModelList(data=[ModelCard(id=state.model, created=int(state.started))]))


# ---- chat ----------------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    _, chat_service = state.ready()
    body = await read_body(request, ChatCompletionRequest)
    chat = prepare_chat(body, state.model, state.config.limits)
    if not body.stream:
        return _json(await chat_service.create(chat))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = chat_service.stream(chat, include_usage)
    with _sse_slot(state):
        first = await anext(chunks)  # errors before the first chunk (429, 400) are plain JSON errors
        async with sse_response(request, allow_all_methods=True, sep="\n") as sse:
            try:
                await sse.send(first.model_dump_json(exclude_none=True))
                async for c in chunks:
                    await sse.send(c.model_dump_json(exclude_none=True))
            except ApiError as e:  # after the stream started: an error event, as OpenAI sends it
                await sse.send(json.dumps(e.body()))
            finally:
                await chunks.aclose()
            await sse.send("[DONE]")
        return sse


class _sse_slot:
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


# ---- programs and runs ---------------------------------------------------------------------------
async def list_programs(request: web.Request) -> web.Response:
    state = _state(request)
    data = [ProgramInfo(name=name, description=ex.description, input_schema=ex.program.input_schema(ex.default_inputs),
                        graph=ex.program.to_json(), tools=sorted(ex.program.tools))
            for name, ex in sorted(state.programs.items())]
    return _json(ProgramList(data=data))


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


async def create_run(request: web.Request) -> web.Response:
    state = _state(request)
    runs, _ = state.ready()
    body = await read_body(request, RunCreate)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 0 < len(key) <= 255:
        raise ApiError(400, "Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")
    run, created = runs.submit(request.match_info["name"], body.inputs, priority=body.priority,
                               metadata=body.metadata, idempotency_key=key)
    request[RUN_ID] = run.run_id
    return _json(RunCreated(run_id=run.run_id, status=run.status), 201 if created else 200,
                 {"Location": f"/v1/runs/{run.run_id}"})


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {raw!r}", param=name) from None
    if not lo <= value <= hi:
        raise ApiError(400, f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return value


async def list_runs(request: web.Request) -> web.Response:
    state = _state(request)
    runs, _ = state.ready()
    status = request.query.get("status")
    if status is not None and status not in ("queued", "running", "done", "failed", "cancelled"):
        raise ApiError(400, f"status must be queued, running, done, failed or cancelled, got {status!r}", param="status")
    page, cursor = runs.list(request.query.get("program"), status, _int_param(request, "limit", 20, 1, 100),
                             request.query.get("cursor"))
    return _json(RunList(data=[run_info(runs, r) for r in page], next_cursor=cursor))


async def get_run(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    return _json(run_info(runs, runs.get(request.match_info["run_id"])))


async def wait_run(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    run = runs.get(request.match_info["run_id"])
    timeout = _int_param(request, "timeout", 30, 0, 3600)
    await run.changed(after=1 << 62, timeout=timeout)  # past any event id: wakes only when the run ends
    return _json(run_info(runs, run))


async def cancel_run(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    run = runs.get(request.match_info["run_id"])
    if run.ended:
        raise ApiError(409, f"run '{run.run_id}' has already ended ({run.status})", code="run_ended")
    runs.cancel(run)
    await run.changed(after=1 << 62, timeout=10)
    return _json(run_info(runs, run))


async def provide_input(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    run = runs.get(request.match_info["run_id"])
    node = request.match_info["node"]
    body = await read_body(request, RunInput)
    if run.ended:
        raise ApiError(409, f"run '{run.run_id}' has already ended ({run.status})", code="run_ended")
    try:
        runs.provide_input(run, node, body.value)
    except InputValueError as e:
        raise ApiError(422, str(e), param="value", code="invalid_input") from None
    except RunConfigError as e:
        raise ApiError(409, str(e), param="node", code="not_waiting") from None
    await asyncio.sleep(0)  # the run takes the value before we answer
    return _json(run_info(runs, run))


async def run_events(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    runs, _ = state.ready()
    run = runs.get(request.match_info["run_id"])
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0"
    try:
        after = int(raw)
    except ValueError:
        raise ApiError(400, f"Last-Event-ID must be an event id (an integer), got {raw!r}", param="Last-Event-ID") from None
    with _sse_slot(state):
        async with sse_response(request, sep="\n") as sse:
            while True:
                for event_id, type, data in run.events[after:]:
                    await sse.send(json.dumps(data, ensure_ascii=False, default=repr), id=str(event_id), event=type)
                    after = event_id
                if run.ended and after >= len(run.events):
                    break
                await run.changed(after)
        return sse


def _trace_records(run: ServedRun) -> list[dict[str, Any]]:
    if not run.ended or run.trace_path is None:
        raise ApiError(409, f"run '{run.run_id}' has no trace yet (status {run.status}): it is written when the run ends",
                       code="run_not_ended")
    return read_trace(run.trace_path)


async def run_trace(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    records = _trace_records(runs.get(request.match_info["run_id"]))
    text = "".join(json.dumps(r, ensure_ascii=False, default=repr) + "\n" for r in records)
    return web.Response(text=text, content_type="application/jsonl")


async def run_timeline(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    run = runs.get(request.match_info["run_id"])
    records = _trace_records(run)
    return web.Response(text=render_html(run.summary, records), content_type="text/html")


# ---- the app -------------------------------------------------------------------------------------
def create_app(config: ServerConfig, model: str, programs: Mapping[str, Example],
               runtime: Runtime | None = None, tracer_provider: Any = None) -> web.Application:
    """The application; attach the runtime now or later (`app[STATE].attach(runtime)`), until
    then /ready and the API answer 503. tracer_provider: an OpenTelemetry TracerProvider that
    gets each finished run's spans (runtime/otel.py)."""
    # outermost first: the access log sees every final status; errors become responses inside it
    middlewares = [access_middleware, errors_middleware, auth_middleware]
    if config.cors_origins:
        middlewares.insert(1, cors_middleware(config.cors_origins))
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=middlewares)
    state = ServerState(config, model, dict(programs), ServerMetrics(), tracer_provider=tracer_provider)
    app[STATE] = state
    if config.cors_origins:
        app.on_response_prepare.append(cors_headers(config.cors_origins))
    if runtime is not None:
        state.attach(runtime)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/programs", list_programs)
    app.router.add_post("/v1/programs/{name}/runs", create_run)
    app.router.add_get("/v1/runs", list_runs)
    app.router.add_get("/v1/runs/{run_id}", get_run)
    app.router.add_get("/v1/runs/{run_id}/events", run_events)
    app.router.add_get("/v1/runs/{run_id}/wait", wait_run)
    app.router.add_post("/v1/runs/{run_id}/cancel", cancel_run)
    app.router.add_post("/v1/runs/{run_id}/input/{node}", provide_input)
    app.router.add_get("/v1/runs/{run_id}/trace", run_trace)
    app.router.add_get("/v1/runs/{run_id}/timeline", run_timeline)
    return app
