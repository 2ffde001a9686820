"""`agentrt bench tools`: tool-call round trip and throughput, in-process vs MQTT workers.

Side by side in one run: the in-process executor, then MQTT with 1 and with 4 worker processes
(`agentrt worker agentrt.bench.tools`, real subprocesses on a local mosquitto). Two tools:
`echo` (async, returns its argument: the round trip is all overhead) and `sleep_50ms` (a sync
tool holding a worker slot for 50 ms: the work that scale-out spreads). Each worker runs
WORKER_SLOTS calls at once, so capacity grows with workers, not within one.

Summary: mqtt_p50_ms / mqtt_p99_ms (echo, one call at a time, 1 worker) and scaleout_4_vs_1
(sleep_50ms calls/s with 4 workers over 1). Goals: mqtt_p50_ms < 5, scaleout_4_vs_1 >= 3.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

from agentrt.tools import tool

WORKER_SLOTS = 4  # calls one worker runs at once
SLEEP_IN_FLIGHT = 64  # concurrent sleep_50ms calls: enough to keep 4 workers x 4 slots busy
ECHO_IN_FLIGHT = 32


@tool(idempotent=True)
async def echo(x: int) -> int:
    """Return x (measures the call path, not the work)."""
    return x


@tool(idempotent=True)
def sleep_50ms(x: int) -> int:
    """Block for 50 ms, then return x (a slow, blocking tool)."""
    time.sleep(0.05)
    return x


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def _latency(registry: Any, calls: int) -> tuple[float, float, int]:
    """p50, p99 in ms of sequential echo calls, and the number that failed."""
    for i in range(20):  # warm up: connections, caches, thread pools
        await registry.call("echo", {"x": i})
    times, failed = [], 0
    for i in range(calls):
        t0 = time.perf_counter()
        result = await registry.call("echo", {"x": i})
        times.append(time.perf_counter() - t0)
        failed += not result.ok
    times.sort()
    return _pct(times, 0.5) * 1e3, _pct(times, 0.99) * 1e3, failed


async def _throughput(registry: Any, name: str, in_flight: int, seconds: float) -> tuple[float, int]:
    """Completed calls/s with `in_flight` callers looping for `seconds`, and failures."""
    done, failed = 0, 0
    deadline = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        nonlocal done, failed
        while time.perf_counter() < deadline:
            result = await registry.call(name, {"x": k})
            done += result.ok
            failed += not result.ok

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(in_flight)))
    return done / (time.perf_counter() - t0), failed


async def _measure(registry: Any, label: str, workers: int, quick: bool) -> dict[str, Any]:
    seconds = 2.0 if quick else 6.0
    p50, p99, lat_failed = await _latency(registry, 300 if quick else 3000)
    echo_rate, echo_failed = await _throughput(registry, "echo", ECHO_IN_FLIGHT, seconds)
    sleep_rate, sleep_failed = await _throughput(registry, "sleep_50ms", SLEEP_IN_FLIGHT, seconds)
    return {"executor": label, "workers": workers, "p50_ms": p50, "p99_ms": p99, "echo_calls_s": echo_rate,
            "sleep50_calls_s": sleep_rate, "failed": lat_failed + echo_failed + sleep_failed}


def _start_workers(url: str, n: int) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "agentrt.cli", "worker", "agentrt.bench.tools", "--broker", url,
           "--concurrency", str(WORKER_SLOTS), "--log-level", "WARNING"]
    return [subprocess.Popen([*cmd, "--id", f"bench-{os.getpid()}-{i}"], stdin=subprocess.DEVNULL) for i in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _bench(quick: bool) -> list[dict[str, Any]]:
    from agentrt.tools import ToolRegistry
    from agentrt.tools.mosquitto import MosquittoBroker
    from agentrt.tools.mqtt_client import MqttDispatcher

    rows = []
    async with ToolRegistry([echo, sleep_50ms]) as local:
        rows.append(await _measure(local, "inprocess", 0, quick))
    with MosquittoBroker() as broker:
        for n in (1, 4):
            procs = _start_workers(broker.url, n)
            try:
                async with MqttDispatcher(broker.config()) as dispatcher:
                    await dispatcher.wait_for_workers(n, timeout=60)
                    registry = ToolRegistry(executors={"mqtt": dispatcher})
                    for t in (echo, sleep_50ms):
                        registry.register(t, executor="mqtt")
                    rows.append(await _measure(registry, "mqtt", n, quick))
            finally:
                _stop(procs)
    return rows


def run(args: Any):
    from agentrt.bench.common import BenchResult

    quick = bool(getattr(args, "quick", False))
    rows = asyncio.run(_bench(quick))
    by = {(r["executor"], r["workers"]): r for r in rows}
    one, four = by[("mqtt", 1)], by[("mqtt", 4)]
    summary = {
        "inprocess_p50_ms": by[("inprocess", 0)]["p50_ms"],
        "mqtt_p50_ms": one["p50_ms"],
        "mqtt_p99_ms": one["p99_ms"],
        "mqtt4_p50_ms": four["p50_ms"],
        "sleep50_calls_s_1": one["sleep50_calls_s"],
        "sleep50_calls_s_4": four["sleep50_calls_s"],
        "scaleout_4_vs_1": four["sleep50_calls_s"] / one["sleep50_calls_s"],
        "failed_calls": sum(r["failed"] for r in rows),
    }
    notes = [
        f"p50/p99: sequential echo calls; calls/s: {ECHO_IN_FLIGHT} (echo) or {SLEEP_IN_FLIGHT} (sleep_50ms) "
        f"callers in flight; each MQTT worker is a separate process running {WORKER_SLOTS} calls at once "
        f"(ideal sleep_50ms capacity {WORKER_SLOTS * 20} calls/s per worker).",
        f"goals: mqtt_p50_ms < 5 ({'met' if summary['mqtt_p50_ms'] < 5 else 'NOT met'}), "
        f"scaleout_4_vs_1 >= 3 ({'met' if summary['scaleout_4_vs_1'] >= 3 else 'NOT met'}); "
        f"{os.cpu_count()} CPUs shared by the broker, the workers and this process.",
    ]
    config = {"quick": quick, "worker_slots": WORKER_SLOTS, "echo_in_flight": ECHO_IN_FLIGHT,
              "sleep_in_flight": SLEEP_IN_FLIGHT}
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)
