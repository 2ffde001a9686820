"""The processes of `agentrt bench scale`: engine workers (`agentrt engine-worker`) on one mosquitto
broker, and two `agentrt serve` replicas on one PostgreSQL database, one of them killed with
SIGKILL to time the other's take-over of its runs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The failover program: a tool long enough that the runs are in it when their replica is killed
# (idempotent, so the replica that takes a run over starts it again), then one short LLM call.
FAILOVER_PROGRAM = '''
import time

from agentrt.dag import Program
from agentrt.tools import tool


@tool(idempotent=True)
def pause(seconds: float) -> str:
    "Wait this many seconds, then say so."
    time.sleep(seconds)
    return "waited"


tools = [pause]
DEFAULT_INPUTS = {"topic": "rivers"}

p = Program("failover", inputs={"topic": str}, tools=tools)
waited = p.tool("wait", "pause", args={"seconds": TOOL_S})
p.output(p.llm("say", prompt="Say one thing about {topic}, then {wait}.", max_tokens=8))
program = p.compile()
'''


class EngineWorkers:
    """`agentrt engine-worker` processes on one broker, by id, each with the same model and
    options (`options`: more engine-worker arguments); each logs to LOG_DIR/ID.log."""

    env: dict[str, str] = {}  # more environment for the workers

    def __init__(self, broker_url: str, model: str, log_dir: Path, options: list[str]) -> None:
        self.broker_url, self.model, self.log_dir, self.options = broker_url, model, log_dir, options
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker: str, *more: str) -> None:
        with (self.log_dir / f"{worker}.log").open("ab") as log:
            self.procs[worker] = subprocess.Popen(
                [sys.executable, "-m", "agentrt.cli", "engine-worker", "--broker", self.broker_url, "--id", worker,
                 "--model", self.model, *self.options, *more], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env})

    def kill(self, worker: str) -> None:
        self.procs[worker].send_signal(signal.SIGKILL)
        self.procs[worker].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def remote_backend(broker: Any, workers: int, routing: str = "affinity", timeout_s: float = 300.0) -> Any:
    """A RemoteEngineBackend once `workers` engine workers are online (they load and warm up first)."""
    from agentrt.runtime.remote_backend import RemoteEngineBackend

    backend = await RemoteEngineBackend(broker.config(), routing=routing, accept_timeout_s=30.0).start()
    try:
        await backend.wait_for_workers(workers, timeout=timeout_s)
    except BaseException:
        await backend.aclose()
        raise
    return backend


def failover_time(tmp: Path, db_url: str, broker_url: str, model: str, lease_s: float, runs: int,
                  tool_s: float = 3.0) -> dict[str, Any]:
    """Two replicas (A, B) on db_url with their LLM calls on the broker's engine workers; `runs`
    runs submitted to A, A killed with SIGKILL while they wait in their tool (tool_s long): seconds from the kill
    to every run claimed by B (its owner in the store, where B resumes it at once), and the runs'
    end status (B finishes them)."""
    import psycopg

    from agentrt.client.sync import Client
    from agentrt.server.process import start_server
    from agentrt.tools.mosquitto import free_port

    program = tmp / "failover_program.py"
    program.write_text(FAILOVER_PROGRAM.replace("TOOL_S", repr(float(tool_s))))
    started: list[tuple[subprocess.Popen, Client, str]] = []

    def replica(name: str) -> None:
        folder = tmp / f"replica-{name}"
        folder.mkdir(exist_ok=True)
        port = free_port()
        proc, url = start_server([str(program), "--engines", broker_url, "--model", model, "--runs-dir",
                                  str(folder), "--db", db_url, "--lease-s", str(lease_s), "--shutdown-grace", "1"],
                                 folder, port, tmp)
        started.append((proc, Client(url), f"{socket.gethostname()}:{port}"))

    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            for f in [pool.submit(replica, name) for name in ("a", "b")]:
                f.result()
        (proc_a, client_a, _), (_, client_b, id_b) = started
        run_ids = [client_a.start_run("failover", {"topic": f"place {i}"}).run_id for i in range(runs)]
        time.sleep(tool_s / 3)  # every run is in its tool
        t0 = time.monotonic()
        proc_a.send_signal(signal.SIGKILL)
        proc_a.wait()
        with psycopg.connect(db_url, autocommit=True) as conn:
            while True:
                (claimed,) = conn.execute("SELECT count(*) FROM runs WHERE run_id = ANY(%s) AND owner = %s",
                                          (run_ids, id_b)).fetchone()
                if claimed == len(run_ids):
                    break
                if time.monotonic() - t0 > 10 * lease_s + 30:
                    raise RuntimeError(f"replica B claimed {claimed} of {len(run_ids)} runs of the killed replica")
                time.sleep(0.02)
        failover_s = time.monotonic() - t0
        statuses = [client_b.wait(run_id, timeout=120).status for run_id in run_ids]
        return {"failover_s": failover_s, "statuses": statuses}
    finally:
        for proc, client, _ in started:
            client.close()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

