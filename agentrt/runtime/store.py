"""The run store: program runs, every node's state changes and outputs, tool attempts and run
events, kept durably so that a run outlives the process that started it.

`RunStore` is the interface the runtime and the server write through; `SQLiteRunStore` keeps it
in one SQLite file (the standard library's sqlite3: one connection, used from the event loop's
thread, each write its own transaction). WAL journal with synchronous=NORMAL: a committed write
survives the process being killed (kill -9, an out-of-memory kill); after a power loss the last
transactions may be lost. The schema is versioned in the file (PRAGMA user_version) and migrated
forward on open; a file from a newer agentrt, or one that is not a sound SQLite database, is
refused with an error naming it, and left as it is.

Resuming a run re-executes its program with what the store recorded: a node whose outcome is
recorded takes it instead of running (fan-out branches and loop steps get the same ids again,
since expansion depends only on recorded values); a node that was running when the process
stopped runs again (LLM nodes with the seed they recorded), unless it is a tool that is not
idempotent, which fails naming the node (`Recorded`).
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from agentrt.errors import AgentRTError
from agentrt.runtime.store_location import store_path


class StoreError(AgentRTError):
    """The run store cannot be used: a corrupt file, one from a newer version, a write refused."""


SCHEMA_VERSION = 2
MIGRATIONS: dict[int, list[str]] = {  # version -> the statements that reach it from the one before
    1: [
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, program TEXT NOT NULL, program_hash TEXT NOT NULL,
            inputs TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL,
            started_at REAL, ended_at REAL, idempotency_key TEXT UNIQUE, request_digest TEXT,
            priority REAL NOT NULL DEFAULT 0, metadata TEXT NOT NULL DEFAULT '{}',
            output TEXT, error TEXT, origin TEXT NOT NULL DEFAULT 'serve')""",
        "CREATE INDEX runs_status ON runs(status, created_at)",
        """CREATE TABLE node_changes (
            run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE, seq INTEGER PRIMARY KEY,
            node TEXT NOT NULL, kind TEXT NOT NULL, state TEXT NOT NULL, time REAL NOT NULL,
            value TEXT, error TEXT, error_type TEXT, seed INTEGER, args_hash TEXT, sent TEXT)""",
        # each node's outcome is recorded exactly once (a second one is a bug: refuse it)
        "CREATE UNIQUE INDEX node_outcome ON node_changes(run_id, node) WHERE state IN ('ok', 'error')",
        "CREATE INDEX node_changes_run ON node_changes(run_id, seq)",
        """CREATE TABLE tool_attempts (
            run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE, node TEXT NOT NULL,
            attempt INTEGER NOT NULL, status TEXT NOT NULL, args_hash TEXT, started REAL, finished REAL,
            error_kind TEXT, error TEXT, PRIMARY KEY (run_id, node, attempt, status))""",
        """CREATE TABLE run_events (
            run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE, id INTEGER NOT NULL,
            type TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (run_id, id))""",
    ],
    2: [  # why each failed tool attempt was, or was not, tried again
        "ALTER TABLE tool_attempts ADD COLUMN backoff_s REAL",  # the wait before the next attempt
        "ALTER TABLE tool_attempts ADD COLUMN not_retried TEXT",  # why the last failed attempt ended the call
    ],
}
UNFINISHED = ("queued", "running", "waiting")
ENDED = ("done", "failed", "cancelled")


def to_json(value: Any) -> str:
    """Values as the store keeps them: JSON, with anything JSON cannot hold as its repr."""
    return json.dumps(value, default=repr, separators=(",", ":"))


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
class RecordedOutcome:
    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    sent: list[dict[str, Any]] | None = None  # the messages an LLM node sent, when a later call continues it


@dataclass
class Recorded:
    """What a resumed run takes from the store."""

    outcomes: dict[str, RecordedOutcome] = field(default_factory=dict)  # finished nodes
    interrupted: set[str] = field(default_factory=set)  # running when the process stopped
    seeds: dict[str, int] = field(default_factory=dict)  # LLM node -> the sampling seed it used


class RunStore(Protocol):
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
                     not_retried: str | None = None) -> None: ...
    def recorded(self, run_id: str) -> Recorded: ...
    def add_event(self, run_id: str, event_id: int, type: str, data: Any) -> None: ...
    def events(self, run_id: str) -> list[tuple[int, str, dict[str, Any]]]: ...
    def prune(self, *, older_than_s: float | None = None, keep: int | None = None) -> list[str]: ...
    def close(self) -> None: ...


_RUN_FIELDS = ("run_id", "program", "program_hash", "inputs", "status", "created_at", "started_at", "ended_at",
               "idempotency_key", "request_digest", "priority", "metadata", "output", "error", "origin")
_JSON_FIELDS = {"inputs", "metadata", "output", "error"}


class SQLiteRunStore:
    def __init__(self, path: str | Path) -> None:
        self.path = store_path(path, "run store") if isinstance(path, str) else path  # no postgresql:/ folder
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None)  # autocommit: explicit transactions
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                self.db.close()
                raise StoreError(f"run store {self.path} was written by a newer agentrt (schema version {version}, "
                                 f"this one knows up to {SCHEMA_VERSION}); refusing to open it, nothing was changed")
            if version and self.db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                self.db.close()
                raise StoreError(f"run store {self.path} is corrupt (sqlite quick_check failed); "
                                 "refusing to open it, nothing was changed")
        except sqlite3.DatabaseError as e:
            raise StoreError(f"run store {self.path} is not a readable SQLite database ({e}); "
                             "refusing to open it, nothing was changed") from None
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self._migrate(version)

    def _migrate(self, version: int) -> None:
        for v in range(version + 1, SCHEMA_VERSION + 1):
            with self._tx():
                for sql in MIGRATIONS[v]:
                    self.db.execute(sql)
                self.db.execute(f"PRAGMA user_version={v}")

    def _tx(self):
        return _Transaction(self.db)

    def close(self) -> None:
        self.db.close()

    # -- runs --
    def create_run(self, run: StoredRun) -> None:
        row = [getattr(run, f) for f in _RUN_FIELDS]
        row = [to_json(v) if f in _JSON_FIELDS and v is not None else v for f, v in zip(_RUN_FIELDS, row)]
        with self._tx():
            self.db.execute(f"INSERT INTO runs ({', '.join(_RUN_FIELDS)}) VALUES ({', '.join('?' * len(row))})", row)

    def update_run(self, run_id: str, **fields: Any) -> None:
        bad = set(fields) - set(_RUN_FIELDS)
        if bad:
            raise StoreError(f"update_run: unknown field(s) {sorted(bad)}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        vals = [to_json(v) if k in _JSON_FIELDS and v is not None else v for k, v in fields.items()]
        with self._tx():
            self.db.execute(f"UPDATE runs SET {cols} WHERE run_id = ?", [*vals, run_id])

    def _run(self, row: tuple | None) -> StoredRun | None:
        if row is None:
            return None
        values = {f: (json.loads(v) if f in _JSON_FIELDS and v is not None else v) for f, v in zip(_RUN_FIELDS, row)}
        return StoredRun(**values)

    def get_run(self, run_id: str) -> StoredRun | None:
        return self._run(self.db.execute(f"SELECT {', '.join(_RUN_FIELDS)} FROM runs WHERE run_id = ?",
                                         (run_id,)).fetchone())

    def run_by_key(self, idempotency_key: str) -> StoredRun | None:
        return self._run(self.db.execute(f"SELECT {', '.join(_RUN_FIELDS)} FROM runs WHERE idempotency_key = ?",
                                         (idempotency_key,)).fetchone())

    def runs(self, statuses: Iterable[str] | None = None) -> list[StoredRun]:
        """Runs in creation order, all or those with one of these statuses."""
        sql = f"SELECT {', '.join(_RUN_FIELDS)} FROM runs"
        args: list[Any] = []
        if statuses is not None:
            statuses = list(statuses)
            sql += f" WHERE status IN ({', '.join('?' * len(statuses))})"
            args = statuses
        return [self._run(r) for r in self.db.execute(sql + " ORDER BY created_at, rowid", args)]

    # -- nodes --
    def node_started(self, run_id: str, node: str, kind: str, *, seed: int | None = None,
                     args_hash: str | None = None) -> None:
        with self._tx():
            self.db.execute("INSERT INTO node_changes (run_id, node, kind, state, time, seed, args_hash) "
                            "VALUES (?, ?, ?, 'running', ?, ?, ?)", (run_id, node, kind, time.time(), seed, args_hash))

    def node_finished(self, run_id: str, node: str, kind: str, ok: bool, value: Any = None,
                      error: str | None = None, error_type: str | None = None, sent: Any = None) -> None:
        try:
            with self._tx():
                self.db.execute("INSERT INTO node_changes (run_id, node, kind, state, time, value, error, error_type, "
                                "sent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                (run_id, node, kind, "ok" if ok else "error", time.time(),
                                 to_json(value) if ok else None, error, error_type,
                                 None if sent is None else to_json(list(sent))))
        except sqlite3.IntegrityError:
            raise StoreError(f"run {run_id}: node {node} already has a recorded outcome") from None

    def tool_attempt(self, run_id: str, node: str, attempt: int, status: str, *, args_hash: str | None = None,
                     started: float | None = None, finished: float | None = None, error_kind: str | None = None,
                     error: str | None = None, backoff_s: float | None = None,
                     not_retried: str | None = None) -> None:
        """One attempt of a tool call as it ended: "finished" or "failed"; a failed one tried
        again has backoff_s (the wait before the next), the one that ended the call not_retried."""
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO tool_attempts (run_id, node, attempt, status, args_hash, started, "
                            "finished, error_kind, error, backoff_s, not_retried) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (run_id, node, attempt, status, args_hash, started, finished, error_kind, error,
                             backoff_s, not_retried))

    def node_changes(self, run_id: str) -> list[dict[str, Any]]:
        cur = self.db.execute("SELECT node, kind, state, time, value, error, error_type, seed, args_hash, sent "
                              "FROM node_changes WHERE run_id = ? ORDER BY seq", (run_id,))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]

    def tool_attempts(self, run_id: str) -> list[dict[str, Any]]:
        cur = self.db.execute("SELECT node, attempt, status, args_hash, started, finished, error_kind, error, "
                              "backoff_s, not_retried FROM tool_attempts WHERE run_id = ? ORDER BY rowid", (run_id,))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]

    def recorded(self, run_id: str) -> Recorded:
        rec = Recorded()
        for ch in self.node_changes(run_id):
            node = ch["node"]
            if ch["state"] == "running":
                rec.interrupted.add(node)
                if ch["seed"] is not None:
                    rec.seeds[node] = ch["seed"]
            else:
                rec.interrupted.discard(node)
                ok = ch["state"] == "ok"
                rec.outcomes[node] = RecordedOutcome(ok, json.loads(ch["value"]) if ok else None, ch["error"],
                                                     ch["error_type"], json.loads(ch["sent"]) if ch["sent"] else None)
        return rec

    # -- events --
    def add_event(self, run_id: str, event_id: int, type: str, data: Any) -> None:
        with self._tx():
            self.db.execute("INSERT INTO run_events VALUES (?, ?, ?, ?)", (run_id, event_id, type, to_json(data)))

    def events(self, run_id: str) -> list[tuple[int, str, dict[str, Any]]]:
        return [(i, t, json.loads(d)) for i, t, d in
                self.db.execute("SELECT id, type, data FROM run_events WHERE run_id = ? ORDER BY id", (run_id,))]

    # -- retention --
    def prune(self, *, older_than_s: float | None = None, keep: int | None = None) -> list[str]:
        """Delete ended runs (with their nodes, attempts and events) that ended more than
        older_than_s ago, and beyond the newest `keep` ended runs; never a queued or running run.
        Returns the deleted run ids."""
        ended = [r[0] for r in self.db.execute(
            f"SELECT run_id, ended_at FROM runs WHERE status IN ({', '.join('?' * len(ENDED))}) "
            "ORDER BY ended_at DESC, rowid DESC", ENDED)]
        doomed: list[str] = []
        if keep is not None:
            doomed += ended[keep:]
        if older_than_s is not None:
            cutoff = time.time() - older_than_s
            doomed += [r[0] for r in self.db.execute(
                f"SELECT run_id FROM runs WHERE status IN ({', '.join('?' * len(ENDED))}) AND ended_at < ?",
                (*ENDED, cutoff))]
        doomed = list(dict.fromkeys(doomed))
        with self._tx():
            for run_id in doomed:
                self.db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
        return doomed


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): each write is durable when it returns."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
