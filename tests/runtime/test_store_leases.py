"""Run ownership on the PostgreSQL run store (store_leases.py), the store's side of several
`agentrt serve` replicas on one database: claims never overlap, a lapsed lease is taken over,
heartbeats renew and carry other replicas' cancels and inputs, a replica that lost a run cannot
write it any more, and a database of the version
before leases migrates with its unfinished runs unowned (taken by the first replica)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from agentrt.runtime.store_api import StoredRun
from agentrt.runtime.store_leases import RunTakenOver
from agentrt.runtime.store_postgres import MIGRATIONS, PostgresRunStore


def run(run_id: str, status: str = "running") -> StoredRun:
    return StoredRun(run_id, "p", "h", {}, status)


def test_a_new_run_is_its_creators_and_is_taken_over_only_once_its_lease_lapses(postgres_cluster):
    store = PostgresRunStore(postgres_cluster.new_database())
    try:
        store.register_replica("a", "host-a", 1, 0.5)
        store.register_replica("b", "host-b", 2, 0.5)
        store.create_owned_run(run("r1"), "a", 0.5)
        assert store.claim_lapsed("b", 0.5, 10) == [] and not store.claim_run("r1", "b", 0.5)
        assert store.heartbeat("a", 0.5).owned == {"r1"}
        time.sleep(0.6)  # a stops beating
        assert store.claim_lapsed("b", 0.5, 10) == ["r1"]
        assert store.heartbeat("a", 0.5).owned == frozenset()  # a learns it lost r1
        assert [(lease.run_id, lease.owner) for lease in store.leases()] == [("r1", "b")]
        store.request_cancel("r1")
        store.forward_input("r1", "approve", {"ok": True}, "ann")
        beat = store.heartbeat("b", 0.5)
        assert beat.cancels == ("r1",) and [(i.node, i.value, i.by) for i in beat.inputs] == [("approve", {"ok": True}, "ann")]
        assert store.heartbeat("b", 0.5).inputs == ()  # an input is handed over once
        for event_id in (1, 2, 3):
            store.add_event("r1", event_id, "note", {"n": event_id})
        assert [e[0] for e in store.events_after("r1", 1)] == [2, 3]
        store.update_run("r1", status="cancelled")
        store.release_run("r1", "b")
        assert store.leases() == []
        store.unregister_replica("b")
        assert [r.replica_id for r in store.replicas()] == ["a"]
    finally:
        store.close()


def test_replicas_claiming_at_once_never_claim_the_same_run(postgres_cluster):
    url = postgres_cluster.new_database()
    first = PostgresRunStore(url)
    for i in range(20):
        first.create_run(run(f"r{i:02}"))  # unowned: a server of the version before leases left them
    stores = [first, *(PostgresRunStore(url) for _ in range(3))]
    try:
        with ThreadPoolExecutor(4) as pool:
            claimed = list(pool.map(lambda s: [r for _ in range(10) for r in s.claim_lapsed(f"x{id(s)}", 30, 2)],
                                    stores))
        every = [r for c in claimed for r in c]
        assert sorted(every) == [f"r{i:02}" for i in range(20)]  # each run once, none left
    finally:
        for s in stores:
            s.close()


def test_a_database_from_before_leases_migrates_with_its_runs_unowned(postgres_cluster):
    url = postgres_cluster.new_database()
    with psycopg.connect(url, autocommit=True) as conn:  # version 1, as the agentrt before leases made it
        conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL "
                     "DEFAULT now())")
        for sql in MIGRATIONS[1]:
            conn.execute(sql)
        conn.execute("INSERT INTO schema_version (version) VALUES (1)")
        conn.execute("INSERT INTO runs (run_id, program, program_hash, inputs, status, created_at) "
                     "VALUES ('old', 'p', 'h', '{}', 'running', 1)")
    store = PostgresRunStore(url)
    try:
        assert store.schema_version() == 2
        assert [(lease.run_id, lease.owner, lease.lease_until) for lease in store.leases()] == [("old", None, None)]
        assert store.claim_lapsed("a", 5, 10, restarted=True) == ["old"]
    finally:
        store.close()


def test_a_restarted_replica_takes_its_own_runs_back_at_once(postgres_cluster):
    store = PostgresRunStore(postgres_cluster.new_database())
    try:
        store.create_owned_run(run("mine"), "host:8000", 60)
        store.create_owned_run(run("theirs"), "host:8001", 60)
        assert store.claim_lapsed("host:8000", 60, 10) == []  # a beat: its own live runs are not claimed again
        assert store.claim_lapsed("host:8000", 60, 10, restarted=True) == ["mine"]
    finally:
        store.close()


def test_a_replica_that_lost_its_lease_cannot_write_beside_the_new_owner(postgres_cluster):
    url = postgres_cluster.new_database()
    stalled, new_owner = PostgresRunStore(url), PostgresRunStore(url)
    stalled.fence_owner, new_owner.fence_owner = "a", "b"
    try:
        stalled.create_owned_run(run("r"), "a", 0.3)
        stalled.add_event("r", 1, "run_queued", {})  # its own run: written
        time.sleep(0.4)
        assert new_owner.claim_lapsed("b", 30, 10) == ["r"]
        with pytest.raises(RunTakenOver, match="run r is owned by replica b now"):
            stalled.add_event("r", 2, "node_started", {"node": "x"})
        with pytest.raises(RunTakenOver):
            stalled.node_finished("r", "x", "tool", True, 1)
        with pytest.raises(RunTakenOver):
            stalled.update_run("r", status="done")
        new_owner.node_finished("r", "x", "tool", True, 2)  # the new owner's outcome is the one recorded
        assert [e[0] for e in new_owner.events("r")] == [1]
        assert [(c.state, c.value) for c in new_owner.node_changes("r")] == [("ok", 2)]
        assert new_owner.get_run("r").status == "running"
    finally:
        stalled.close()
        new_owner.close()
