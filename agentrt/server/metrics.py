"""Prometheus metrics of a served runtime (prometheus-client, one registry per server).

Engine: steps, batch size, tokens fed, drafted/accepted, max k per step, step time measured and
as the cost model predicted it; KV blocks used and pinned (read at scrape time). Requests: output
tokens, prompt tokens and those served from the prefix cache, drafted/accepted per drafter. Runs:
by status, running and queued, node latency by kind, tool latency by tool. HTTP: requests by
route and status, with durations.
"""
from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from agentrt.runtime.backend import EngineStep, LLMResponse

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
K_BUCKETS = (0, 1, 2, 4, 8, 12, 16)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("agentrt_engine_steps", "Engine steps run", registry=r)
        self.batch = Histogram("agentrt_engine_batch_size", "Sequences per engine step", buckets=BATCH_BUCKETS, registry=r)
        self.step_tokens = Counter("agentrt_engine_step_tokens", "Tokens fed to the target (prompt + decode + drafts)",
                                   registry=r)
        self.step_time = Histogram("agentrt_engine_step_seconds", "Engine step time, measured", buckets=STEP_BUCKETS,
                                   registry=r)
        self.step_predicted = Histogram("agentrt_engine_step_predicted_seconds",
                                        "Engine step time as the cost model predicted it", buckets=STEP_BUCKETS,
                                        registry=r)
        self.step_drafted = Counter("agentrt_engine_drafted_tokens", "Draft tokens verified by the target", registry=r)
        self.step_accepted = Counter("agentrt_engine_accepted_tokens", "Draft tokens accepted", registry=r)
        self.max_k = Histogram("agentrt_engine_step_max_k", "Largest draft length k in an engine step",
                               buckets=K_BUCKETS, registry=r)
        self.kv_blocks = Gauge("agentrt_kv_blocks", "KV cache blocks by state", ["state"], registry=r)
        self.output_tokens = Counter("agentrt_output_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("agentrt_prompt_tokens", "Prompt tokens of requests", registry=r)
        self.cached_tokens = Counter("agentrt_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.drafted = Counter("agentrt_spec_drafted_tokens", "Draft tokens proposed, per drafter", ["drafter"], registry=r)
        self.accepted = Counter("agentrt_spec_accepted_tokens", "Draft tokens accepted, per drafter", ["drafter"],
                                registry=r)
        self.runs = Counter("agentrt_runs", "Program runs ended, by status", ["status"], registry=r)
        self.runs_active = Gauge("agentrt_runs_active", "Program runs by state", ["state"], registry=r)
        self.node_latency = Histogram("agentrt_node_duration_seconds", "Program node latency, by kind", ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.tool_latency = Histogram("agentrt_tool_duration_seconds", "Tool call latency, by tool", ["tool"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.http = Counter("agentrt_http_requests", "HTTP requests, by route and status", ["route", "status"], registry=r)
        self.http_time = Histogram("agentrt_http_request_duration_seconds", "HTTP request duration, by route",
                                   ["route"], buckets=LATENCY_BUCKETS, registry=r)

    def on_step(self, step: EngineStep) -> None:
        self.steps.inc()
        self.batch.observe(step.batch_size)
        self.step_tokens.inc(step.num_tokens)
        self.step_time.observe(step.duration_s)
        if step.predicted_s is not None:
            self.step_predicted.observe(step.predicted_s)
        self.step_drafted.inc(step.drafted)
        self.step_accepted.inc(step.accepted)
        self.max_k.observe(step.max_k)

    def on_response(self, response: LLMResponse) -> None:
        self.output_tokens.inc(response.usage.output_tokens)
        self.prompt_tokens.inc(response.usage.input_tokens)
        self.cached_tokens.inc(response.usage.cached_input_tokens)
        for drafter, figures in response.spec.by_drafter.items():
            self.drafted.labels(drafter).inc(figures.drafted)
            self.accepted.labels(drafter).inc(figures.accepted)

    def on_run_end(self, status: str, summary: Mapping[str, Any] | None) -> None:
        self.runs.labels(status).inc()
        for run in (summary or {}).get("runs", []):
            for node in run.get("nodes", []):
                if node.get("duration_s") is not None:
                    self.node_latency.labels(node["kind"]).observe(node["duration_s"])
                    if node["kind"] == "tool" and node.get("tool"):
                        self.tool_latency.labels(node["tool"]).observe(node["duration_s"])

    def on_http(self, route: str, status: int, seconds: float) -> None:
        self.http.labels(route, str(status)).inc()
        self.http_time.labels(route).observe(seconds)

    def render(self, kv_blocks: Mapping[str, int], runs: Mapping[str, int]) -> bytes:
        """The exposition text; the gauges read at scrape time (KV blocks and runs by state) first."""
        for state, n in kv_blocks.items():
            self.kv_blocks.labels(state).set(n)
        for state, n in runs.items():
            self.runs_active.labels(state).set(n)
        return generate_latest(self.registry)
