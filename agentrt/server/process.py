"""Starting an `agentrt serve` process and waiting for it to answer /ready (the benchmarks and
the tests that start one)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    """Return once GET url/ready answers 200; RuntimeError with the log's tail if the process
    exits first or timeout_s passes (the caller decides whether to kill it)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agentrt serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"agentrt serve was not ready in {timeout_s} s: {log.read_text()[-2000:]}")


def start_server(args: list[str], runs: Path, port: int, cwd: Path, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """`agentrt serve ARGS --port PORT` as a process logging to runs/server.log, once it is ready:
    (process, base URL). Killed if it does not get ready (RuntimeError with the log's tail)."""
    log_path = runs / "server.log"
    with log_path.open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", *args, "--port", str(port)], cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log_path, timeout_s=timeout_s)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url
