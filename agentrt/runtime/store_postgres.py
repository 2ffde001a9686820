"""The PostgreSQL run store: the same runs, node changes, tool attempts and run events as the
SQLite store (store_api.py has the interface and the guarantees both keep), in a database that
outlives the machine a server runs on.

psycopg 3 with a connection pool (psycopg_pool): each write is one transaction, committed before
the call returns (synchronous_commit as the server is configured: on by default, so an
acknowledged write survives PostgreSQL crashing too). A pooled connection is checked before use,
so after PostgreSQL restarts the next call reconnects instead of failing on a dead connection.
A call made while the database cannot be reached raises StoreUnavailable (the server answers 503
with the reason); nothing of it was recorded. After such a failure each call first tries one plain
connection: refused at once while PostgreSQL is down (no wait in the pool's reconnect backoff),
and once it succeeds the pool is opened afresh, so the store works again as soon as the database
answers.

The calls block, like the SQLite store's: the runtime and the server make them from the event
loop's thread, one at a time, so a write is ordered before the next event is handed out. Event
ids come from the caller (a run's numbered log), node changes, tool attempts and runs get a
sequence number from an identity column, so every listing comes back in the order written.

Documents: values that are replayed (inputs, outputs, node values, the messages an LLM node sent,
event data) are `json`, which keeps the text as written (key order: a value replayed into a
prompt must read the same); run metadata and errors, which are queried, are `jsonb`.

The schema is versioned in a `schema_version` table and migrated forward when the store opens,
all steps in one transaction under an advisory lock (two servers starting at once migrate once);
a database written by a newer agentrt is refused and left as it is. The tables live in the
connection's search_path: give a dedicated database, or ?options=-csearch_path%3Dagentrt.
Version 2 adds run ownership for several server replicas on one database (store_leases.py: each
unfinished run's owner and lease, the replicas, inputs forwarded to a run's owner).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from agentrt.runtime.store_api import (ENDED, RUN_FIELDS, NodeChange, RecordedNodes, StoredRun, StoreError,
                                       StoreUnavailable, ToolAttempt, check_run_fields, doomed_runs, json_text)
from agentrt.runtime.store_leases import LEASE_MIGRATION, LeaseStore
from agentrt.runtime.store_location import redact_url

SCHEMA_VERSION = 2
MIGRATIONS: dict[int, list[str]] = {  # version -> the statements that reach it from the one before
    1: [
        # seq orders runs created in the same instant
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, seq BIGINT GENERATED ALWAYS AS IDENTITY, program TEXT NOT NULL,
            program_hash TEXT NOT NULL, inputs JSON NOT NULL, status TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL, started_at DOUBLE PRECISION, ended_at DOUBLE PRECISION,
            idempotency_key TEXT UNIQUE, request_digest TEXT, priority DOUBLE PRECISION NOT NULL DEFAULT 0,
            metadata JSONB NOT NULL DEFAULT '{}', output JSON, error JSONB, origin TEXT NOT NULL DEFAULT 'serve')""",
        "CREATE INDEX runs_status ON runs (status, created_at, seq)",
        """CREATE TABLE node_changes (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE, node TEXT NOT NULL, kind TEXT NOT NULL,
            state TEXT NOT NULL, time DOUBLE PRECISION NOT NULL, value JSON, error TEXT, error_type TEXT,
            seed BIGINT, args_hash TEXT, sent JSON)""",
        # each node's outcome is recorded exactly once (a second one is a bug: refuse it)
        "CREATE UNIQUE INDEX node_outcome ON node_changes (run_id, node) WHERE state IN ('ok', 'error')",
        "CREATE INDEX node_changes_run ON node_changes (run_id, seq)",
        """CREATE TABLE tool_attempts (
            seq BIGINT GENERATED ALWAYS AS IDENTITY,
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE, node TEXT NOT NULL,
            attempt INTEGER NOT NULL, status TEXT NOT NULL, args_hash TEXT, started DOUBLE PRECISION,
            finished DOUBLE PRECISION, error_kind TEXT, error TEXT, backoff_s DOUBLE PRECISION, not_retried TEXT,
            PRIMARY KEY (run_id, node, attempt, status))""",
        """CREATE TABLE run_events (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE, id BIGINT NOT NULL,
            type TEXT NOT NULL, data JSON NOT NULL, PRIMARY KEY (run_id, id))""",
    ],
    2: LEASE_MIGRATION,  # replicas: each unfinished run's owner and lease expiry (store_leases.py)
}
_MIGRATION_LOCK = 0x61677274  # pg_advisory_xact_lock key ("agrt"): one migrating opener at a time
_CASTS = {"inputs": "json", "output": "json", "metadata": "jsonb", "error": "jsonb"}
_TOOL_ATTEMPT_FIELDS = ("node", "attempt", "status", "args_hash", "started", "finished", "error_kind", "error",
                        "backoff_s", "not_retried")


class PostgresRunStore(LeaseStore):
    durable = True

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0, wait_s: float = 3.0,
                 max_connections: int = 4) -> None:
        """Connect, migrate the schema, open the pool. StoreUnavailable naming the URL (without
        its password) when the database cannot be reached; StoreError when it holds a newer schema."""
        self.url, self.location = url, redact_url(url)
        options = {"application_name": "agentrt"}
        if "connect_timeout" not in conninfo_to_dict(url):
            options["connect_timeout"] = str(max(1, round(connect_timeout_s)))
        self.conninfo = make_conninfo(url, **options)
        self.connect_timeout_s, self.wait_s, self.max_connections = connect_timeout_s, wait_s, max_connections
        try:  # one plain connection first: its error says why (refused, no such database, authentication)
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                self._migrate(conn)
        except psycopg.OperationalError as e:
            raise StoreUnavailable(f"run store {self.location} cannot be reached: {self._reason(e)}") from None
        self.pool = self._open_pool()
        self._down = False  # a call failed for want of the database: the next one checks it first

    def _open_pool(self) -> ConnectionPool:
        pool = ConnectionPool(self.conninfo, min_size=1, max_size=self.max_connections, open=False,
                              timeout=self.wait_s, check=ConnectionPool.check_connection, name="agentrt-run-store")
        pool.open(wait=True, timeout=self.connect_timeout_s)
        return pool

    def _reopen(self) -> None:
        """After an outage: StoreUnavailable at once if the database still does not answer, else
        a fresh pool (the old one may be waiting out its reconnect backoff)."""
        try:
            psycopg.connect(self.conninfo).close()
            pool = self._open_pool()
        except psycopg.OperationalError as e:
            raise StoreUnavailable(f"run store {self.location} is unavailable ({self._reason(e)}); "
                                   "nothing was recorded") from None
        old, self.pool, self._down = self.pool, pool, False
        old.close(timeout=1.0)

    def _reason(self, e: Exception) -> str:
        text = " ".join(str(e).split())
        password = conninfo_to_dict(self.url).get("password")
        return text.replace(password, "***") if password else text

    def _migrate(self, conn: psycopg.Connection) -> None:
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                             "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
                version = conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreError(f"run store {self.location} was written by a newer agentrt (schema version "
                                     f"{version}, this one knows up to {SCHEMA_VERSION}); refusing to open it, "
                                     "nothing was changed")
                for v in range(version + 1, SCHEMA_VERSION + 1):
                    for sql in MIGRATIONS[v]:
                        conn.execute(sql)
                    conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (v,))
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            raise StoreError(f"run store {self.location}: cannot create or migrate its tables ({self._reason(e)}); "
                             "nothing was changed") from None

    def schema_version(self) -> int:
        with self._conn() as conn:
            return conn.execute("SELECT max(version) FROM schema_version").fetchone()[0]

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection]:
        """A pooled connection in one transaction, committed when the block ends."""
        if self._down:
            self._reopen()
        try:
            with self.pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as e:  # the pool's timeout (PoolTimeout) included
            self._down = True
            raise StoreUnavailable(f"run store {self.location} is unavailable ({self._reason(e)}); "
                                   "nothing was recorded") from None

    def _execute(self, sql: str, params: Iterable[Any] = (), *, run_id: str | None = None) -> None:
        """One write in one transaction; a write of a run (run_id) is fenced when this store
        serves a replica: refused if another replica owns the run now (store_leases.py)."""
        with self._conn() as conn:
            if run_id is not None and self.fence_owner is not None:
                self._check_owner(conn, run_id)
            conn.execute(sql, tuple(params))

    def _fetch(self, sql: str, params: Iterable[Any] = ()) -> list[tuple]:
        with self._conn() as conn:
            return conn.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        self.pool.close()

    # -- runs --
    def create_run(self, run: StoredRun) -> None:
        with self._conn() as conn:
            self._insert_run(conn, run)

    def _insert_run(self, conn: psycopg.Connection, run: StoredRun) -> None:
        values = [self._param(f, getattr(run, f)) for f in RUN_FIELDS]
        marks = ", ".join(self._mark(f) for f in RUN_FIELDS)
        conn.execute(f"INSERT INTO runs ({', '.join(RUN_FIELDS)}) VALUES ({marks})", values)

    def update_run(self, run_id: str, **fields: Any) -> None:
        check_run_fields(fields)
        cols = ", ".join(f"{k} = {self._mark(k)}" for k in fields)
        self._execute(f"UPDATE runs SET {cols} WHERE run_id = %s",
                      [*(self._param(k, v) for k, v in fields.items()), run_id], run_id=run_id)

    @staticmethod
    def _mark(field: str) -> str:
        return f"%s::{_CASTS[field]}" if field in _CASTS else "%s"

    @staticmethod
    def _param(field: str, value: Any) -> Any:
        return json_text(value) if field in _CASTS and value is not None else value

    def _select_runs(self, where: str = "", params: Iterable[Any] = ()) -> list[StoredRun]:
        rows = self._fetch(f"SELECT {', '.join(RUN_FIELDS)} FROM runs {where} ORDER BY created_at, seq", params)
        return [StoredRun(**dict(zip(RUN_FIELDS, row))) for row in rows]

    def get_run(self, run_id: str) -> StoredRun | None:
        found = self._select_runs("WHERE run_id = %s", (run_id,))
        return found[0] if found else None

    def run_by_key(self, idempotency_key: str) -> StoredRun | None:
        found = self._select_runs("WHERE idempotency_key = %s", (idempotency_key,))
        return found[0] if found else None

    def runs(self, statuses: Iterable[str] | None = None) -> list[StoredRun]:
        """Runs in creation order, all or those with one of these statuses."""
        if statuses is None:
            return self._select_runs()
        return self._select_runs("WHERE status = ANY(%s)", (list(statuses),))

    # -- nodes --
    def node_started(self, run_id: str, node: str, kind: str, *, seed: int | None = None,
                     args_hash: str | None = None) -> None:
        self._execute("INSERT INTO node_changes (run_id, node, kind, state, time, seed, args_hash) "
                      "VALUES (%s, %s, %s, 'running', %s, %s, %s)", (run_id, node, kind, time.time(), seed, args_hash),
                      run_id=run_id)

    def node_finished(self, run_id: str, node: str, kind: str, ok: bool, value: Any = None,
                      error: str | None = None, error_type: str | None = None, sent: Any = None) -> None:
        try:
            self._execute("INSERT INTO node_changes (run_id, node, kind, state, time, value, error, error_type, sent) "
                          "VALUES (%s, %s, %s, %s, %s, %s::json, %s, %s, %s::json)",
                          (run_id, node, kind, "ok" if ok else "error", time.time(), json_text(value) if ok else None, error,
                           error_type, None if sent is None else json_text(list(sent))), run_id=run_id)
        except psycopg.errors.UniqueViolation:
            raise StoreError(f"run {run_id}: node {node} already has a recorded outcome") from None

    def tool_attempt(self, run_id: str, node: str, attempt: int, status: str, *, args_hash: str | None = None,
                     started: float | None = None, finished: float | None = None, error_kind: str | None = None,
                     error: str | None = None, backoff_s: float | None = None,
                     not_retried: str | None = None) -> None:
        cols = ", ".join(_TOOL_ATTEMPT_FIELDS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in _TOOL_ATTEMPT_FIELDS[3:])
        self._execute(f"INSERT INTO tool_attempts (run_id, {cols}) VALUES ({', '.join(['%s'] * 11)}) "
                      f"ON CONFLICT (run_id, node, attempt, status) DO UPDATE SET {updates}",
                      (run_id, node, attempt, status, args_hash, started, finished, error_kind, error, backoff_s,
                       not_retried), run_id=run_id)

    def node_changes(self, run_id: str) -> list[NodeChange]:
        return [NodeChange(*row) for row in self._fetch(
            "SELECT node, kind, state, time, value, error, error_type, seed, args_hash, sent "
            "FROM node_changes WHERE run_id = %s ORDER BY seq", (run_id,))]

    def tool_attempts(self, run_id: str) -> list[ToolAttempt]:
        return [ToolAttempt(*row) for row in self._fetch(
            f"SELECT {', '.join(_TOOL_ATTEMPT_FIELDS)} FROM tool_attempts WHERE run_id = %s ORDER BY seq", (run_id,))]

    def recorded(self, run_id: str) -> RecordedNodes:
        return RecordedNodes.from_changes(self.node_changes(run_id))

    # -- events --
    def add_event(self, run_id: str, event_id: int, type: str, data: Any) -> None:
        self._execute("INSERT INTO run_events (run_id, id, type, data) VALUES (%s, %s, %s, %s::json)",
                      (run_id, event_id, type, json_text(data)), run_id=run_id)

    def events(self, run_id: str) -> list[tuple[int, str, dict[str, Any]]]:
        return self._fetch("SELECT id, type, data FROM run_events WHERE run_id = %s ORDER BY id", (run_id,))

    # -- retention --
    def prune(self, *, older_than_s: float | None = None, keep: int | None = None) -> list[str]:
        """Delete ended runs (with their nodes, attempts and events) that ended more than
        older_than_s ago, and beyond the newest `keep` ended runs; never a queued or running run.
        Returns the deleted run ids."""
        ended = self._fetch("SELECT run_id, ended_at FROM runs WHERE status = ANY(%s) "
                            "ORDER BY ended_at DESC NULLS LAST, seq DESC", (list(ENDED),))
        doomed = doomed_runs(ended, older_than_s=older_than_s, keep=keep)
        if doomed:  # the status is checked again: a run resumed meanwhile is not deleted
            self._execute("DELETE FROM runs WHERE run_id = ANY(%s) AND status = ANY(%s)", (doomed, list(ENDED)))
        return doomed
