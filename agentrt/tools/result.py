"""The outcome of one tool call, with per-attempt timing records for trace spans.

Times are wall-clock seconds (time.time()) so spans from workers on other machines line up.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentrt.tools.errors import ToolCallError


@dataclass(frozen=True)
class ToolAttempt:
    """One dispatch of a call to an executor. `worker` names the MQTT worker that ran it;
    `remote_started`/`remote_finished` are the worker's own clock around the function. A failed
    attempt that was tried again has `backoff_s`, the wait planned before the next attempt (0 for
    a lost call re-dispatched at once); the one that ended the call has `not_retried`, why not."""

    index: int
    executor: str
    started: float
    finished: float
    ok: bool
    error_kind: str | None = None
    error: str | None = None
    worker: str | None = None
    remote_started: float | None = None
    remote_finished: float | None = None
    backoff_s: float | None = None
    not_retried: str | None = None

    @property
    def duration_s(self) -> float:
        return self.finished - self.started


@dataclass(frozen=True)
class ToolResult:
    """ok: value holds the tool's JSON-compatible return value; otherwise error says why.
    queued: when call() was entered; started: first attempt's start (None if no attempt ran,
    e.g. invalid arguments); finished: when the result was decided."""

    call_id: str
    tool: str
    ok: bool
    value: Any
    error: ToolCallError | None
    attempts: tuple[ToolAttempt, ...]
    queued: float
    started: float | None
    finished: float

    @property
    def duration_s(self) -> float:
        return self.finished - self.queued

    def unwrap(self) -> Any:
        """The value, or raise the call's error."""
        if not self.ok:
            assert self.error is not None
            raise self.error
        return self.value

    def content(self) -> str:
        """What the model reads back: the value as JSON text (strings as they are), or the error."""
        if not self.ok:
            assert self.error is not None
            return json.dumps({"error": self.error.kind, "message": self.error.message})
        if isinstance(self.value, str):
            return self.value
        return json.dumps(self.value, ensure_ascii=False)
