"""The programs API's bodies (pydantic v2), shared by the server that answers them and the client
that reads them, so the two cannot drift apart. Requests forbid unknown fields (a misspelt
parameter is a 400 naming it); responses ignore fields a newer server adds."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RunStatus = Literal["queued", "running", "waiting", "done", "failed", "cancelled"]
ENDED: tuple[str, ...] = ("done", "failed", "cancelled")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProgramInfo(BaseModel):
    name: str
    description: str
    input_schema: dict[str, Any]
    graph: dict[str, Any]
    tools: list[str]


class ProgramList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ProgramInfo]


class RunCreate(_Strict):
    inputs: dict[str, Any] = Field(default_factory=dict)
    priority: float | None = None  # added to the policy's priorities: smaller runs sooner
    metadata: dict[str, str] | None = None


class RunError(BaseModel):
    node: str | None
    message: str


class RunInput(_Strict):
    """The value a waiting wait_for node asked for (valid against its schema)."""

    value: Any


class InputWanted(BaseModel):
    node: str
    schema_: dict[str, Any] = Field(alias="schema")
    prompt: str | None = None

    model_config = {"populate_by_name": True}


class RunInfo(BaseModel):
    """A run as the API shows it. summary: while running, each node's state and phase; once
    ended, the summary `agentrt inspect --json` prints for the run's trace (its one run)."""

    run_id: str
    program: str
    status: RunStatus
    created_at: float  # unix seconds
    started_at: float | None = None
    ended_at: float | None = None
    duration_s: float | None = None
    inputs: dict[str, Any]
    metadata: dict[str, str] = Field(default_factory=dict)
    output: Any = None
    error: RunError | None = None
    waiting_for: list[InputWanted] = Field(default_factory=list)  # status waiting: what to POST to .../input/NODE
    summary: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self.status in ENDED


class RunList(BaseModel):
    object: Literal["list"] = "list"
    data: list[RunInfo]
    next_cursor: str | None = None


class RunCreated(BaseModel):
    run_id: str
    status: str
