"""Exporting a finished run's spans through the OpenTelemetry SDK (an OTLP endpoint, or any
SpanExporter), so Jaeger, Tempo or Langfuse-style backends show agent runs.

A run becomes one root span `invoke_agent {program}` (gen_ai.operation.name invoke_agent) with the
trace's node spans (`chat {model}`, `execute_tool {tool}`, already named by the GenAI semantic
conventions) under it and their phase spans under those, with the same start and end times, the
engine-step events, status and attributes (values OpenTelemetry cannot carry, such as dicts, as
JSON text).

`OtelExport` is the subscriber of node events (node_events.py) that does it: when a run ends
(RunFinished; an interrupted run has not ended) it sends that run's spans, as its trace records
them. A server registers it with its other subscribers (server/state.py: `server_subscribers`).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Mapping

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode

from agentrt.runtime.node_events import RunFinished

log = logging.getLogger("agentrt.otel")


def tracer_provider(exporter: SpanExporter, service_name: str = "agentrt", batch: bool = True) -> TracerProvider:
    """A provider that sends spans to `exporter` (batched in a background thread, or one by one)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def otlp_provider(endpoint: str, service_name: str = "agentrt") -> TracerProvider:
    """Spans to an OTLP/HTTP endpoint (e.g. http://localhost:4318/v1/traces)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return tracer_provider(OTLPSpanExporter(endpoint=endpoint), service_name)


def _value(v: Any) -> Any:
    if isinstance(v, (str, bool, int, float)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v) and \
            len({type(x) for x in v}) <= 1:
        return list(v)
    return json.dumps(v, ensure_ascii=False, default=repr)


def _attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _value(v) for k, v in attrs.items() if v is not None}


def export_run(provider: TracerProvider, records: Iterable[Mapping[str, Any]]) -> None:
    """Send one run's spans (the records of a run's trace, as Trace.run_records gives them)."""
    records = list(records)
    wall = records[0]["wall_start"]

    def ns(t: float) -> int:
        return int((wall + t) * 1e9)

    tracer = provider.get_tracer("agentrt")
    program = next(r for r in records if r["type"] == "program")
    root = tracer.start_span(f"invoke_agent {program['program']}", start_time=ns(program["start"]), attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": program["program"],
        "agentrt.run_id": program["run_id"], "agentrt.status": program["status"]})
    if program["status"] != "done":
        error = program.get("error") or {}
        root.set_status(Status(StatusCode.ERROR, error.get("message") or program["status"]))
    spans = [r for r in records if r["type"] == "span"]
    by_id = {r["span_id"]: r for r in spans}
    made: dict[str, Any] = {}

    def make(rec: Mapping[str, Any]) -> Any:
        if rec["span_id"] in made:
            return made[rec["span_id"]]
        parent_rec = by_id.get(rec.get("parent_id") or "")
        parent = make(parent_rec) if parent_rec is not None else root
        span = tracer.start_span(rec["name"], context=otel_trace.set_span_in_context(parent),
                                 start_time=ns(rec["start"]), attributes=_attributes(rec.get("attributes") or {}))
        for ev in rec.get("events") or ():
            span.add_event(ev["name"], _attributes(ev.get("attributes") or {}), timestamp=ns(ev["time"]))
        if rec.get("status") == "error":
            span.set_status(Status(StatusCode.ERROR, rec.get("error") or "error"))
        made[rec["span_id"]] = span
        return span

    for rec in spans:
        make(rec)
    # children end before their parents, as a live run would end them
    for rec in sorted(spans, key=lambda r: r["end"]):
        made[rec["span_id"]].end(end_time=ns(rec["end"]))
    root.end(end_time=ns(program["end"]))


class OtelExport:
    """The subscriber that sends each ended run's spans to `provider`; `records(run_id)` gives the
    run's trace records (Trace.run_records), complete once its RunFinished is emitted."""

    def __init__(self, provider: TracerProvider, records: Callable[[str], list[dict[str, Any]]]) -> None:
        self.provider, self.records = provider, records

    def __call__(self, event: Any) -> None:
        if not isinstance(event, RunFinished) or event.interrupted:
            return
        try:
            export_run(self.provider, self.records(event.run_id))
        except Exception:  # noqa: BLE001 - telemetry never fails a run (a subscriber's error reaches the run)
            log.exception("exporting the spans of %s failed", event.run_id)
