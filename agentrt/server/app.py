"""The aiohttp application of `agentrt serve`: its routes (the middlewares every request passes
are in middleware.py, the shared state in state.py, the console's live feed in feed.py).

    GET  /  /console/{file}  /view/{file}       the web console (static, open without a key)
    GET  /health /ready /metrics /v1/models /v1/engine
    GET  /v1/events (SSE: runs changing, engine steps and snapshots, server-wide)
    POST /v1/chat/completions
    GET  /v1/programs
    POST /v1/programs/{name}/runs
    GET  /v1/runs  /v1/runs/{id}  /v1/runs/{id}/events (SSE)  /v1/runs/{id}/wait
    POST /v1/runs/{id}/cancel  /v1/runs/{id}/input/{node}
    GET  /v1/runs/{id}/trace  /v1/runs/{id}/timeline
    *    /mcp  the programs as MCP tools (Streamable HTTP: mcp_endpoint.py)
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Mapping

from aiohttp import web
from aiohttp_sse import sse_response
from pydantic import BaseModel, ValidationError

from agentrt.errors import InputValueError, RunConfigError
from agentrt.jsonutil import JsonDepthError, parse_json
from agentrt.runtime import html_timeline
from agentrt.runtime.html_timeline import render_html
from agentrt.runtime.loader import Example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.summary import summarize
from agentrt.runtime.trace import read_trace
from agentrt.server.config import ServerConfig
from agentrt.server.errors import ApiError, validation_message
from agentrt.server.metrics import ServerMetrics
from agentrt.server.middleware import access_middleware, auth_middleware, cors_headers, cors_middleware, errors_middleware
from agentrt.server.openai_chat import prepare_chat
from agentrt.server.runs import RunManager, ServedRun
from agentrt.server.schemas import (ChatCompletionRequest, ModelCard, ModelList, ProgramInfo, ProgramList, RunCreate,
                                    RunCreated, RunList, SignedInput)
from agentrt.server.state import (RUN_ID, STATE, ServerState, json_response as _json, replica_id, run_info,
                                  server_state as _state,
                                  sse_slot as _sse_slot)

CONSOLE_DIR = Path(__file__).parent / "console"
VIEW_DIR = Path(html_timeline.__file__).parent / "webview"
__all__ = ["STATE", "ServerState", "create_app", "read_body"]


async def read_body(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await request.read()  # past client_max_size: 413, turned into our error shape below
    if not raw:
        raise ApiError(400, "the request has no body: send a JSON object")
    try:
        data = parse_json(raw)
    except JsonDepthError as e:
        raise ApiError(400, f"the body is {e}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None


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
    runs = {"running": state.runs.running, "queued": state.runs.queued,
            "waiting": state.runs.waiting} if state.runs is not None else {}
    return web.Response(body=state.metrics.render_server(await state.kv_blocks_by_engine(), runs),
                        headers={"Content-Type": state.metrics.content_type})


async def engine(request: web.Request) -> web.Response:
    """The engine panel's figures (batch size, tokens/s, α and k over the last minute, KV blocks)."""
    state = _state(request)
    state.ready()
    return _json(await state.feed.snapshot())


async def events(request: web.Request) -> web.StreamResponse:
    """Server-wide SSE (feed.py): every run's changes, the engine's steps and snapshots."""
    state = _state(request)
    state.ready()
    with _sse_slot(state):
        return await state.feed.stream(request, {"model": state.model, "precision": state.precision})


async def _revalidate_console_files(request: web.Request, response: web.StreamResponse) -> None:
    """The console's modules are revalidated on every load (a cheap 304): a browser's heuristic
    cache could otherwise mix an upgraded module with stale ones it imports."""
    if request.path.startswith(("/console/", "/view/")):
        response.headers["Cache-Control"] = "no-cache"


async def console_index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(CONSOLE_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    return _json(ModelList(data=[ModelCard(id=state.model, created=int(state.started), precision=state.precision)]))


# ---- chat ----------------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    _, chat_service = state.ready()
    body = await read_body(request, ChatCompletionRequest)
    chat = prepare_chat(body, state.model, state.config.limits,
                        state.runtime.tools if state.runtime is not None else None)
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


# ---- programs and runs ---------------------------------------------------------------------------
async def list_programs(request: web.Request) -> web.Response:
    state = _state(request)
    data = [ProgramInfo(name=name, description=ex.description, input_schema=ex.program.input_schema(ex.default_inputs),
                        graph=ex.program.to_json(), tools=sorted(ex.program.tools))
            for name, ex in sorted(state.programs.items())]
    return _json(ProgramList(data=data))


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
    if status is not None and status not in ("queued", "running", "waiting", "done", "failed", "cancelled"):
        raise ApiError(400, f"status must be queued, running, waiting, done, failed or cancelled, got {status!r}",
                       param="status")
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
    body = await read_body(request, SignedInput)
    if run.ended:
        raise ApiError(409, f"run '{run.run_id}' has already ended ({run.status})", code="run_ended")
    try:
        runs.provide_input(run, node, body.value, by=body.by)
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
                if run.ended and after >= len(run.events) or state.stopping:
                    break  # stopping: a run interrupted by the shutdown never ends here; the client reconnects
                await run.changed(after, timeout=1.0)
        return sse


def _trace_records(runs: RunManager, run: ServedRun) -> list[dict[str, Any]]:
    """An ended run's trace file; for a run still going, its trace as it stands (the nodes that
    finished, and the program record with its status now)."""
    if not run.ended and run.run_id in runs.runtime.runs:
        return runs.runtime.run_snapshot(run.run_id)
    if not run.ended and run.remote:
        raise ApiError(409, f"run '{run.run_id}' runs on another replica, which serves its trace so far "
                            "(`agentrt status --db URL` names its owner)", code="run_elsewhere")
    if not run.ended:
        raise ApiError(409, f"run '{run.run_id}' has no trace yet (status {run.status}): nothing of it has run",
                       code="run_not_started")
    if run.trace_path is None and run.started_at is not None:
        raise ApiError(409, f"run '{run.run_id}' ended ({run.status}) and its trace file is not in this "
                            f"server's --runs-dir ({runs.runs_dir}): another replica ran it, or the file was removed",
                       code="run_trace_elsewhere")
    if run.trace_path is None:
        raise ApiError(409, f"run '{run.run_id}' ended ({run.status}) without a trace: it never started",
                       code="run_without_trace")
    return read_trace(run.trace_path)


async def run_trace(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    records = _trace_records(runs, runs.get(request.match_info["run_id"]))
    text = "".join(json.dumps(r, ensure_ascii=False, default=repr) + "\n" for r in records)
    return web.Response(text=text, content_type="application/jsonl")


async def run_timeline(request: web.Request) -> web.Response:
    runs, _ = _state(request).ready()
    run = runs.get(request.match_info["run_id"])
    records = _trace_records(runs, run)
    summary = run.summary if run.ended and run.summary is not None else summarize(records)
    return web.Response(text=render_html(summary, records), content_type="text/html")


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
    state = ServerState(config, model, dict(programs), ServerMetrics(replica_id(config)),
                        tracer_provider=tracer_provider)
    app[STATE] = state
    if config.cors_origins:
        app.on_response_prepare.append(cors_headers(config.cors_origins))
    app.on_response_prepare.append(_revalidate_console_files)
    if runtime is not None:
        state.attach(runtime)
    app.router.add_get("/", console_index)
    app.router.add_static("/console/", CONSOLE_DIR, append_version=False)
    app.router.add_static("/view/", VIEW_DIR, append_version=False)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/engine", engine)
    app.router.add_get("/v1/events", events)
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
    from agentrt.server.mcp_endpoint import mount_mcp  # the MCP SDK loads with the app, not with every import

    mount_mcp(app)
    return app
