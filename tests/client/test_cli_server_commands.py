"""The commands that talk to a server, on the real server application (tests/client/served.py):
`agentrt inspect URL` for a run in any state (what ran, what runs, what waits and how to answer
it), `agentrt submit` printing the real URL of a wait_for node, the API-key options of both, and
which variable each side reads its keys from."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from agentrt.cli import main
from agentrt.cli.serve import load_api_keys
from agentrt.client import Client
from agentrt.client.keys import env_api_key

ROOT = Path(__file__).parents[2]
KEY = "client-test-key"


def waiting_run(c: Client) -> str:
    run = c.start_run("approve", {"sql": "DROP TABLE t"})
    next(e for e in c.events(run.run_id) if e.type == "input_wanted")
    return run.run_id


def test_inspect_shows_a_waiting_run_with_its_question_and_how_to_answer_it(served_with_key, capsys, monkeypatch,
                                                                             tmp_path):
    monkeypatch.delenv("AGENTRT_API_KEY", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    with Client(served_with_key.url, api_key=KEY) as c:
        run_id = waiting_run(c)
    url = f"{served_with_key.url}/v1/runs/{run_id}"
    assert main(["inspect", url]) == 2
    err = capsys.readouterr().err
    assert "401 missing API key" in err and "--api-key, --api-key-file or $AGENTRT_API_KEY" in err
    assert main(["inspect", url, "--api-key", KEY]) == 0
    out = capsys.readouterr().out
    assert f"run {run_id} (approve): waiting; what has finished so far:" in out
    assert "▶ approval" not in out  # a node waiting for input is shown once, as waiting
    assert "? approval waits for input: Run DROP TABLE t?" in out
    assert f"POST {url}/input/approval with" in out and '"required": ["approved"]' in out
    assert f"curl -X POST {url}/input/approval" in out and """-d '{"value": {"approved": true}}'""" in out
    key_file = tmp_path / "key"
    key_file.write_text(f"# the test server's key\n{KEY}\n")
    assert main(["inspect", url, "--api-key-file", str(key_file), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["runs"][0]["status"] == "waiting" and shown["runs"][0]["nodes"] == []
    [wait] = shown["live"]["waiting_for"]
    assert wait["node"] == "approval" and wait["prompt"] == "Run DROP TABLE t?" and wait["schema"]["required"] == ["approved"]


def test_inspect_shows_what_ran_and_what_runs_of_a_run_still_going(served, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with Client(served.url, api_key="") as c:
        run = c.start_run("calc", {"question": "2 + 3?", "delay": 3.0})
        next(e for e in c.events(run.run_id) if e.type == "node_started" and e.data["node"] == "sum")
        url = f"{served.url}/v1/runs/{run.run_id}"
        assert main(["inspect", url, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [n["node"] for n in shown["runs"][0]["nodes"]] == ["plan"]  # what ran
        assert shown["runs"][0]["status"] == "running" and shown["live"]["status"] == "running"
        assert [n["node"] for n in shown["live"]["running"]] == ["sum"]  # what runs
        assert main(["inspect", url]) == 0
        out = capsys.readouterr().out
        assert "▶ sum (tool) running" in out and "plan" in out
        c.cancel(run.run_id)
        assert main(["inspect", url, "--json"]) == 0  # ended: the trace as before, nothing live
        shown = json.loads(capsys.readouterr().out)
        assert "live" not in shown and shown["runs"][0]["status"] == "cancelled"


def test_submit_prints_the_real_url_and_command_of_a_waiting_node(served_with_key):
    env = {**os.environ, "COLUMNS": "200", "AGENTRT_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "submit", "approve", "--server", served_with_key.url,
                             "--input", "sql=DELETE FROM t"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.time() + 60
        while not any(line.lstrip().startswith("curl") for line in lines):
            assert time.time() < deadline and proc.poll() is None, "".join(lines) + proc.stderr.read()
            lines.append(proc.stdout.readline())
        run_id = lines[0].split()[1]
        text = "".join(lines)
        run_url = f"{served_with_key.url}/v1/runs/{run_id}"
        assert "? approval waits for input: Run DELETE FROM t?" in text
        assert f"POST {run_url}/input/approval with" in text and "RUN_ID" not in text
        assert f'curl -X POST {run_url}/input/approval -H "Authorization: Bearer $AGENTRT_API_KEY"' in text
        with Client(served_with_key.url, api_key=KEY) as c:
            c.provide_input(run_id, "approval", {"approved": True})
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        assert "✔ answer" in out and f"agentrt inspect {run_url}" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_submit_without_a_key_says_where_it_goes(served_with_key):
    env = {k: v for k, v in os.environ.items() if k != "AGENTRT_API_KEY"}
    env["AGENTRT_API_KEYS"] = KEY  # the server's old variable: not read by a client
    out = subprocess.run([sys.executable, "-m", "agentrt.cli", "submit", "calc", "--server", served_with_key.url],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "AGENTRT_API_KEYS is set, but that is the server's list of keys" in out.stderr
    assert "401 missing API key" in out.stderr and "$AGENTRT_API_KEY" in out.stderr
    helps = [subprocess.run([sys.executable, "-m", "agentrt.cli", cmd, "--help"], cwd=ROOT, capture_output=True,
                            text=True, env={**env, "COLUMNS": "200"}).stdout for cmd in ("submit", "inspect")]
    for text in helps:
        assert "--api-key KEY" in text and "--api-key-file PATH" in text and "$AGENTRT_API_KEY" in text


def test_the_server_reads_its_own_variable_and_says_when_it_sees_the_clients(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="agentrt.server")
    assert load_api_keys(None, {"AGENTRT_SERVE_API_KEYS": "a, b"}) == ("a", "b")
    assert not caplog.records
    assert load_api_keys(None, {"AGENTRT_API_KEYS": "old"}) == ("old",)
    assert "AGENTRT_API_KEYS is deprecated" in caplog.text and "AGENTRT_SERVE_API_KEYS" in caplog.text
    caplog.clear()
    assert load_api_keys(None, {"AGENTRT_API_KEY": "k"}) == ()
    assert "AGENTRT_API_KEY is set, but that is a client's key" in caplog.text
    caplog.clear()
    keys = tmp_path / "keys"
    keys.write_text("f1\n")
    assert load_api_keys(str(keys), {"AGENTRT_API_KEY": "k", "AGENTRT_SERVE_API_KEYS": "e1"}) == ("f1", "e1")
    assert not caplog.records  # the server has keys: the client's variable beside them is fine
    assert env_api_key({"AGENTRT_API_KEY": " k "}) == ("k", None)
    key, note = env_api_key({"AGENTRT_API_KEYS": "k"})
    assert key is None and "a client reads its key from AGENTRT_API_KEY" in note


def test_submit_again_with_the_same_idempotency_key_follows_the_same_run(served_with_key):
    env = {**os.environ, "COLUMNS": "200", "AGENTRT_API_KEY": KEY}
    command = [sys.executable, "-m", "agentrt.cli", "submit", "calc", "--server", served_with_key.url,
               "--idempotency-key", "nightly-1", "--input", "question=1 + 1?"]
    first, second = [subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
                     for _ in range(2)]
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    run_id = first.stdout.split()[1]
    assert second.stdout.startswith(f"run {run_id} on {served_with_key.url} (started before with this key)")
    assert "✔ answer" in second.stdout  # the whole run again, replayed from its event log
