"""Several `agentrt serve` replicas on one PostgreSQL run store (tests/pg_cluster.py), as real
processes with a 1.5 s lease, followed with agentrt's own client: any replica serves any run
(status, events with Last-Event-ID, cancel), and a replica killed with SIGKILL mid-tool has its
run taken over by another once the lease lapses, its finished tool not run again. The program
(replica_program.py) has tools only, each call counted in a file."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentrt.client.errors import BadRequest, Conflict, UnprocessableEntity
from agentrt.client.sync import Client
from agentrt.runtime.store import open_store
from agentrt.server.process import start_server
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).parents[2]
PROGRAM = Path(__file__).parent / "replica_program.py"
APPROVAL_PROGRAM = Path(__file__).parent / "approval_program.py"  # waits for an input, then one short LLM call
LEASE_S = 1.5


class Replica:
    def __init__(self, tmp: Path, name: str, db: str, port: int | None = None) -> None:
        self.runs = tmp / name
        self.runs.mkdir(exist_ok=True)
        self.port = port or free_port()  # the replica's id is HOST:PORT
        self.proc, url = start_server([str(PROGRAM), str(APPROVAL_PROGRAM), "--spec", "none", "--runs-dir",
                                       str(self.runs), "--db", db, "--lease-s", str(LEASE_S), "--shutdown-grace", "1"],
                                      self.runs, self.port, ROOT)
        self.client = Client(url)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, postgres_cluster):
    """Two replicas, A and B (each its own runs folder), on one fresh database, both ready; shared
    by the tests of this file, in order (the last one kills A). Yields (db, A, B, folder of the
    programs' call files)."""
    tmp = tmp_path_factory.mktemp("replicas")
    db = postgres_cluster.new_database()
    with pytest.MonkeyPatch.context() as env:  # for every replica the tests start
        env.setenv("AGENTRT_TEST_DIR", str(tmp))
        with ThreadPoolExecutor(2) as pool:  # both load at once
            starting = [pool.submit(Replica, tmp, name, db) for name in ("a", "b")]
        started = [f.result() for f in starting if f.exception() is None]
        try:
            assert len(started) == 2, [f.exception() for f in starting]
            yield db, *started, tmp
        finally:
            for r in started:
                r.stop()


def calls(tmp: Path, name: str) -> list[str]:
    path = tmp / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


def wait_for(cond, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def status(db: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "agentrt.cli", "status", "--db", db, "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_run_started_on_one_replica_is_followed_and_cancelled_through_the_other(replicas):
    db, a, b, tmp_path = replicas
    run_id = a.client.start_run("replica", {"n": 4}).run_id
    wait_for(lambda: calls(tmp_path, "wait_go"))
    assert b.client.get_run(run_id).status == "running"  # B reads it from the store
    listed = b.client.list_runs(program="replica", status="running")  # every replica's runs, from the store
    assert [r.run_id for r in listed.data] == [run_id] and listed.next_cursor is None
    now = status(db)
    assert len(now["replicas"]) == 2 and all(r["alive"] for r in now["replicas"])
    lease = next(r for r in now["runs"] if r["run"] == run_id)
    assert lease["owner"] in {r["replica"] for r in now["replicas"]} and lease["lease_left_s"] > 0
    with pytest.raises(Conflict, match="runs on another replica"):
        b.client.trace(run_id)
    assert b.client.cancel(run_id).status == "cancelled"  # A, its owner, cancels it at its next heartbeat
    events = list(b.client.events(run_id))  # the whole log, through B
    ids = [e.id for e in events]
    assert ids == list(range(1, len(ids) + 1))
    assert events[-1].type == "run_finished" and events[-1].data["status"] == "cancelled"
    assert list(b.client.events(run_id, last_event_id=ids[-2])) == events[-1:]  # Last-Event-ID through B
    assert a.client.get_run(run_id).status == "cancelled"
    assert any(r.get("type") == "program" for r in a.client.trace(run_id))  # the trace is where it ran
    with pytest.raises(BadRequest, match="cursor 'run_nope' names no run"):
        b.client.list_runs(cursor="run_nope")
    with pytest.raises(Conflict, match="another replica ran it"):
        b.client.trace(run_id)
    assert calls(tmp_path, "record") == ["4"] and calls(tmp_path, "wait_go") == ["start 4"]
    with pytest.raises(Conflict):
        b.client.cancel(run_id)
    assert run_id not in {r["run"] for r in status(db)["runs"]}  # ended: no longer leased


def test_an_input_given_through_a_replica_that_does_not_own_the_run_reaches_it(replicas):
    _, a, b, _ = replicas
    run_id = a.client.start_run("approve", {}).run_id
    wanted = next(e for e in b.client.events(run_id) if e.type == "input_wanted")  # followed through B
    assert wanted.data["node"] == "approval"
    [waiting] = b.client.get_run(run_id).waiting_for
    assert waiting.node == "approval"
    with pytest.raises(UnprocessableEntity, match="approved"):  # checked against the node's schema by B
        b.client.provide_input(run_id, "approval", {"approved": "yes"})
    with pytest.raises(Conflict, match="not waiting for input at node 'nope'"):
        b.client.provide_input(run_id, "nope", {"approved": True})
    b.client.provide_input(run_id, "approval", {"approved": True}, by="ann")  # A takes it at its next beat
    info = b.client.wait(run_id, timeout=60)
    assert info.status == "done", info
    given = [e.data for e in b.client.events(run_id) if e.type == "input_given"]
    assert len(given) == 1 and given[0]["node"] == "approval" and given[0].get("by") == "ann"


def test_a_replica_stalled_past_its_lease_loses_its_run_and_writes_nothing_of_it_after(replicas):
    db, a, b, tmp_path = replicas
    run_id = a.client.start_run("replica", {"n": 5}).run_id
    wait_for(lambda: "start 5" in calls(tmp_path, "wait_go"))
    time.sleep(0.3)  # the tool's start is recorded
    a.proc.send_signal(signal.SIGSTOP)  # stalled: no heartbeat
    try:
        b_id = f"{socket.gethostname()}:{b.port}"
        wait_for(lambda: next(r["owner"] for r in status(db)["runs"] if r["run"] == run_id) == b_id)
        (tmp_path / "go-5").touch()  # both tools may finish now: B's and the stalled one's
    finally:
        a.proc.send_signal(signal.SIGCONT)
    info = b.client.wait(run_id, timeout=60)
    assert info.status == "done" and info.output == 10, info
    events = list(a.client.events(run_id))  # A, awake, serves it from the store: B's log only
    ids = [e.id for e in events]
    assert ids == list(range(1, len(ids) + 1)) and [e.type for e in events].count("run_finished") == 1
    time.sleep(LEASE_S)  # A's heartbeat has run since it woke
    assert a.client.get_run(run_id).status == "done" and a.proc.poll() is None
    assert calls(tmp_path, "record").count("5") == 1
    assert "another replica" in (a.runs / "server.log").read_text()


def test_a_killed_replicas_run_is_taken_over_when_its_lease_lapses_and_no_finished_tool_runs_again(replicas):
    db, a, b, tmp_path = replicas
    run_id = a.client.start_run("replica", {"n": 21}).run_id
    wait_for(lambda: "start 21" in calls(tmp_path, "wait_go"))
    time.sleep(0.3)  # the tool's start is recorded
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(timeout=30)
    killed_at = time.time()
    (tmp_path / "go-21").touch()
    followed = list(b.client.events(run_id))  # through B, before and after the takeover
    assert time.time() - killed_at >= LEASE_S / 2  # not before the lease lapsed
    info = b.client.get_run(run_id)
    assert info.status == "done" and info.output == 42, info
    assert calls(tmp_path, "record").count("21") == 1  # the finished tool ran once
    assert [c for c in calls(tmp_path, "wait_go") if c.endswith(" 21")] == ["start 21", "start 21", "end 21"]  # the interrupted idempotent one again
    ids = [e.id for e in followed]
    assert ids == list(range(1, len(ids) + 1))
    types = [e.type for e in followed]
    assert types.count("run_resumed") == 1 and types[-1] == "run_finished"
    store = open_store(db)
    try:
        assert [c.state for c in store.node_changes(run_id) if c.node == "record"] == ["running", "ok"]
    finally:
        store.close()
    first = b.client.list_runs(limit=1)  # newest first, in pages, whoever ran them
    assert [r.run_id for r in first.data] == [run_id] and first.next_cursor == run_id
    rest = b.client.list_runs(limit=100, cursor=first.next_cursor)
    assert rest.data and rest.next_cursor is None and run_id not in [r.run_id for r in rest.data]
    assert [r.created_at for r in rest.data] == sorted((r.created_at for r in rest.data), reverse=True)
    rows = status(db)["replicas"]  # the killed one's row stays (no clean shutdown), its heartbeat stopped
    assert sorted(r["alive"] for r in rows) == [False, True]


def test_a_replica_stopped_cleanly_hands_its_runs_over_at_once(replicas):
    db, a, b, tmp_path = replicas
    again = Replica(tmp_path, "a", db, port=a.port)  # A again, under its id (the run it had was taken over)
    try:
        assert again.client.get_run(run_id := b.client.start_run("replica", {"n": 7}).run_id).status in (
            "queued", "running")
        wait_for(lambda: "start 7" in calls(tmp_path, "wait_go"))
        b.proc.terminate()  # SIGTERM: after --shutdown-grace (1 s) the run stops, its lease released
        assert b.proc.wait(timeout=30) == 0
        a_id = f"{socket.gethostname()}:{a.port}"
        store = open_store(db)
        try:  # released as B stopped (not left to lapse): free for A's next heartbeat, or A's already
            assert [lease.owner for lease in store.leases() if lease.run_id == run_id] in ([None], [a_id])
        finally:
            store.close()
        (tmp_path / "go-7").touch()
        info = again.client.wait(run_id, timeout=60)
        assert info.status == "done" and info.output == 14, info
        assert calls(tmp_path, "record").count("7") == 1
        assert [c for c in calls(tmp_path, "wait_go") if c.endswith(" 7")] == ["start 7", "start 7", "end 7"]
        replicas_now = status(db)["replicas"]
        assert [r["replica"] for r in replicas_now] == [a_id]  # B left the list
    finally:
        again.stop()
