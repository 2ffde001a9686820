"""Errors the server answers with, in OpenAI's error shape:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with the right status (400 bad request, 401 no or wrong key, 404 unknown route/model/run/program,
413 body too large, 422 well-formed but unprocessable, 429 over a limit, 503 not ready, shutting
down, or the run store unavailable). Nothing else reaches a client: an unexpected exception is
logged and answered with a 500 that names no internals.
"""
from __future__ import annotations

from typing import Any

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def validation_message(exc: Any) -> tuple[str, str | None]:
    """A pydantic ValidationError as one message naming the field(s) at fault, and the first
    field's path (OpenAI's `param`)."""
    parts, first = [], None
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "(body)"
        first = first or loc
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = len(exc.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else ""), first
