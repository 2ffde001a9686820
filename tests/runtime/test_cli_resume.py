"""`agentrt run --db`, `agentrt resume` and `agentrt runs` as real processes on the embedded model:
a run killed with SIGKILL inside a tool is resumed from the CLI and finishes without running its
finished nodes again; bad resumes and prunes say what is wrong; `agentrt runs` on both stores."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentrt.runtime.store import SQLiteRunStore, StoredRun
from agentrt.runtime.store import open_store

ROOT = Path(__file__).parents[2]
PROGRAM = ROOT / "tests" / "server" / "durable_program.py"


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrt.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})}, **kw)


def test_a_killed_cli_run_resumes_where_it_stopped(tmp_path):
    env = {"AGENTRT_TEST_DIR": str(tmp_path), "AGENTRT_SLOW_IDEMPOTENT": "1", "PYTHONUNBUFFERED": "1"}
    db, log = tmp_path / "runs.db", tmp_path / "run.log"
    common = ["--spec", "none", "--no-live", "--trace", str(tmp_path / "t.jsonl")]
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "run", str(PROGRAM), "--db", str(db), *common],
                            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.time() + 180
    calls = tmp_path / "slow_add.calls"
    # the line, not the file: open("a") creates it before the write lands, and a kill in between
    # leaves it empty (the resumed run's "start" would then be the only one)
    while not (calls.exists() and "start" in calls.read_text()):
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    run_id = re.search(r"run (\S+) recorded in", log.read_text()).group(1)
    (tmp_path / "go").touch()
    out = cli("resume", run_id, "--db", str(db), *common, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(resumed)" in out.stdout
    assert (tmp_path / "record.calls").read_text().count("\n") == 1  # the finished tool did not run again
    assert (tmp_path / "slow_add.calls").read_text().split() == ["start", "start", "end"]
    assert SQLiteRunStore(db).get_run(run_id).status == "done"
    again = cli("resume", run_id, "--db", str(db), *common, env=env)
    assert again.returncode == 2 and f"run '{run_id}' already ended (status done)" in again.stderr


def test_runs_list_and_prune(store_location):
    db = str(store_location)  # a path, or a PostgreSQL URL (the test cluster's has no password)
    store = open_store(db)
    store.create_run(StoredRun("old", "calc", "h", {}, "done", created_at=1.0, ended_at=2.0))
    store.create_run(StoredRun("live", "calc", "h", {}, "running", created_at=3.0))
    store.close()
    listed = cli("runs", "list", "--db", str(db))
    assert listed.returncode == 0 and "old" in listed.stdout and "live" in listed.stdout
    bad = cli("runs", "prune", "--db", str(db), "--older-than", "soon")
    assert bad.returncode == 2 and "duration 'soon'" in bad.stderr
    pruned = cli("runs", "prune", "--db", str(db), "--older-than", "1h")
    assert pruned.returncode == 0 and "deleted 1 ended run(s)" in pruned.stdout
    store = open_store(db)
    assert [r.run_id for r in store.runs()] == ["live"]
    store.close()
    missing = cli("resume", "nope", "--db", str(db))
    assert missing.returncode == 2 and "run 'nope' is not in the run store" in missing.stderr
