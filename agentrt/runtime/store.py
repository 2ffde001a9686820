"""The SQLite run store, the default: program runs, every node's state changes and outputs, tool
attempts and run events in one SQLite file, kept durably so that a run outlives the process that
started it. The interface and its guarantees are in store_api.py (`RunStore`); store_postgres.py
keeps the same in PostgreSQL.

`SQLiteRunStore` uses the standard library's sqlite3: one connection, used from the event loop's
thread, each write its own transaction. WAL journal with synchronous=NORMAL: a committed write
survives the process being killed (kill -9, an out-of-memory kill); after a power loss the last
transactions may be lost. The schema is versioned in the file (PRAGMA user_version) and migrated
forward on open; a file from a newer agentrt, or one that is not a sound SQLite database, is
refused with an error naming it, and left as it is.

Resuming a run re-executes its program with what the store recorded: a node whose outcome is
recorded takes it instead of running (fan-out branches and loop steps get the same ids again,
since expansion depends only on recorded values); a node that was running when the process
stopped runs again (LLM nodes with the seed they recorded), unless it is a tool that is not
idempotent, which fails naming the node (`RecordedNodes`).
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable

from agentrt.runtime.store_api import (  # noqa: F401 - the store's names, importable from here as before
    ENDED, JSON_RUN_FIELDS, RUN_FIELDS, UNFINISHED, NodeChange, NullRunStore, RecordedNodes, RecordedOutcome, RunStore,
    StoredRun, StoreError, StoreUnavailable, ToolAttempt, args_hash, check_run_fields, doomed_runs, file_hash, to_json)
from agentrt.runtime.store_location import PostgresLocation, StoreLocation, store_location, store_path


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


class SQLiteRunStore:
    durable = True

    def __init__(self, path: str | Path) -> None:
        self.path = store_path(path, "run store") if isinstance(path, str) else path  # no postgresql:/ folder
        self.location = str(self.path)
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
        return _Transaction(self.db, self.location)

    def close(self) -> None:
        self.db.close()

    # -- runs --
    def create_run(self, run: StoredRun) -> None:
        row = [getattr(run, f) for f in RUN_FIELDS]
        row = [to_json(v) if f in JSON_RUN_FIELDS and v is not None else v for f, v in zip(RUN_FIELDS, row)]
        with self._tx():
            self.db.execute(f"INSERT INTO runs ({', '.join(RUN_FIELDS)}) VALUES ({', '.join('?' * len(row))})", row)

    def update_run(self, run_id: str, **fields: Any) -> None:
        check_run_fields(fields)
        cols = ", ".join(f"{k} = ?" for k in fields)
        vals = [to_json(v) if k in JSON_RUN_FIELDS and v is not None else v for k, v in fields.items()]
        with self._tx():
            self.db.execute(f"UPDATE runs SET {cols} WHERE run_id = ?", [*vals, run_id])

    def _run(self, row: tuple | None) -> StoredRun | None:
        if row is None:
            return None
        values = {f: (json.loads(v) if f in JSON_RUN_FIELDS and v is not None else v) for f, v in zip(RUN_FIELDS, row)}
        return StoredRun(**values)

    def get_run(self, run_id: str) -> StoredRun | None:
        return self._run(self.db.execute(f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE run_id = ?",
                                         (run_id,)).fetchone())

    def run_by_key(self, idempotency_key: str) -> StoredRun | None:
        return self._run(self.db.execute(f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE idempotency_key = ?",
                                         (idempotency_key,)).fetchone())

    def runs(self, statuses: Iterable[str] | None = None) -> list[StoredRun]:
        """Runs in creation order, all or those with one of these statuses."""
        sql = f"SELECT {', '.join(RUN_FIELDS)} FROM runs"
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
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO tool_attempts (run_id, node, attempt, status, args_hash, started, "
                            "finished, error_kind, error, backoff_s, not_retried) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (run_id, node, attempt, status, args_hash, started, finished, error_kind, error,
                             backoff_s, not_retried))

    def node_changes(self, run_id: str) -> list[NodeChange]:
        cur = self.db.execute("SELECT node, kind, state, time, value, error, error_type, seed, args_hash, sent "
                              "FROM node_changes WHERE run_id = ? ORDER BY seq", (run_id,))
        return [NodeChange(node, kind, state, at, None if value is None else json.loads(value), error, error_type,
                           seed, digest, json.loads(sent) if sent else None)
                for node, kind, state, at, value, error, error_type, seed, digest, sent in cur]

    def tool_attempts(self, run_id: str) -> list[ToolAttempt]:
        return [ToolAttempt(*row) for row in self.db.execute(
            "SELECT node, attempt, status, args_hash, started, finished, error_kind, error, backoff_s, not_retried "
            "FROM tool_attempts WHERE run_id = ? ORDER BY rowid", (run_id,))]

    def recorded(self, run_id: str) -> RecordedNodes:
        return RecordedNodes.from_changes(self.node_changes(run_id))

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
        ended = self.db.execute(f"SELECT run_id, ended_at FROM runs WHERE status IN ({', '.join('?' * len(ENDED))}) "
                                "ORDER BY ended_at DESC, rowid DESC", ENDED).fetchall()
        doomed = doomed_runs(ended, older_than_s=older_than_s, keep=keep)
        with self._tx():
            for run_id in doomed:
                self.db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
        return doomed


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): each write is durable when it returns. A
    write the file cannot take now (disk full, locked past the busy timeout, an I/O error) raises
    StoreUnavailable: nothing of it was recorded."""

    def __init__(self, db: sqlite3.Connection, location: str) -> None:
        self.db, self.location = db, location

    def __enter__(self) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise StoreUnavailable(f"run store {self.location} cannot be written now ({e})") from None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        except sqlite3.OperationalError as e:
            if exc_type is None:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise StoreUnavailable(f"run store {self.location} cannot be written now ({e})") from None
        if exc_type is sqlite3.OperationalError:
            raise StoreUnavailable(f"run store {self.location} cannot be written now ({exc})") from None


def open_store(location: StoreLocation | str) -> RunStore:
    """Open the run store at `location` (what --db gave): StoreError when it cannot be used."""
    if isinstance(location, str):
        location = store_location(location)
    if isinstance(location, PostgresLocation):
        from agentrt.runtime.store_postgres import PostgresRunStore  # psycopg only for PostgreSQL

        return PostgresRunStore(location.url)
    return SQLiteRunStore(location)
