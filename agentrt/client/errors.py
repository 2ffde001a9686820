"""What the client raises. An error answer of the server (its body is OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}) becomes the ApiError subclass of its status,
carrying the server's reason; a server that cannot be reached is ConnectionFailed."""
from __future__ import annotations

import json
from typing import Any

from agentrt.errors import AgentRTError


class ClientError(AgentRTError):
    """Base class of every error agentrt.client raises."""


class BadUrl(ClientError, ValueError):
    """A URL that names no server (or no run, where a run's URL is wanted)."""


class ConnectionFailed(ClientError):
    """The server could not be reached, or the connection broke (after the retries allowed)."""


class ApiError(ClientError):
    """The server answered with an error status. message is the server's reason; code and param
    (where it gave them) name what was at fault."""

    status: int = 0

    def __init__(self, status: int, message: str, *, method: str, url: str, code: str | None = None,
                 param: str | None = None, type: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(f"{method} {url}: {status} {message}")
        self.status, self.message, self.method, self.url = status, message, method, url
        self.code, self.param, self.type, self.retry_after = code, param, type, retry_after


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class PermissionDenied(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    """409: the run is not in a state that allows it (ended, not waiting at that node, no trace)."""

    status = 409


class PayloadTooLarge(BadRequest):
    status = 413


class UnprocessableEntity(ApiError):
    """422: well-formed but refused (an input the wait_for schema rejects, a reused Idempotency-Key)."""

    status = 422


class RateLimited(ApiError):
    """429: over a server limit; retry_after says when to try again."""

    status = 429


class ServerError(ApiError):
    status = 500


class ServiceUnavailable(ServerError):
    """503: the model is still loading, or the server is shutting down."""

    status = 503


class RunNotEnded(ClientError):
    """The run has not ended, so it has no output yet."""


class RunFailed(ClientError):
    """The run ended without an output (failed or cancelled); run is its RunInfo."""

    def __init__(self, run: Any) -> None:
        where = f" at node '{run.error.node}'" if run.error is not None and run.error.node else ""
        why = f": {run.error.message}" if run.error is not None else ""
        super().__init__(f"run '{run.run_id}' {run.status}{where}{why}")
        self.run = run


class WaitTimedOut(ClientError, TimeoutError):
    """wait() gave up before the run ended; run is its RunInfo at that moment."""

    def __init__(self, run: Any, timeout_s: float) -> None:
        super().__init__(f"run '{run.run_id}' did not end within {timeout_s:g} s (status {run.status})")
        self.run = run


_BY_STATUS: dict[int, type[ApiError]] = {cls.status: cls for cls in (
    BadRequest, Unauthorized, PermissionDenied, NotFound, Conflict, PayloadTooLarge, UnprocessableEntity,
    RateLimited, ServerError, ServiceUnavailable)}


def api_error(status: int, text: str, *, method: str, url: str, retry_after: str | None = None) -> ApiError:
    """The error for an answer with this status and body; a body not in the error shape (a proxy's
    HTML page, say) becomes the message, cut short."""
    message, fields = text.strip()[:500] or f"HTTP {status}", {}
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message = str(err.get("message") or message)
        fields = {k: err.get(k) for k in ("code", "param", "type")}
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    try:
        after = float(retry_after) if retry_after is not None else None
    except ValueError:
        after = None
    error = cls(status, message, method=method, url=url, retry_after=after, **fields)
    error.status = status  # a status without a class of its own (405, 502) keeps its number
    return error
