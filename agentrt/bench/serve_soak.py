"""`agentrt bench serve --soak MINUTES`: a server's memory and leftovers under steady mixed load.

`agentrt serve` on the example programs runs in its own process (its RSS is the process's alone).
A driver submits one program run every 1/rate seconds for MINUTES (trip_planner, research,
sql_agent and refund_desk in turn; every other run followed over its SSE event stream, the others
waited for with /wait; a refund_desk run is always followed, and its approval posted when it asks)
and, with each run, `--soak-chats` chat completions (streamed and not, in turn: plain text, a JSON
schema response format drawn from a family of 32 schemas, and tool calls). At most
`--soak-inflight` runs are in flight: when the server falls behind the rate, the driver waits
rather than queueing without end (the achieved rate is reported). With `--soak-limits small`
(the default) the server's bounded caches and records (finished runs kept, the drafters' history,
compiled grammars) are set small enough to fill during warm-up, so what grows after it is a leak,
not a cache still filling; the KV cache is the server's default, mapped at start.

Reported: RSS when the server is ready, after warm-up (the first `--soak-warmup` fraction of the
runs: caches fill then) and at the end (all work done, a second idle); growth after warm-up per
1000 runs: RSS is read every 2 s, and the server trims its heap every 10 s, so RSS saws by ~20 MB
around what the server holds; each minute's lowest reading (the floor: what is still held after
the trims) is fitted against runs ended, by least squares (`growth_all_samples_mb_per_1000_runs`:
the same fit over every reading); and what is left over when all work has
ended: KV blocks in use (/metrics), runs not ended (/metrics) and threads beyond those at the end
of warm-up. Rows of the table: RSS every 15 s or so.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.bench.prompts import TOOLS, mixed_prompts
from agentrt.bench.workload_load import EXAMPLES_DIR, INPUTS
from agentrt.errors import RunConfigError
from agentrt.server.process import wait_ready
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("trip_planner", "research", "sql_agent", "refund_desk")
REFUND_INPUTS = [{"order_id": 1041, "message": "The kettle leaks. I would like a refund."},
                 {"order_id": 1042, "message": "The grinder I got last week has a cracked handle. Can I get my money back?"},
                 {"order_id": 1043, "message": "The teapot lid does not fit. Please refund me."}]
LINE_KEYS = ("rss_ready_mb", "rss_end_mb", "growth_mb_per_1000_runs", "leftover_kv", "leftover_runs", "leftover_threads")
SAMPLE_S = 2.0  # the server's RSS is read this often
FLOOR_WINDOW_S = 60.0  # the growth is fitted to each window's lowest reading
TICK_TIMEOUT_S = 300.0  # a run and its chats not answered by then are given up (and reported)
SCHEMA_FAMILY = 32  # distinct response-format schemas the chats draw from (a grammar cache sees each again)
# Bounds small enough to be reached during a few minutes' warm-up (docs/limits.md has the defaults).
SMALL_LIMITS = ["--keep-runs", "16", "--draft-history-tokens", "4096", "--grammar-cache-mb", "4"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="instead of the other parts: a soak of MINUTES of mixed runs and chats (memory, leftovers)")
    p.add_argument("--soak-rate", type=float, default=30.0, metavar="RUNS_PER_MIN", help="program runs per minute")
    p.add_argument("--soak-chats", type=int, default=2, metavar="N", help="chat completions with each run")
    p.add_argument("--soak-inflight", type=int, default=8, metavar="N", help="most runs in flight at once")
    p.add_argument("--soak-warmup", type=float, default=0.3, metavar="FRACTION",
                   help="the fraction of the runs that is warm-up (growth is measured after it)")
    p.add_argument("--soak-max-tokens", type=int, default=48, metavar="N",
                   help="chat max_tokens, and the cap on every program LLM call (--program-max-tokens)")
    p.add_argument("--soak-limits", choices=["small", "default"], default="small",
                   help="small: the server's bounded caches and records are set small, so they fill during "
                        "warm-up and what grows after it is a leak; default: the server's defaults")


@dataclass(frozen=True)
class SoakLoad:
    seconds: float
    runs_per_min: float = 30.0
    chats_per_run: int = 2
    max_inflight: int = 8
    warmup_fraction: float = 0.3
    max_tokens: int = 48

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise RunConfigError(f"--soak must be a positive number of minutes, got {self.seconds / 60:g}")
        if not self.runs_per_min > 0:
            raise RunConfigError(f"--soak-rate must be positive, got {self.runs_per_min:g}")
        if self.chats_per_run < 0 or self.max_inflight < 1 or self.max_tokens < 1:
            raise RunConfigError("--soak-chats must be >= 0, --soak-inflight and --soak-max-tokens >= 1")
        if not 0 <= self.warmup_fraction < 1:
            raise RunConfigError(f"--soak-warmup must be in [0, 1), got {self.warmup_fraction:g}")


# ---- the server process --------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (kB) and Threads of a process, from /proc (Linux)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return out


def rss_mb(pid: int) -> float:
    return round(proc_status(pid)["VmRSS"] / 1024, 1)


class ServerProcess:
    """`agentrt serve` on the example programs, in its own process, with its own runs directory."""

    def __init__(self, model: str, dtype: str, max_tokens: int, workdir: Path, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "serve.log"
        argv = [sys.executable, "-m", "agentrt.cli", "serve", *(str(EXAMPLES_DIR / f"{p}.py") for p in PROGRAMS),
                "--port", str(self.port), "--model", model, "--dtype", dtype, "--no-access-log",
                "--runs-dir", str(workdir / "runs"), "--program-max-tokens", str(max_tokens), *(extra or [])]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 300.0) -> None:
        wait_ready(self.url, self.proc, self.log, timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


async def scrape(http: Any, url: str) -> dict[str, float]:
    """KV blocks by state and runs by state, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("agentrt_kv_blocks", "agentrt_runs_active"):
            for s in family.samples:
                out[f"{family.name.removeprefix('agentrt_')}_{s.labels['state']}"] = s.value
    return out


# ---- the load ------------------------------------------------------------------------------------
def response_schema(i: int) -> dict[str, Any]:
    """The i-th schema of the family: the same shape under different member names."""
    k = i % SCHEMA_FAMILY
    return {"type": "object", "properties": {f"city_{k}": {"type": "string", "maxLength": 24},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 30}},
            "required": [f"city_{k}", "days"]}


def chat_body(i: int, prompts: list[list[dict]], max_tokens: int, model: str) -> dict[str, Any]:
    """The i-th chat: streamed or not (alternating), plain text, a JSON schema format or tools (in turn)."""
    body: dict[str, Any] = {"model": model, "messages": prompts[i % len(prompts)], "max_tokens": max_tokens,
                            "temperature": 0, "stream": i % 2 == 1}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    kind = (i // 2) % 3
    if kind == 1:
        body["messages"] = [{"role": "user", "content": "Pick a city to visit and a number of days, as JSON."}]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"trip{i % SCHEMA_FAMILY}",
                                                                          "schema": response_schema(i)}}
    elif kind == 2:
        body["messages"] = [{"role": "user", "content": "What is the weather in Oslo tomorrow?"}]
        body["tools"] = TOOLS[: 1 + i % len(TOOLS)]
    return body


def run_request(i: int) -> tuple[str, dict[str, Any], bool]:
    """The i-th run: (program, inputs, followed over SSE)."""
    program = PROGRAMS[i % len(PROGRAMS)]
    options = REFUND_INPUTS if program == "refund_desk" else INPUTS[program]
    inputs = options[(i // len(PROGRAMS)) % len(options)]
    return program, inputs, program == "refund_desk" or (i // len(PROGRAMS)) % 2 == 1


@dataclass
class Tally:
    runs: int = 0
    runs_done: int = 0
    runs_failed: int = 0
    chats: int = 0
    chats_failed: int = 0
    timed_out: int = 0  # runs given up with their chats after TICK_TIMEOUT_S
    errors: list[str] | None = None

    def error(self, what: str) -> None:
        self.errors = (self.errors or []) + [what]


async def one_chat(http: Any, url: str, body: dict[str, Any], tally: Tally) -> None:
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            tally.chats_failed += 1
            tally.error(f"chat {r.status}: {(await r.text())[:200]}")
            return
        if body["stream"]:
            async for line in r.content:
                if line.strip() == b"data: [DONE]":
                    break
        else:
            await r.json()
    tally.chats += 1


async def follow_events(http: Any, url: str, run_id: str, inputs: dict[str, Any]) -> None:
    """Read the run's event stream to its end; answer a wait_for (refund_desk's approval) when asked."""
    async with http.get(f"{url}/v1/runs/{run_id}/events") as r:
        event = None
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "input_wanted":
                decision = {"approved": inputs["order_id"] != 1042, "note": "checked by the soak"}
                async with http.post(f"{url}/v1/runs/{run_id}/input/approval", json={"value": decision}) as a:
                    if a.status != 200:
                        raise RuntimeError(f"approval of {run_id}: {a.status} {await a.text()}")


async def one_run(http: Any, url: str, i: int, tally: Tally) -> None:
    program, inputs, followed = run_request(i)
    async with http.post(f"{url}/v1/programs/{program}/runs", json={"inputs": inputs}) as r:
        if r.status != 201:
            tally.runs_failed += 1
            tally.error(f"submit {program} {r.status}: {(await r.text())[:200]}")
            return
        run_id = (await r.json())["run_id"]
    if followed:
        await follow_events(http, url, run_id, inputs)
    async with http.get(f"{url}/v1/runs/{run_id}/wait", params={"timeout": "600"}) as r:
        info = await r.json()
    tally.runs += 1
    if info["status"] == "done":
        tally.runs_done += 1
    else:
        tally.runs_failed += 1
        tally.error(f"{program} {run_id} ended {info['status']}: {info.get('error')}")


async def drive(server: ServerProcess, load: SoakLoad, model: str, console: Console) -> dict[str, Any]:
    import aiohttp

    prompts = mixed_prompts(64)
    tally = Tally()
    samples: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        ready = {"rss_mb": rss_mb(server.pid), "threads": proc_status(server.pid)["Threads"]}
        t0 = time.monotonic()
        deadline = t0 + load.seconds
        interval = 60.0 / load.runs_per_min
        planned = max(1, int(load.seconds / interval))
        warm_runs = int(planned * load.warmup_fraction)
        slots = asyncio.Semaphore(load.max_inflight)
        chat_ids = itertools.count()
        tasks: set[asyncio.Task] = set()
        warm: dict[str, Any] = {}

        async def tick(i: int) -> None:
            chats = [one_chat(http, url, chat_body(next(chat_ids), prompts, load.max_tokens, model), tally)
                     for _ in range(load.chats_per_run)]
            try:  # a failed request is counted and the soak goes on; one that hangs is given up at last
                results = await asyncio.wait_for(asyncio.gather(one_run(http, url, i, tally), *chats,
                                                                return_exceptions=True), TICK_TIMEOUT_S)
                for e in results:
                    if isinstance(e, BaseException):
                        tally.error(f"run {i}: {type(e).__name__}: {e}")
            except TimeoutError:
                tally.timed_out += 1
                tally.error(f"run {i} and its chats: no answer in {TICK_TIMEOUT_S:g} s")
            finally:
                slots.release()

        url = server.url
        curve: list[tuple[float, int, float]] = []  # (elapsed s, runs ended, RSS MB) every SAMPLE_S

        async def sample() -> None:
            next_row = 0.0
            while True:
                elapsed = time.monotonic() - t0
                curve.append((elapsed, tally.runs, rss_mb(server.pid)))
                if elapsed >= next_row:
                    samples.append({"elapsed_s": round(elapsed, 1), "runs": tally.runs, "chats": tally.chats,
                                    "rss_mb": curve[-1][2], "threads": proc_status(server.pid)["Threads"]})
                    console.print(f"  {samples[-1]}")
                    next_row += max(5.0, load.seconds / 12)
                await asyncio.sleep(SAMPLE_S)

        sampler = asyncio.create_task(sample())
        for i in itertools.count():
            at = t0 + i * interval
            if at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            await slots.acquire()
            if time.monotonic() >= deadline:  # a server behind the rate: no run starts after the end
                slots.release()
                break
            if i == warm_runs and i > 0:  # warm-up over: what every run after it adds is growth
                await asyncio.gather(*tasks)
                warm = {"rss_mb": rss_mb(server.pid), "threads": proc_status(server.pid)["Threads"], "runs": tally.runs,
                        "elapsed_s": round(time.monotonic() - t0, 1)}
                console.print(f"  warm-up over after {tally.runs} runs: RSS {warm['rss_mb']} MB")
                warm["curve_from"] = len(curve)
                curve.append((time.monotonic() - t0, tally.runs, warm["rss_mb"]))
            task = asyncio.create_task(tick(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.0)  # work that ends after its answer (trace writes, releases) has ended
        sampler.cancel()
        left = await scrape(http, url)
        end = {"rss_mb": rss_mb(server.pid), "threads": proc_status(server.pid)["Threads"], "runs": tally.runs}
        curve.append((time.monotonic() - t0, tally.runs, end["rss_mb"]))
        samples.append({"elapsed_s": round(curve[-1][0], 1), "runs": tally.runs, "chats": tally.chats,
                        "rss_mb": end["rss_mb"], "threads": end["threads"]})
    if not warm:  # too short to have a warm-up: growth is measured from ready
        warm = {**ready, "runs": 0, "elapsed_s": 0.0}
    after = curve[warm.get("curve_from", 0):]
    floor = floor_points(after, FLOOR_WINDOW_S)
    growth = growth_per_run(floor if len(floor) >= 3 else [(runs, rss) for _, runs, rss in after])
    growth_all = growth_per_run([(runs, rss) for _, runs, rss in after])
    per_1000 = lambda g: None if g is None else round(g * 1000, 1)  # noqa: E731
    return {"ready": ready, "warm": warm, "end": end, "samples": samples, "tally": tally, "elapsed_s": elapsed,
            "growth_mb_per_1000_runs": per_1000(growth), "growth_all_samples": per_1000(growth_all),
            "floor_windows": len(floor), "left": left}


def floor_points(curve: list[tuple[float, int, float]], window_s: float) -> list[tuple[int, float]]:
    """(runs ended, RSS) at the lowest RSS reading of each whole window_s of the curve ((elapsed s,
    runs ended, RSS MB) readings): what the server holds once its heap trims gave back what they
    can. A leak raises the floor as it raises every reading; the saw of the trims does not."""
    if not curve:
        return []
    start, windows = curve[0][0], {}
    for t, runs, rss in curve:
        w = int((t - start) // window_s)
        if w not in windows or rss < windows[w][1]:
            windows[w] = (runs, rss)
    last = int((curve[-1][0] - start) // window_s)
    return [windows[w] for w in sorted(windows) if w < last or curve[-1][0] - start >= (w + 1) * window_s]


def growth_per_run(points: list[tuple[int, float]]) -> float | None:
    """MB per run: the least-squares slope of RSS over runs ended, from the end of warm-up on. A
    fit, not the two ends: the server's heap trims make RSS a saw of a few MB, and a run of
    ~100 runs would read its phase as growth. None without two distinct run counts."""
    if len({runs for runs, _ in points}) < 2:
        return None
    return statistics.linear_regression([float(r) for r, _ in points], [m for _, m in points]).slope


def soak(load: SoakLoad, model: str, dtype: str, console: Console, workdir: Path | None = None,
         extra_server_args: list[str] | None = None) -> BenchResult:
    """Start the server, drive the load, stop the server; the rows, summary and notes of the soak."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="agentrt-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(model, dtype, load.max_tokens, workdir, extra_server_args)
    console.print(f"[bold]soak[/bold]: agentrt serve on port {server.port} (pid {server.pid}, log {server.log}), "
                  f"{load.seconds / 60:g} min at {load.runs_per_min:g} runs/min with {load.chats_per_run} chats each")
    try:
        server.wait_ready()
        result = asyncio.run(drive(server, load, model, console))
    finally:
        code = server.stop()
    tally: Tally = result["tally"]
    left = result["left"]
    summary = {
        "rss_ready_mb": result["ready"]["rss_mb"],
        "rss_warm_mb": result["warm"]["rss_mb"],
        "rss_end_mb": result["end"]["rss_mb"],
        "growth_mb_per_1000_runs": result["growth_mb_per_1000_runs"],
        "growth_all_samples_mb_per_1000_runs": result["growth_all_samples"],
        "growth_floor_windows": result["floor_windows"],
        "leftover_kv": int(left.get("kv_blocks_used", -1)),
        "leftover_runs": int(sum(left.get(f"runs_active_{s}", 0) for s in ("running", "queued", "waiting"))),
        "leftover_threads": max(0, result["end"]["threads"] - result["warm"]["threads"]),
        "runs": tally.runs,
        "runs_after_warmup": tally.runs - result["warm"]["runs"],
        "runs_failed": tally.runs_failed,
        "chats": tally.chats,
        "chats_failed": tally.chats_failed,
        "timed_out": tally.timed_out,
        "runs_per_min": round(tally.runs / result["elapsed_s"] * 60, 2),
        "server_exit": code,
    }
    notes = [f"server threads: {result['ready']['threads']} ready, {result['warm']['threads']} after warm-up, "
             f"{result['end']['threads']} at the end; KV blocks cached (prefix cache, free to evict): "
             f"{int(left.get('kv_blocks_cached', 0))}"]
    notes += [f"error: {e}" for e in (tally.errors or [])[:10]]
    return BenchResult(result["samples"], summary, notes, name="serve-soak", line_keys=LINE_KEYS)


def run_soak(args: argparse.Namespace, console: Console) -> BenchResult:
    load = SoakLoad(seconds=args.soak * 60, runs_per_min=args.soak_rate, chats_per_run=args.soak_chats,
                    max_inflight=args.soak_inflight, warmup_fraction=args.soak_warmup, max_tokens=args.soak_max_tokens)
    result = soak(load, args.model, args.dtype, console,
                  extra_server_args=SMALL_LIMITS if args.soak_limits == "small" else None)
    result.config.update({"soak_minutes": args.soak, **{k: getattr(load, k) for k in (
        "runs_per_min", "chats_per_run", "max_inflight", "warmup_fraction", "max_tokens")},
                          "server_limits": SMALL_LIMITS if args.soak_limits == "small" else "default"})
    result.notes.append(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return result
