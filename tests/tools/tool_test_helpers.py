"""Helpers for the tool tests (a module of its own: tests/ is not a package, `conftest` is ambiguous)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER_TOOLS = str(Path(__file__).parent / "worker_tools.py")
REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """`python -m agentrt.cli worker tests/tools/worker_tools.py` as a subprocess."""

    def __init__(self, broker_url: str, worker_id: str, log_dir: Path, *extra: str, env: dict | None = None) -> None:
        self.worker_id = worker_id
        self.log_path = log_dir / f"worker-{worker_id}.log"
        cmd = [sys.executable, "-m", "agentrt.cli", "worker", WORKER_TOOLS, "--broker", broker_url,
               "--id", worker_id, "--log-level", "INFO", *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


async def wait_for_file(path: Path, timeout: float = 10.0) -> str:
    """The file's content once it exists (polling; the call under test runs in another process)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        await asyncio.sleep(0.01)
    return path.read_text()


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)
