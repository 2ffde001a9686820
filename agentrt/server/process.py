"""Waiting for an `agentrt serve` process to answer /ready (the benchmarks and the tests that
start one)."""
from __future__ import annotations

import subprocess
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
