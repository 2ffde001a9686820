"""Engine workers over MQTT end to end: a real mosquitto, two `agentrt engine-worker` processes on
a tiny random model, and the runtime on RemoteEngineBackend."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from agentrt.bench import scale_procs
from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.backend import LLMRequest, NodeIdentity
from agentrt.runtime.remote_backend import RemoteEngineBackend
from agentrt.tools.mosquitto import MosquittoBroker


class EngineWorkers(scale_procs.EngineWorkers):
    """Engine-worker processes e1, e2 on one broker, on a tiny model, each with its metrics on a port
    of its own; dead ones are started again by ensure()."""

    env = {"OMP_NUM_THREADS": "1"}

    def __init__(self, broker: MosquittoBroker, model: str, log_dir) -> None:
        super().__init__(broker.url, model, log_dir, [
            "--dtype", "float32", "--spec", "none", "--kv-cache-tokens", "4096", "--no-prefault-kv", "--no-warm-up",
            "--status-interval", "0.3", "--log-level", "WARNING"])
        self.broker = broker
        self.metrics_ports: dict[str, int] = {}

    def start(self, worker: str, *more: str) -> None:
        from agentrt.tools.mosquitto import free_port

        self.metrics_ports[worker] = free_port()
        super().start(worker, "--metrics-port", str(self.metrics_ports[worker]), *more)

    def ensure(self) -> None:
        for worker in ("e1", "e2"):
            if worker not in self.procs or self.procs[worker].poll() is not None:
                self.start(worker)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return str(tiny_model_dir("smollm"))


@pytest.fixture(scope="module")
def workers(tiny_model, tmp_path_factory):
    with MosquittoBroker() as broker:
        pool = EngineWorkers(broker, tiny_model, tmp_path_factory.mktemp("engine-workers"))
        try:
            yield pool
        finally:
            pool.stop()


@pytest.fixture
async def remote(workers):
    workers.ensure()
    backend = await RemoteEngineBackend(workers.broker.config(), accept_timeout_s=10.0).start()
    try:
        await backend.wait_for_workers(2, timeout=60)
        yield backend
    finally:
        await backend.aclose()


@pytest.fixture(scope="module")
def local_engine(tiny_model):
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig
    from agentrt.runtime.engine_backend import EngineBackend

    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_model, dtype="float32", spec=SpecConfig(drafter="none"),
                                                kv_cache_tokens=4096)))
    backend = EngineBackend(engine)
    yield backend
    backend.close()
    engine.close()


def two_calls() -> Program:
    p = Program("remote-two", inputs={"topic": str})
    first = p.llm("first", prompt="Say something about {topic}.", max_tokens=12)
    p.output(p.llm("second", continues=first, prompt="And one more thing.", max_tokens=12))
    return p


async def test_a_program_on_remote_workers_writes_what_the_in_process_engine_writes(remote, local_engine):
    lane = []
    remote.subscribe_steps(lane.append)
    rt = Runtime(remote)
    try:
        result = await asyncio.wait_for(rt.run(two_calls(), {"topic": "rivers"}), 60)
    finally:
        await rt.aclose()
    local_rt = Runtime(local_engine)
    try:
        expected = await asyncio.wait_for(local_rt.run(two_calls(), {"topic": "rivers"}), 60)
    finally:
        await local_rt.aclose()
    assert result.ok, result.error
    assert result.output == expected.output and result.output
    assert result.values["first"] == expected.values["first"]
    spans = [s["attributes"] for s in rt.trace.records()
             if s["type"] == "span" and s["parent_id"] is None and "agentrt.node" in s["attributes"]]
    assert {a["agentrt.node"] for a in spans} == {"first", "second"}
    for attrs in spans:  # usage and the engine's per-request steps crossed the wire
        assert attrs["gen_ai.usage.output_tokens"] > 0 and attrs["gen_ai.usage.input_tokens"] > 0
    assert lane and {s.worker for s in lane} <= {"e1", "e2"}  # the workers' engine lanes
    assert (await remote.kv_blocks())["total"] > 0


async def test_a_worker_killed_mid_generation_the_call_finishes_on_the_other(remote, workers, local_engine):
    request = LLMRequest(({"role": "user", "content": "Count on and on."},), {"type": "text"}, 160, 0.0,
                         NodeIdentity("run-kill", "p", "long"), sampling={"ignore_eos": True})
    expected = await local_engine.complete(request)
    handles, pieces, steps, killed = [], [], [], []

    def on_text(delta: str) -> None:
        pieces.append(delta)
        if len(pieces) == 2:  # generating: kill its worker
            killed.append(handles[0].worker)
            workers.kill(killed[0])

    response = await asyncio.wait_for(remote.complete(request, on_start=handles.append, on_text=on_text,
                                                      on_step=steps.append), 60)
    (killed,) = killed
    assert response.finish_reason == "length", response.error
    assert response.worker != killed and response.retries == 1
    assert response.token_ids == expected.token_ids and response.text == expected.text  # greedy: reproduced
    assert "".join(pieces) == response.text  # nothing streamed twice
    assert {s.worker for s in steps} == {killed, response.worker}
    assert handles == [handles[0]] and handles[0].worker == response.worker  # set_priority follows the retry


async def test_continued_calls_of_a_run_land_on_the_worker_holding_their_kv(remote):
    steps: dict[tuple[str, str], set[str]] = {}
    complete = remote.complete

    async def recording(request, **kw):
        on_step = kw.pop("on_step")

        def step(ev):
            steps.setdefault((request.node.run_id, request.node.node), set()).add(ev.worker)
            on_step(ev)

        return await complete(request, on_step=step, **kw)

    remote.complete = recording
    rt = Runtime(remote)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(rt.run(two_calls(), {"topic": t})
                                                          for t in ("rivers", "hills", "roads", "woods"))), 90)
    finally:
        await rt.aclose()
    assert all(r.ok for r in results), [r.error for r in results]
    first = {r.run_id: steps[(r.run_id, "first")] for r in results}
    assert all(len(w) == 1 for w in first.values()), first
    assert set().union(*first.values()) == {"e1", "e2"}  # the first calls were spread over both workers
    for r in results:  # each continuing call ran where its conversation's KV was
        assert steps[(r.run_id, "second")] == first[r.run_id]
    assert remote.affinity_routed >= len(results)


def test_serve_with_engines_answers_chat_on_the_workers(workers, tmp_path, local_engine):
    import json
    import urllib.request

    from agentrt.server.process import wait_ready
    from agentrt.tools.mosquitto import free_port

    workers.ensure()
    port, log = free_port(), tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--no-db",
                             "--runs-dir", str(tmp_path / "runs"), "--engines", workers.broker.url, "--model", "tiny"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, timeout_s=60)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 8,
                "temperature": 0, "logprobs": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            served_metrics = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(30)
    request = LLMRequest(tuple(body["messages"]), {"type": "text"}, 8, 0.0, NodeIdentity("chat", "chat", "chat"))
    expected = asyncio.run(local_engine.complete(request))
    assert answer["choices"][0]["message"]["content"] == expected.text
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
    assert len(answer["choices"][0]["logprobs"]["content"]) == len(expected.token_ids)  # streamed by the worker
    assert "engine workers online: e" in log.read_text()  # no model was loaded in the server
    # the server's metrics name it (replica HOST:PORT) and the engine worker that ran the call (labels
    # in name order)
    replica = f'replica="{socket.gethostname()}:{port}"'
    (ran,) = [w for w in ("e1", "e2") if f'agentrt_output_tokens_total{{engine="{w}",{replica}}}' in served_metrics]
    assert f'agentrt_kv_blocks{{engine="{ran}",{replica},state="total"}}' in served_metrics
    # and the worker's own metrics (--metrics-port): its engine steps, requests and KV, under its id
    with urllib.request.urlopen(f"http://127.0.0.1:{workers.metrics_ports[ran]}/metrics", timeout=10) as r:
        own = r.read().decode()
    labels = f'engine="{ran}",replica="{ran}"'
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in own.splitlines() if line and line[0] != "#"}
    assert values[f"agentrt_output_tokens_total{{{labels}}}"] >= len(expected.token_ids)  # and earlier tests' calls
    assert f"agentrt_engine_steps_total{{{labels}}}" in own and f'agentrt_kv_blocks{{{labels},state="total"}}' in own


async def test_cancel_aborts_on_the_worker_and_pin_holds_kv_there(remote):
    async def worker_status(worker: str, pred, timeout: float = 5.0) -> dict:
        deadline = asyncio.get_running_loop().time() + timeout
        while not pred(status := remote.workers().get(worker, {})):
            assert asyncio.get_running_loop().time() < deadline, status
            await asyncio.sleep(0.05)
        return status

    short = LLMRequest(({"role": "user", "content": "Hold this."},), {"type": "text"}, 40, 0.0,
                       NodeIdentity("run-pin", "p", "held"), sampling={"ignore_eos": True})
    response = await remote.complete(short)
    pinned = asyncio.Event()
    pin = remote.pin(response, 3.0, lambda _pin: pinned.set())
    await asyncio.wait_for(pinned.wait(), 10)
    assert pin.blocks and pin.blocks > 0
    await worker_status(response.worker, lambda s: (s.get("kv") or {}).get("pinned", 0) >= pin.blocks)

    long = LLMRequest(({"role": "user", "content": "Go on."},), {"type": "text"}, 440, 0.0,
                      NodeIdentity("run-cancel", "p", "long"), sampling={"ignore_eos": True})
    handles, writing = [], asyncio.Event()
    task = asyncio.create_task(remote.complete(long, on_start=handles.append, on_text=lambda _t: writing.set()))
    await asyncio.wait_for(writing.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await worker_status(handles[0].worker, lambda s: s.get("calls") == 0 and s.get("running") == 0)


async def test_a_prefill_ahead_runs_on_a_worker_and_its_call_follows_it_there(remote):
    from agentrt.tools import tool

    holder: list[str] = []

    def pinned() -> dict[str, int]:
        return {w: (s.get("kv") or {}).get("pinned", 0) for w, s in remote.workers().items()}

    before = pinned()

    @tool
    async def weather(city: str) -> str:
        """The weather report for a city."""
        for _ in range(200):  # returns once a worker holds the next call's prompt start
            holder[:] = [w for w, n in pinned().items() if n > before.get(w, 0)]
            if holder:
                break
            await asyncio.sleep(0.05)
        # that worker looks busier than the other (calls of other programs), so load alone would
        # send the call elsewhere
        remote._workers[holder[0]].in_flight += 5
        return f"{city}: sunny, 21 C"

    p = Program("ahead", inputs={"city": str}, tools=[weather])
    report = p.tool("report", "weather", args={"city": p.input("city")})
    p.output(p.llm("plan", system="You plan one day outdoors from the weather report. " * 6,
                   prompt="Plan a day in {city}. Weather: {report}.", max_tokens=6))
    rt = Runtime(remote, tools=[weather], prefill_ahead=True)
    try:
        result = await asyncio.wait_for(rt.run(p, {"city": "Oslo"}), 60)
    finally:
        await rt.aclose()
        if holder:
            remote._workers[holder[0]].in_flight -= 5
    assert result.ok, result.error
    (plan,) = [s["attributes"] for s in rt.trace.records() if s["type"] == "span" and s["parent_id"] is None
               and s["attributes"].get("agentrt.node") == "plan"]
    assert plan["agentrt.prefill_ahead.tokens"] > 0
    # the call went where that KV was
    assert plan["gen_ai.usage.cache_read.input_tokens"] > 0


async def test_broker_routing_spreads_shared_calls_and_a_killed_worker_s_call_finishes_on_the_other(
        workers, local_engine):
    """routing="broker": calls go to the group's shared subscription and mosquitto hands each to one
    of the two workers; a worker killed mid-call has its call sent again, to the other, by name."""
    workers.ensure()
    remote = await RemoteEngineBackend(workers.broker.config(), accept_timeout_s=10.0, routing="broker").start()
    try:
        await remote.wait_for_workers(2, timeout=60)
        steps: list = []
        calls = [LLMRequest(({"role": "user", "content": f"Name a colour, {i}."},), {"type": "text"}, 4, 0.0,
                            NodeIdentity(f"run-shared-{i}", "p", "n")) for i in range(8)]
        answers = await asyncio.wait_for(asyncio.gather(*(remote.complete(c, on_step=steps.append) for c in calls)), 60)
        assert all(a.error is None for a in answers), [a.error for a in answers]
        assert {a.worker for a in answers} == {"e1", "e2"}  # the broker spread them over both
        assert remote.affinity_routed == 0 and remote.retried == 0

        request = LLMRequest(({"role": "user", "content": "Count on and on."},), {"type": "text"}, 160, 0.0,
                             NodeIdentity("run-shared-kill", "p", "long"), sampling={"ignore_eos": True})
        expected = await local_engine.complete(request)
        handles, pieces, killed = [], [], []

        def on_text(delta: str) -> None:
            pieces.append(delta)
            if len(pieces) == 2:
                killed.append(handles[0].worker)
                workers.kill(killed[0])

        response = await asyncio.wait_for(remote.complete(request, on_start=handles.append, on_text=on_text), 60)
        assert killed and response.worker != killed[0] and response.retries == 1, response.error
        assert response.token_ids == expected.token_ids and "".join(pieces) == response.text
    finally:
        await remote.aclose()


def test_round_robin_routing_takes_the_workers_in_turn_and_an_unknown_mode_is_refused():
    from agentrt.runtime.remote_routing import Router, WorkerState

    router = Router("round-robin")
    status = {"max_num_seqs": 8, "kv": {"free": 100}}
    for w in ("e2", "e1"):
        router.workers[w] = WorkerState(w, status, 0.0)
    request = LLMRequest(({"role": "user", "content": "Hi."},), {"type": "text"}, 4, 0.0, NodeIdentity("r", "p", "n"),
                         hints={"continues": "first"})
    router.remember(("node", "r", "first"), "e2")  # affinity would send it to e2 every time
    assert [router.route(request, set()) for _ in range(4)] == ["e1", "e2", "e1", "e2"]
    assert router.route(request, {"e1"}) == "e2" and router.affinity_routed == 0
    with pytest.raises(ValueError, match="engine routing 'nearest': choose one of affinity, round-robin, broker"):
        Router("nearest")
