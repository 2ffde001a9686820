"""Durable runs: `agentrt serve` as a real process with its run store (a SQLite file; one kill -9
case also with a PostgreSQL database, tests/pg_cluster.py), killed with SIGKILL mid-run and
started again (embedded model, greedy, no speculation: the same output on every start). The
program (durable_program.py) counts its tool calls in files, and its slow tool waits for a
go-file, so a test kills the server while that tool runs."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from agentrt.runtime.store import open_store
from agentrt.server.process import wait_ready
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).parents[2]
PROGRAM = Path(__file__).parent / "durable_program.py"
APPROVAL_PROGRAM = Path(__file__).parent / "approval_program.py"
MCP_PROGRAM = Path(__file__).parent / "mcp_durable_program.py"


class Server:
    def __init__(self, tmp: Path, *, idempotent: bool = False, program: Path = PROGRAM,
                 extra: tuple[str, ...] = (), db: Path | str | None = None) -> None:
        self.tmp, self.idempotent, self.extra, self.program = tmp, idempotent, extra, program
        self.db = db or tmp / "store.db"  # a SQLite file or a postgresql:// URL
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "agentrt.cli", "serve", str(self.program), "--port", str(self.port), "--spec", "none",
                "--runs-dir", str(self.tmp / "runs"), "--db", str(self.db), "--shutdown-grace", "2", *self.extra]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "AGENTRT_TEST_DIR": str(self.tmp),
                "MCP_FIXTURE_CALL_LOG": str(self.tmp / "mcp.calls"),
                "AGENTRT_SLOW_IDEMPOTENT": "1" if self.idempotent else "0"}

    def start(self) -> None:
        self.starts += 1
        self.log = self.tmp / f"server-{self.starts}.log"
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.env(), stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)
        try:
            wait_ready(self.url, self.proc, self.log, timeout_s=120)
        except RuntimeError:
            self.proc.kill()
            raise

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stored(self, read: Callable[[Any], Any]) -> Any:
        """read(store) on the server's run store, opened beside it (what a kill left there)."""
        store = open_store(str(self.db))
        try:
            return read(store)
        finally:
            store.close()

    def events(self, run_id: str, after: int | None = None) -> list[tuple[int, str, dict]]:
        """The run's whole event stream (it ends with the run), from after `after`."""
        headers = {} if after is None else {"Last-Event-ID": str(after)}
        req = urllib.request.Request(f"{self.url}/v1/runs/{run_id}/events", headers=headers)
        out, ev = [], {}
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().rstrip("\n")
                if not line:
                    if "id" in ev:
                        out.append((int(ev["id"]), ev["event"], json.loads(ev["data"])))
                    ev = {}
                elif not line.startswith(":"):
                    key, _, value = line.partition(":")
                    ev[key] = value.strip()
        return out

    def wait_ended(self, run_id: str, timeout: float = 120) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            status, info = self.request("GET", f"/v1/runs/{run_id}")
            if status == 200 and info["status"] in ("done", "failed", "cancelled"):
                return info
            time.sleep(0.2)
        raise AssertionError(f"run {run_id} did not end in {timeout} s")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_db(request, tmp_path) -> Path | str:
    """The --db of a test, once per store kind."""
    if request.param == "sqlite":
        return tmp_path / "store.db"
    return request.getfixturevalue("postgres_cluster").new_database()


@pytest.fixture
def server(tmp_path):
    made: list[Server] = []

    def make(**kw) -> Server:
        s = Server(tmp_path, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def calls(tmp: Path, name: str) -> list[str]:
    path = tmp / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


def wait_for(cond, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def submit_and_kill_in_slow_add(s: Server) -> tuple[str, list]:
    s.start()
    status, info = s.request("POST", "/v1/programs/durable/runs", {"inputs": {}}, {"Idempotency-Key": "once"})
    assert status == 201, info
    wait_for(lambda: calls(s.tmp, "slow_add"))
    time.sleep(0.3)  # events of the tool's start are out
    _, seen = s.request("GET", f"/v1/runs/{info['run_id']}")
    s.kill9()
    return info["run_id"], seen


def test_kill9_in_a_non_idempotent_tool_fails_it_clearly_and_runs_nothing_twice(server):
    s = server()
    run_id, _ = submit_and_kill_in_slow_add(s)
    nodes = {c.node: c.state for c in s.stored(lambda store: store.node_changes(run_id))}  # what the kill left
    assert nodes["sum"] == "running"
    (s.tmp / "go").touch()
    s.start()
    info = s.wait_ended(run_id)
    assert info["status"] == "failed" and info["error"]["node"] == "sum"
    assert "may or may not have run" in info["error"]["message"]
    assert len(calls(s.tmp, "record")) == 1 and calls(s.tmp, "slow_add") == ["start"]
    # the same Idempotency-Key still names the run after the restart
    status, again = s.request("POST", "/v1/programs/durable/runs", {"inputs": {}}, {"Idempotency-Key": "once"})
    assert status == 200 and again["run_id"] == run_id


def test_kill9_in_an_idempotent_tool_reruns_it_and_the_events_read_across_the_restart_are_whole(server, store_db):
    s = server(idempotent=True, db=store_db)
    run_id, _ = submit_and_kill_in_slow_add(s)
    before = [i for i, _, _ in s.stored(lambda store: store.events(run_id))]
    assert before == list(range(1, len(before) + 1))
    (s.tmp / "go").touch()
    s.start()
    info = s.wait_ended(run_id)
    assert info["status"] == "done", info
    assert len(calls(s.tmp, "record")) == 1 and calls(s.tmp, "slow_add") == ["start", "start", "end"]
    last_seen = before[-1]
    rest = s.events(run_id, after=last_seen)
    everything = s.events(run_id)
    ids = [i for i, _, _ in everything]
    assert ids == list(range(1, len(ids) + 1))  # every event once, in order
    assert [e[0] for e in rest] == ids[last_seen:]
    types = [t for _, t, _ in everything]
    assert types.count("run_finished") == 1 and types[-1] == "run_finished"
    assert types.index("run_resumed") > last_seen - 1
    # the same Idempotency-Key still names the run after the restart
    status, again = s.request("POST", "/v1/programs/durable/runs", {"inputs": {}}, {"Idempotency-Key": "once"})
    assert status == 200 and again["run_id"] == run_id
    finished = [(d["node"], d.get("replayed", False)) for _, t, d in everything if t == "node_finished"]
    # before the kill plan and record ran; after the restart they come from the store
    assert finished == [("plan", False), ("record", False), ("plan", True), ("record", True), ("sum", False),
                        ("answer", False)]


def test_kill9_during_generation_resumes_to_the_uninterrupted_output(server, tmp_path):
    (tmp_path / "go").touch()  # the slow tool does not wait here
    s = server()
    s.start()
    status, ref = s.request("POST", "/v1/programs/durable/runs", {"inputs": {}})
    reference = s.wait_ended(ref["run_id"])
    assert reference["status"] == "done"
    status, info = s.request("POST", "/v1/programs/durable/runs", {"inputs": {}})
    run_id = info["run_id"]

    def generating_answer() -> bool:  # the last LLM node has produced text, and not all of it
        with sqlite3.connect(s.db) as db:
            rows = db.execute("SELECT type, data FROM run_events WHERE run_id = ? ORDER BY id", (run_id,)).fetchall()
        return any(t == "token" and json.loads(d)["node"] == "answer" for t, d in rows)

    wait_for(generating_answer)
    s.kill9()
    s.start()
    resumed = s.wait_ended(run_id)
    assert resumed["status"] == "done" and resumed["output"] == reference["output"]


def test_a_waiting_run_survives_two_restarts_and_takes_only_a_valid_input(server):
    s = server(program=APPROVAL_PROGRAM)
    s.start()
    status, info = s.request("POST", "/v1/programs/approve/runs", {"inputs": {}})
    run_id = info["run_id"]

    def waiting() -> dict:
        wait_for(lambda: s.request("GET", f"/v1/runs/{run_id}")[1]["status"] == "waiting", timeout=60)
        return s.request("GET", f"/v1/runs/{run_id}")[1]

    first = waiting()
    assert first["waiting_for"] == [{"node": "approval", "schema": {
        "type": "object", "properties": {"approved": {"type": "boolean"}}, "required": ["approved"],
        "additionalProperties": False}, "prompt": "Run DELETE FROM orders WHERE id = 7?"}]
    s.stop()  # SIGTERM: the waiting run stays unfinished in the store
    s.start()
    waiting()
    s.kill9()
    s.start()
    waiting()
    status, err = s.request("POST", f"/v1/runs/{run_id}/input/approval", {"value": {"approved": "yes"}})
    assert status == 422 and "approval" in err["error"]["message"]
    status, err = s.request("POST", f"/v1/runs/{run_id}/input/other", {"value": {"approved": True}})
    assert status == 409 and "not waiting for input at node 'other'" in err["error"]["message"]
    assert s.request("GET", f"/v1/runs/{run_id}")[1]["status"] == "waiting"
    status, info = s.request("POST", f"/v1/runs/{run_id}/input/approval", {"value": {"approved": True}})
    assert status == 200
    done = s.wait_ended(run_id)
    assert done["status"] == "done" and done["output"]
    types = [t for _, t, _ in s.events(run_id)]
    assert types.count("input_wanted") == 3 and types.count("input_given") == 1 and types[-1] == "run_finished"


def test_kill9_after_an_mcp_tool_finished_resumes_without_calling_it_again(server):
    # fx.slow declares no idempotentHint: run again, it would count twice in the server's call log
    s = server(program=MCP_PROGRAM)
    s.start()
    status, info = s.request("POST", "/v1/programs/counted/runs", {"inputs": {}})
    assert status == 201, info
    run_id = info["run_id"]
    wait_for(lambda: s.request("GET", f"/v1/runs/{run_id}")[1]["status"] == "waiting", timeout=60)
    assert calls(s.tmp, "mcp") == ["slow 3"]
    s.kill9()
    s.start()
    wait_for(lambda: s.request("GET", f"/v1/runs/{run_id}")[1]["status"] == "waiting", timeout=60)
    status, _ = s.request("POST", f"/v1/runs/{run_id}/input/go_on", {"value": {"go": True}})
    assert status == 200
    done = s.wait_ended(run_id)
    assert done["status"] == "done" and done["output"] == {"go": True}
    assert calls(s.tmp, "mcp") == ["slow 3"]  # the recorded result was replayed, not called again
    started = [d for _, t, d in s.events(run_id) if t == "node_started" and d["node"] == "count"]
    assert [d.get("replayed", False) for d in started] == [False, True]


def test_a_corrupt_or_newer_store_stops_the_server_before_it_serves(tmp_path):
    for name, make in [("corrupt.db", lambda p: p.write_bytes(b"garbage" * 500)),
                       ("newer.db", lambda p: sqlite3.connect(p).execute("PRAGMA user_version=99"))]:
        path = tmp_path / name
        make(path)
        before = path.read_bytes()
        out = subprocess.run([sys.executable, "-m", "agentrt.cli", "serve", str(PROGRAM), "--port", str(free_port()),
                              "--db", str(path), "--runs-dir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env={**os.environ, "AGENTRT_TEST_DIR": str(tmp_path)})
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"run store {path}" in out.stderr and "nothing was changed" in out.stderr
        assert path.read_bytes() == before
