"""The middlewares every request of `agentrt serve` passes: errors in OpenAI's shape, API keys,
CORS and the access log with HTTP metrics."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Callable

from aiohttp import web

from agentrt.runtime.store_api import StoreUnavailable
from agentrt.server.errors import ApiError, error_body
from agentrt.server.state import RUN_ID, json_response as _json, server_state as _state

access_log = logging.getLogger("agentrt.access")
log = logging.getLogger("agentrt.server")
OPEN_PATHS = ("/health", "/ready", "/")
OPEN_PREFIXES = ("/console/", "/view/")  # the console's static files: it asks for the key itself


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _json(e.body(), e.status, e.headers)
    except StoreUnavailable as e:  # nothing of the request was recorded; the client may try again
        log.warning("%s %s: %s", request.method, request.path, e)
        return _json(error_body(503, str(e), code="store_unavailable"), 503,
                     {"Retry-After": str(_state(request).config.limits.retry_after_s)})
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
    if keys and not is_open(request.path) and request.method != "OPTIONS":
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
