"""A Python client of `agentrt serve`'s programs API, blocking (Client) and for asyncio
(AsyncClient): list programs, start a run (with an Idempotency-Key), follow its events (resumed
with Last-Event-ID), wait for its end, answer a wait_for node, cancel it, read its output,
summary and trace. Errors the server answers become typed exceptions (errors.py) carrying the
server's reason. It imports nothing of the runtime or the engine (no torch)."""
from agentrt.client._calls import RunEvent, StartedRun, split_run_url
from agentrt.client.aio import AsyncClient
from agentrt.client.errors import (ApiError, BadRequest, BadUrl, ClientError, Conflict, ConnectionFailed, NotFound,
                                   PayloadTooLarge, PermissionDenied, RateLimited, RunFailed, RunNotEnded, ServerError,
                                   ServiceUnavailable, Unauthorized, UnprocessableEntity, WaitTimedOut)
from agentrt.client.schemas import InputWanted, ProgramInfo, RunError, RunInfo, RunList
from agentrt.client.sync import Client

__all__ = ["ApiError", "AsyncClient", "BadRequest", "BadUrl", "Client", "ClientError", "Conflict", "ConnectionFailed",
           "InputWanted", "NotFound", "PayloadTooLarge", "PermissionDenied", "ProgramInfo", "RateLimited", "RunError",
           "RunEvent", "RunFailed", "RunInfo", "RunList", "RunNotEnded", "ServerError", "ServiceUnavailable",
           "StartedRun", "Unauthorized", "UnprocessableEntity", "WaitTimedOut", "split_run_url"]
