"""Run ownership for several `agentrt serve` replicas on one PostgreSQL run store.

Each replica has an id and a row in `replicas` (host, pid, last heartbeat). An unfinished run has
an owner (the replica running it) and a lease expiry; only its owner runs it. The owner renews
its leases with each heartbeat; when a run ends, or at a clean shutdown, it releases them. A run
whose lease lapsed (its owner was killed, or stopped) is claimed by another replica with
`FOR UPDATE SKIP LOCKED`, so two replicas never claim the same run, and resumed from what the
store recorded.

Lease times are the database's clock (`clock_timestamp()`), so replicas on machines whose clocks
differ agree on when a lease lapsed.

What other replicas ask of a run they do not own goes through the store too: a cancel sets the
run's `cancel_requested`, an input to a waiting node is a row of `run_inputs`; the owner reads
both at each heartbeat and acts on them.

`LeaseStore` is mixed into `PostgresRunStore` (it uses its pooled `_conn`, `_execute`, `_fetch`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from agentrt.runtime.store_api import RUN_FIELDS, UNFINISHED, StoredRun, StoreUnavailable, json_text

# the statements of the schema version that adds ownership (store_postgres.MIGRATIONS[2])
LEASE_MIGRATION = [
    "ALTER TABLE runs ADD COLUMN owner TEXT, ADD COLUMN lease_until DOUBLE PRECISION, "
    "ADD COLUMN cancel_requested DOUBLE PRECISION",
    "CREATE INDEX runs_lease ON runs (lease_until) WHERE status IN ('queued', 'running', 'waiting')",
    """CREATE TABLE replicas (
        replica_id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL,
        started_at DOUBLE PRECISION NOT NULL, heartbeat_at DOUBLE PRECISION NOT NULL,
        lease_s DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE run_inputs (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE, node TEXT NOT NULL,
        value JSON NOT NULL, given_by TEXT, time DOUBLE PRECISION NOT NULL)""",
]
NOW = "extract(epoch from clock_timestamp())::double precision"  # the database's clock, in unix seconds


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    lease_s: float


@dataclass(frozen=True)
class RunLease:
    run_id: str
    program: str
    status: str
    owner: str | None
    lease_until: float | None


@dataclass(frozen=True)
class ForwardedInput:
    """An input to a waiting node, given through a replica that does not own the run."""

    run_id: str
    node: str
    value: Any
    by: str | None


@dataclass(frozen=True)
class Heartbeat:
    """What a heartbeat found: the unfinished runs this replica still owns (a run missing from it
    was taken over by another replica), the cancels and inputs other replicas recorded for them."""

    owned: frozenset[str]
    cancels: tuple[str, ...]
    inputs: tuple[ForwardedInput, ...]


class RunTakenOver(StoreUnavailable):
    """A write of a run this replica no longer owns (its lease lapsed and another replica took the
    run over): refused, nothing recorded. It stops the run here as an unavailable store does."""


class LeaseStore:
    """Run ownership on a PostgreSQL run store (see the module's docstring)."""

    supports_leases = True
    # the replica this store serves: each write of a run checks, in its transaction, that the run
    # is still this replica's (a replica stalled past its lease must not write beside the new owner)
    fence_owner: str | None = None

    def _check_owner(self, conn: Any, run_id: str) -> None:
        """In a write's transaction: RunTakenOver if another replica owns the run. FOR SHARE holds
        the row until the write commits, so a claim cannot slip in between (claims skip it)."""
        row = conn.execute("SELECT owner FROM runs WHERE run_id = %s FOR SHARE", (run_id,)).fetchone()
        if row is not None and row[0] is not None and row[0] != self.fence_owner:
            raise RunTakenOver(f"run {run_id} is owned by replica {row[0]} now (this replica, {self.fence_owner}, "
                               "lost its lease); the write was refused, nothing was recorded")

    def register_replica(self, replica_id: str, host: str, pid: int, lease_s: float) -> None:
        self._execute(f"INSERT INTO replicas VALUES (%s, %s, %s, {NOW}, {NOW}, %s) ON CONFLICT (replica_id) "
                      "DO UPDATE SET host = excluded.host, pid = excluded.pid, started_at = excluded.started_at, "
                      "heartbeat_at = excluded.heartbeat_at, lease_s = excluded.lease_s",
                      (replica_id, host, pid, lease_s))

    def unregister_replica(self, replica_id: str) -> None:
        """A clean shutdown: its leases go (another replica resumes its unfinished runs at once)."""
        with self._conn() as conn:
            conn.execute("UPDATE runs SET owner = NULL, lease_until = NULL WHERE owner = %s", (replica_id,))
            conn.execute("DELETE FROM replicas WHERE replica_id = %s", (replica_id,))

    def create_owned_run(self, run: StoredRun, replica_id: str, lease_s: float) -> None:
        """Record a new run owned by this replica, in one transaction: no other replica ever sees
        it unowned (and claims it)."""
        with self._conn() as conn:
            self._insert_run(conn, run)
            conn.execute(f"UPDATE runs SET owner = %s, lease_until = {NOW} + %s WHERE run_id = %s",
                         (replica_id, lease_s, run.run_id))

    def claim_lapsed(self, replica_id: str, lease_s: float, limit: int, *, restarted: bool = False) -> list[str]:
        """Claim up to `limit` unfinished runs that nobody owns or whose lease lapsed, oldest first;
        the ids claimed. Rows another replica is claiming now are skipped, not waited for.
        restarted: a replica starting again under the same id takes its own runs back at once
        (they were its previous process's, which is gone) without waiting for their leases."""
        rows = self._fetch(
            f"UPDATE runs SET owner = %s, lease_until = {NOW} + %s "
            f"WHERE run_id IN (SELECT run_id FROM runs WHERE status = ANY(%s) "
            f"AND (lease_until IS NULL OR lease_until < {NOW} OR (%s AND owner = %s)) ORDER BY created_at, seq "
            f"LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING run_id",
            (replica_id, lease_s, list(UNFINISHED), restarted, replica_id, limit))
        return [r[0] for r in rows]

    def claim_run(self, run_id: str, replica_id: str, lease_s: float) -> bool:
        """Own this unfinished run: True if it is this replica's now (it owned it, or nobody did,
        or its owner's lease lapsed), False while another replica holds it."""
        return bool(self._fetch(
            f"UPDATE runs SET owner = %s, lease_until = {NOW} + %s WHERE run_id IN (SELECT run_id FROM runs "
            f"WHERE run_id = %s AND status = ANY(%s) AND (owner = %s OR lease_until IS NULL OR lease_until < {NOW}) "
            "FOR UPDATE SKIP LOCKED) RETURNING run_id", (replica_id, lease_s, run_id, list(UNFINISHED), replica_id)))

    def release_run(self, run_id: str, replica_id: str) -> None:
        self._execute("UPDATE runs SET owner = NULL, lease_until = NULL WHERE run_id = %s AND owner = %s",
                      (run_id, replica_id))

    def heartbeat(self, replica_id: str, lease_s: float) -> Heartbeat:
        """Renew this replica's row and its runs' leases; what other replicas asked of them."""
        with self._conn() as conn:
            conn.execute(f"UPDATE replicas SET heartbeat_at = {NOW} WHERE replica_id = %s", (replica_id,))
            owned = conn.execute(
                f"UPDATE runs SET lease_until = {NOW} + %s WHERE owner = %s AND status = ANY(%s) "
                "RETURNING run_id, cancel_requested", (lease_s, replica_id, list(UNFINISHED))).fetchall()
            inputs = conn.execute(
                "DELETE FROM run_inputs WHERE run_id IN (SELECT run_id FROM runs WHERE owner = %s) "
                "RETURNING seq, run_id, node, value, given_by", (replica_id,)).fetchall()
        return Heartbeat(frozenset(r[0] for r in owned), tuple(r[0] for r in owned if r[1] is not None),
                         tuple(ForwardedInput(run_id, node, value, by)
                               for _, run_id, node, value, by in sorted(inputs)))

    def request_cancel(self, run_id: str) -> None:
        self._execute(f"UPDATE runs SET cancel_requested = {NOW} WHERE run_id = %s AND cancel_requested IS NULL",
                      (run_id,))

    def cancel_requested(self, run_id: str) -> bool:
        rows = self._fetch("SELECT cancel_requested IS NOT NULL FROM runs WHERE run_id = %s", (run_id,))
        return bool(rows and rows[0][0])

    def forward_input(self, run_id: str, node: str, value: Any, by: str | None) -> None:
        self._execute(f"INSERT INTO run_inputs (run_id, node, value, given_by, time) VALUES (%s, %s, %s::json, %s, {NOW})",
                      (run_id, node, json_text(value), by))

    def runs_page(self, program: str | None, status: str | None, limit: int,
                  before: str | None) -> list[StoredRun] | None:
        """Runs newest first (as submitted), of a program and status if given, those submitted
        before the run `before` if given: what any replica lists. None when `before` names no run."""
        where, params = ["TRUE"], []
        if before is not None:
            found = self._fetch("SELECT seq FROM runs WHERE run_id = %s", (before,))
            if not found:
                return None
            where.append("seq < %s")
            params.append(found[0][0])
        for column, value in (("program", program), ("status", status)):
            if value is not None:
                where.append(f"{column} = %s")
                params.append(value)
        rows = self._fetch(f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE {' AND '.join(where)} "
                           "ORDER BY seq DESC LIMIT %s", (*params, limit))
        return [StoredRun(**dict(zip(RUN_FIELDS, row))) for row in rows]

    def events_after(self, run_id: str, after: int) -> list[tuple[int, str, dict[str, Any]]]:
        """A run's events past id `after` (a replica following a run another one owns)."""
        return self._fetch("SELECT id, type, data FROM run_events WHERE run_id = %s AND id > %s ORDER BY id",
                           (run_id, after))

    def replicas(self) -> list[ReplicaInfo]:
        return [ReplicaInfo(*row) for row in self._fetch(
            "SELECT replica_id, host, pid, started_at, heartbeat_at, lease_s FROM replicas ORDER BY started_at")]

    def leases(self, statuses: Iterable[str] = UNFINISHED) -> list[RunLease]:
        return [RunLease(*row) for row in self._fetch(
            "SELECT run_id, program, status, owner, lease_until FROM runs WHERE status = ANY(%s) "
            "ORDER BY created_at, seq", (list(statuses),))]

    def database_time(self) -> float:
        return self._fetch(f"SELECT {NOW}")[0][0]
