"""Tools served by the worker subprocesses of the MQTT tests (loaded by path by `agentrt worker`).

Tools that the tests need to observe from outside write marker files: the marker's content is
the worker's pid, so a test can kill the very worker that is running a call.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from agentrt.tools import tool


def _mark(marker: str, suffix: str = "") -> None:
    path = Path(marker + suffix)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(path)  # atomic: a reader never sees an empty file


@tool(idempotent=True)
async def echo(x: int, text: str = "") -> dict:
    """Return the arguments."""
    return {"x": x, "text": text}


@tool(idempotent=True)
def nap(seconds: float) -> int:
    """Block this worker's slot for `seconds` (a sync tool: runs on a thread). Returns the pid."""
    time.sleep(seconds)
    return os.getpid()


async def _hold(marker: str, release: str, seconds: float) -> int:
    _mark(marker)
    deadline = time.monotonic() + seconds
    while not Path(release).exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return os.getpid()


@tool(idempotent=True)
async def slow_idempotent(marker: str, release: str, seconds: float = 60) -> int:
    """Mark that the call started, then wait until the release file exists. Returns the pid."""
    return await _hold(marker, release, seconds)


@tool(idempotent=False)
async def slow_once(marker: str, release: str, seconds: float = 60) -> int:
    """Like slow_idempotent, but not safe to run twice."""
    return await _hold(marker, release, seconds)


@tool
async def cancellable(seconds: float, marker: str) -> str:
    """Sleep; leave MARKER.cancelled if the call is cancelled."""
    _mark(marker)
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _mark(marker, ".cancelled")
        raise
    return "finished"


@tool(retries=3, backoff_s=0.01, retry_on=ConnectionRefusedError)
def charge(marker: str) -> str:
    """Not idempotent: refused at first (retried), then declined (not retried). Counts its calls
    in the marker file."""
    path = Path(marker)
    calls = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(calls))
    raise ConnectionRefusedError("gateway down") if calls == 1 else ValueError("card declined")


@tool
def record(text: str, marker: str) -> str:
    """Write `text` to the marker file (proves the tool ran)."""
    Path(marker).write_text(text)
    return text


@tool
def big(n: int) -> str:
    """A string of n bytes."""
    return "x" * n


@tool
def boom(message: str) -> str:
    """Always raises ValueError(message)."""
    raise ValueError(message)


@tool(timeout_s=1.0)
async def limited(seconds: float) -> str:
    """Sleeps `seconds` under a declared 1 s limit."""
    await asyncio.sleep(seconds)
    return "done"
