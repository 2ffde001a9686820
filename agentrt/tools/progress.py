"""Progress of a running tool call: what an executor that hears of progress (an MCP server's
notifications/progress) reports, and where it reports it (the call's task-local listener, set
by ToolRegistry.call around the executor)."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ToolProgress:
    """A progress report from a running call: `progress` so far, of `total` when known, with the
    server's message; `time` is time.time()."""

    progress: float
    total: float | None
    message: str | None
    time: float


# The on_progress of the call running in this task: executors that hear of progress report it here.
CALL_PROGRESS: contextvars.ContextVar[Callable[[ToolProgress], None] | None] = contextvars.ContextVar(
    "agentrt_tool_call_progress", default=None)
