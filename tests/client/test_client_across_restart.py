"""The client against a real `agentrt serve` process (embedded model, SQLite run store, keys from
AGENTRT_SERVE_API_KEYS): a run waiting for input is followed with events() while the server
stops and starts again; the stream picks up with Last-Event-ID, so the events come whole and in
order, and the Idempotency-Key still names the run after the restart."""
from __future__ import annotations

import threading
from pathlib import Path

from agentrt.client import Client
from agentrt.server.process import start_server
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).parents[2]
PROGRAM = ROOT / "tests" / "server" / "approval_program.py"
KEY = "restart-test-key"


def test_events_followed_across_a_server_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_SERVE_API_KEYS", KEY)
    monkeypatch.delenv("AGENTRT_API_KEYS", raising=False)
    port = free_port()
    args = [str(PROGRAM), "--spec", "none", "--runs-dir", str(tmp_path / "runs"), "--db", str(tmp_path / "store.db"),
            "--shutdown-grace", "1", "--program-max-tokens", "8"]
    proc, url = start_server(args, tmp_path, port, ROOT, timeout_s=120)
    events, failures = [], []
    waiting = threading.Event()
    try:
        c = Client(url, api_key=KEY, reconnect_s=120)
        run = c.start_run("approve", {"sql": "DELETE FROM t"}, idempotency_key="restart-1")

        def follow() -> None:
            try:
                for ev in c.events(run.run_id):
                    events.append(ev)
                    if ev.type == "input_wanted":
                        waiting.set()
            except Exception as e:  # noqa: BLE001 - reported by the test below
                failures.append(e)
                waiting.set()

        follower = threading.Thread(target=follow)
        follower.start()
        assert waiting.wait(60) and not failures, failures
        proc.terminate()  # the waiting run stays unfinished in the store
        assert proc.wait(timeout=30) == 0
        log = (tmp_path / "server.log").read_text()
        assert "deprecated" not in log and KEY not in log
        proc, url = start_server(args, tmp_path, port, ROOT, timeout_s=120)
        with Client(url, api_key=KEY) as again:
            same = again.start_run("approve", {"sql": "DELETE FROM t"}, idempotency_key="restart-1")
            assert same.run_id == run.run_id and not same.created
            again.provide_input(run.run_id, "approval", {"approved": True})
            follower.join(120)
            assert not follower.is_alive() and not failures, failures
            assert again.output(run.run_id)
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ids = [e.id for e in events]
    assert ids == list(range(1, len(ids) + 1))  # none lost, none twice
    types = [e.type for e in events]
    assert "run_resumed" in types and types.count("run_finished") == 1 and types[-1] == "run_finished"
    assert types.count("input_wanted") == 2  # asked before the restart and again after it
