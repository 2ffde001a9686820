"""Prometheus metrics of a served runtime (prometheus-client, one registry per server).

Engine: steps, batch size, tokens fed, drafted/accepted, max k per step, step time measured and
as the cost model predicted it; KV blocks used and pinned (read at scrape time). Requests: output
tokens, prompt tokens and those served from the prefix cache, drafted/accepted per drafter. Runs:
by status, running and queued, node latency by kind, tool latency by tool. HTTP: requests by
route and status, with durations.

Where they come from: the run metrics (runs by status, node latency by kind, tool latency by
tool) follow the runtime's node events (node_events.py) through `RunMetrics`, a subscriber the
server registers with its others (state.py: `server_subscribers`); a run that ended before it
reached the runtime (cancelled while queued, a program that cannot start) is counted by
`ServerMetrics.run_ended`. The engine metrics are fed by engine steps (`on_step`, from the
backend's step subscription) and responses (`on_response`), which are not node events; HTTP ones
by the access middleware; the gauges are read at scrape time.

Labels: every sample carries `replica` (the server's replica id, HOST:PORT, the one it holds runs
under in a PostgreSQL lease store; an engine worker's id in an engine worker's metrics), and the
engine and request metrics `engine` (`in-process` for the server's own engine, else the engine
worker's id), so that the scrapes of several replicas and workers add up without clashing.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from agentrt.runtime.backend import EngineStep, LLMResponse
from agentrt.runtime.node_events import Dispatching, NodeFinished, RunFinished

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
K_BUCKETS = (0, 1, 2, 4, 8, 12, 16)
IN_PROCESS = "in-process"  # the engine label of a server's own engine


class _ReplicaLabelled(Collector):
    """The samples of a registry, each with the process's constant labels added (prometheus-client
    has no constant labels of its own)."""

    def __init__(self, inner: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.inner, self.labels = inner, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(sample.name, {**self.labels, **sample.labels}, sample.value, sample.timestamp,
                                    sample.exemplar)
            yield labelled


class EngineMetrics:
    """An engine's steps, KV blocks and requests, labelled by engine; every sample also by replica.
    `engine`: the label of steps and responses that name no engine worker of their own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, replica: str, engine: str = IN_PROCESS) -> None:
        self.replica, self.engine = replica, engine
        r = self.registry = CollectorRegistry()
        self.exposed = CollectorRegistry()  # what is scraped: the same samples with the replica label
        self.exposed.register(_ReplicaLabelled(r, {"replica": replica}))
        e = ["engine"]
        self.steps = Counter("agentrt_engine_steps", "Engine steps run", e, registry=r)
        self.batch = Histogram("agentrt_engine_batch_size", "Sequences per engine step", e, buckets=BATCH_BUCKETS,
                               registry=r)
        self.step_tokens = Counter("agentrt_engine_step_tokens", "Tokens fed to the target (prompt + decode + drafts)",
                                   e, registry=r)
        self.step_time = Histogram("agentrt_engine_step_seconds", "Engine step time, measured", e,
                                   buckets=STEP_BUCKETS, registry=r)
        self.step_predicted = Histogram("agentrt_engine_step_predicted_seconds",
                                        "Engine step time as the cost model predicted it", e, buckets=STEP_BUCKETS,
                                        registry=r)
        self.step_drafted = Counter("agentrt_engine_drafted_tokens", "Draft tokens verified by the target", e,
                                    registry=r)
        self.step_accepted = Counter("agentrt_engine_accepted_tokens", "Draft tokens accepted", e, registry=r)
        self.max_k = Histogram("agentrt_engine_step_max_k", "Largest draft length k in an engine step", e,
                               buckets=K_BUCKETS, registry=r)
        self.kv_blocks = Gauge("agentrt_kv_blocks", "KV cache blocks by state", ["engine", "state"], registry=r)
        self.output_tokens = Counter("agentrt_output_tokens", "Tokens generated", e, registry=r)
        self.prompt_tokens = Counter("agentrt_prompt_tokens", "Prompt tokens of requests", e, registry=r)
        self.cached_tokens = Counter("agentrt_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     e, registry=r)
        self.drafted = Counter("agentrt_spec_drafted_tokens", "Draft tokens proposed, per drafter", ["engine", "drafter"],
                               registry=r)
        self.accepted = Counter("agentrt_spec_accepted_tokens", "Draft tokens accepted, per drafter",
                                ["engine", "drafter"], registry=r)

    def _engine_of(self, record: Any) -> str:
        return getattr(record, "worker", "") or self.engine  # a remote step or response names its worker

    def on_step(self, step: EngineStep) -> None:
        engine = self._engine_of(step)
        self.steps.labels(engine).inc()
        self.batch.labels(engine).observe(step.batch_size)
        self.step_tokens.labels(engine).inc(step.num_tokens)
        self.step_time.labels(engine).observe(step.duration_s)
        if step.predicted_s is not None:
            self.step_predicted.labels(engine).observe(step.predicted_s)
        self.step_drafted.labels(engine).inc(step.drafted)
        self.step_accepted.labels(engine).inc(step.accepted)
        self.max_k.labels(engine).observe(step.max_k)

    def on_response(self, response: LLMResponse) -> None:
        engine = self._engine_of(response)
        self.output_tokens.labels(engine).inc(response.usage.output_tokens)
        self.prompt_tokens.labels(engine).inc(response.usage.input_tokens)
        self.cached_tokens.labels(engine).inc(response.usage.cached_input_tokens)
        for drafter, figures in response.spec.by_drafter.items():
            self.drafted.labels(engine, drafter).inc(figures.drafted)
            self.accepted.labels(engine, drafter).inc(figures.accepted)

    def set_kv_blocks(self, by_engine: Mapping[str, Mapping[str, int]]) -> None:
        """The KV blocks by state of each engine now (an engine no longer listed leaves the gauge)."""
        self.kv_blocks.clear()
        for engine, states in by_engine.items():
            for state, n in states.items():
                self.kv_blocks.labels(engine, state).set(n)

    def render(self) -> bytes:
        return generate_latest(self.exposed)


class ServerMetrics(EngineMetrics):
    """A server's engine metrics (its own engine's, or its engine workers' as their steps and
    responses reach it) and its runs and HTTP requests."""

    def __init__(self, replica: str) -> None:
        super().__init__(replica)
        r = self.registry
        self.runs = Counter("agentrt_runs", "Program runs ended, by status", ["status"], registry=r)
        self.runs_active = Gauge("agentrt_runs_active", "Program runs by state", ["state"], registry=r)
        self.node_latency = Histogram("agentrt_node_duration_seconds", "Program node latency, by kind", ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.tool_latency = Histogram("agentrt_tool_duration_seconds", "Tool call latency, by tool", ["tool"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.http = Counter("agentrt_http_requests", "HTTP requests, by route and status", ["route", "status"], registry=r)
        self.http_time = Histogram("agentrt_http_request_duration_seconds", "HTTP request duration, by route",
                                   ["route"], buckets=LATENCY_BUCKETS, registry=r)

    def run_ended(self, status: str, nodes: Iterable[tuple[str, str | None, float]] = ()) -> None:
        """A run ended with `status`; nodes: (kind, tool, duration_s) of each of its nodes."""
        self.runs.labels(status).inc()
        for kind, tool, duration_s in nodes:
            self.node_latency.labels(kind).observe(duration_s)
            if kind == "tool" and tool:
                self.tool_latency.labels(tool).observe(duration_s)

    def on_http(self, route: str, status: int, seconds: float) -> None:
        self.http.labels(route, str(status)).inc()
        self.http_time.labels(route).observe(seconds)

    def render_server(self, kv_blocks: Mapping[str, Mapping[str, int]], runs: Mapping[str, int]) -> bytes:
        """The exposition text; the gauges read at scrape time (KV blocks by engine and state, runs
        by state) first."""
        self.set_kv_blocks(kv_blocks)
        for state, n in runs.items():
            self.runs_active.labels(state).set(n)
        return self.render()


class RunMetrics(Dispatching):
    """The subscriber of node events that feeds a server's run metrics: each node that finishes
    is kept with its run and observed when the run ends, so that a run interrupted (a shutdown,
    the store unavailable) counts once, when its resume ends, as its trace does."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.nodes: dict[str, list[tuple[str, str | None, float]]] = {}  # run id -> its finished nodes

    def node_finished(self, ev: NodeFinished) -> None:
        if ev.duration_s is not None:
            self.nodes.setdefault(ev.run_id, []).append((ev.kind, ev.tool, ev.duration_s))

    def run_finished(self, ev: RunFinished) -> None:
        nodes = self.nodes.pop(ev.run_id, [])
        if not ev.interrupted:
            self.metrics.run_ended(ev.status, nodes)

    on = {NodeFinished: node_finished, RunFinished: run_finished}
