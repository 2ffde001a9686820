"""The run store's interface and records, shared by its two implementations: `SQLiteRunStore`
(store.py, one file, the default) and `PostgresRunStore` (store_postgres.py, a PostgreSQL
database several machines can reach).

Both give the same guarantees, proven by the same tests run against each:
- a write is committed before the call returns, so the server acknowledges only what is durable;
- a node's outcome is recorded at most once (a second one raises StoreError), so a resumed run
  takes finished nodes from the store and never runs them again;
- runs come back in creation order, node changes and tool attempts in the order they were
  recorded, run events by their id (the id a client read, so Last-Event-ID goes on across
  restarts), and a run's Idempotency-Key finds it after a restart;
- the schema is versioned in the store and migrated forward when opened; a store written by a
  newer agentrt is refused, with an error naming it, and left as it is.

A store raises `StoreUnavailable` when its database cannot be reached (PostgreSQL restarting,
the network gone): the write was not recorded, and the server answers 503 with the reason.

Without a database, `NullRunStore` stands in: it records nothing and finds nothing (`durable` is
False), so the runtime, the server and the CLI write through a store whether or not there is one.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

from agentrt.errors import AgentRTError

UNFINISHED = ("queued", "running", "waiting")
ENDED = ("done", "failed", "cancelled")
RUN_FIELDS = ("run_id", "program", "program_hash", "inputs", "status", "created_at", "started_at", "ended_at",
              "idempotency_key", "request_digest", "priority", "metadata", "output", "error", "origin")
JSON_RUN_FIELDS = frozenset({"inputs", "metadata", "output", "error"})


class StoreError(AgentRTError):
    """The run store cannot be used: a corrupt file, one from a newer version, a write refused."""


class StoreUnavailable(StoreError):
    """The store's database cannot be reached now (a write was not recorded); it may come back."""


def to_json(value: Any) -> str:
    """Values as the store keeps them: JSON, with anything JSON cannot hold as its repr."""
    return json.dumps(value, default=repr, separators=(",", ":"))


def json_text(value: Any) -> str:
    """JSON as PostgreSQL's json type takes it: a non-finite float (which JSON cannot hold and
    PostgreSQL refuses) is kept as its name, "nan", "inf" or "-inf"."""
    try:
        return to_json(_finite(value)) if _has_non_finite(value) else to_json(value)
    except RecursionError:  # a value nested past what the walk can follow: as the SQLite store keeps it
        return to_json(value)


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_non_finite(v) for v in value)
    return False


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def args_hash(args: Any) -> str:
    return hashlib.sha256(json.dumps(args, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def file_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class StoredRun:
    run_id: str
    program: str
    program_hash: str
    inputs: dict[str, Any]
    status: str = "queued"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    idempotency_key: str | None = None
    request_digest: str | None = None
    priority: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    output: Any = None
    error: dict[str, Any] | None = None
    origin: str = "serve"  # serve | cli


@dataclass(frozen=True)
class NodeChange:
    """One recorded state change of a node: "running" when it started, "ok"/"error" when it ended."""

    node: str
    kind: str
    state: str
    time: float
    value: Any = None  # the output of an "ok" node
    error: str | None = None
    error_type: str | None = None
    seed: int | None = None  # the sampling seed of a started LLM node
    args_hash: str | None = None  # the arguments of a started tool node
    sent: list[dict[str, Any]] | None = None  # the messages an LLM node sent


@dataclass(frozen=True)
class ToolAttempt:
    """One attempt of a tool call as it ended ("finished" or "failed")."""

    node: str
    attempt: int
    status: str
    args_hash: str | None = None
    started: float | None = None
    finished: float | None = None
    error_kind: str | None = None
    error: str | None = None
    backoff_s: float | None = None  # the wait before the next attempt
    not_retried: str | None = None  # why the last failed attempt ended the call


@dataclass(frozen=True)
class RecordedOutcome:
    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    sent: list[dict[str, Any]] | None = None  # the messages an LLM node sent, when a later call continues it


@dataclass
class RecordedNodes:
    """What the store recorded of a run's nodes, replayed from its node changes: what a resumed
    run takes instead of running them again."""

    outcomes: dict[str, RecordedOutcome] = field(default_factory=dict)  # finished nodes
    interrupted: set[str] = field(default_factory=set)  # running when the process stopped
    seeds: dict[str, int] = field(default_factory=dict)  # LLM node -> the sampling seed it used

    @classmethod
    def from_changes(cls, changes: Iterable[NodeChange]) -> RecordedNodes:
        """Replay a run's node changes in the order they were recorded."""
        rec = cls()
        for ch in changes:
            if ch.state == "running":
                rec.interrupted.add(ch.node)
                if ch.seed is not None:
                    rec.seeds[ch.node] = ch.seed
            else:
                rec.interrupted.discard(ch.node)
                ok = ch.state == "ok"
                rec.outcomes[ch.node] = RecordedOutcome(ok, ch.value if ok else None, ch.error, ch.error_type,
                                                        ch.sent or None)
        return rec


@runtime_checkable
class RunStore(Protocol):
    """What the runtime, the server and the CLI write runs through."""

    location: str  # where the runs are, as a message may show it (a PostgreSQL URL without its password)
    durable: bool  # whether what is written outlives the process (False: NullRunStore)

    def create_run(self, run: StoredRun) -> None: ...
    def update_run(self, run_id: str, **fields: Any) -> None: ...
    def get_run(self, run_id: str) -> StoredRun | None: ...
    def run_by_key(self, idempotency_key: str) -> StoredRun | None: ...
    def runs(self, statuses: Iterable[str] | None = None) -> list[StoredRun]: ...
    def node_started(self, run_id: str, node: str, kind: str, *, seed: int | None = None,
                     args_hash: str | None = None) -> None: ...
    def node_finished(self, run_id: str, node: str, kind: str, ok: bool, value: Any = None,
                      error: str | None = None, error_type: str | None = None, sent: Any = None) -> None: ...
    def tool_attempt(self, run_id: str, node: str, attempt: int, status: str, *, args_hash: str | None = None,
                     started: float | None = None, finished: float | None = None, error_kind: str | None = None,
                     error: str | None = None, backoff_s: float | None = None,
                     not_retried: str | None = None) -> None:
        """One attempt of a tool call as it ended: "finished" or "failed"; a failed one tried
        again has backoff_s (the wait before the next), the one that ended the call not_retried
        (an attempt recorded again replaces the first)."""

    def node_changes(self, run_id: str) -> list[NodeChange]: ...
    def tool_attempts(self, run_id: str) -> list[ToolAttempt]: ...
    def recorded(self, run_id: str) -> RecordedNodes: ...
    def add_event(self, run_id: str, event_id: int, type: str, data: Any) -> None: ...
    def events(self, run_id: str) -> list[tuple[int, str, dict[str, Any]]]: ...
    def prune(self, *, older_than_s: float | None = None, keep: int | None = None) -> list[str]: ...
    def close(self) -> None: ...


class NullRunStore:
    """The store of a server or `agentrt run` without --db: it records nothing and finds nothing,
    so runs live only in the process's memory. Callers write through it as through a real store;
    `durable` tells them where behaviour differs (a run stopped at shutdown cannot be resumed)."""

    location = "memory only"
    durable = False
    supports_leases = False

    def create_run(self, run: StoredRun) -> None:
        pass

    def update_run(self, run_id: str, **fields: Any) -> None:
        pass

    def get_run(self, run_id: str) -> StoredRun | None:
        return None

    def run_by_key(self, idempotency_key: str) -> StoredRun | None:
        return None

    def runs(self, statuses: Iterable[str] | None = None) -> list[StoredRun]:
        return []

    def node_started(self, run_id: str, node: str, kind: str, *, seed: int | None = None,
                     args_hash: str | None = None) -> None:
        pass

    def node_finished(self, run_id: str, node: str, kind: str, ok: bool, value: Any = None,
                      error: str | None = None, error_type: str | None = None, sent: Any = None) -> None:
        pass

    def tool_attempt(self, run_id: str, node: str, attempt: int, status: str, **fields: Any) -> None:
        pass

    def node_changes(self, run_id: str) -> list[NodeChange]:
        return []

    def tool_attempts(self, run_id: str) -> list[ToolAttempt]:
        return []

    def recorded(self, run_id: str) -> RecordedNodes:
        return RecordedNodes()

    def add_event(self, run_id: str, event_id: int, type: str, data: Any) -> None:
        pass

    def events(self, run_id: str) -> list[tuple[int, str, dict[str, Any]]]:
        return []

    def prune(self, *, older_than_s: float | None = None, keep: int | None = None) -> list[str]:
        return []

    def close(self) -> None:
        pass


def check_run_fields(fields: Iterable[str]) -> None:
    bad = set(fields) - set(RUN_FIELDS)
    if bad:
        raise StoreError(f"update_run: unknown field(s) {sorted(bad)}")


def doomed_runs(ended: list[tuple[str, float | None]], *, older_than_s: float | None, keep: int | None) -> list[str]:
    """Retention: of the ended runs (run_id, ended_at), newest first, those to delete."""
    doomed: list[str] = []
    if keep is not None:
        doomed += [run_id for run_id, _ in ended[keep:]]
    if older_than_s is not None:
        cutoff = time.time() - older_than_s
        doomed += [run_id for run_id, ended_at in ended if ended_at is not None and ended_at < cutoff]
    return list(dict.fromkeys(doomed))
