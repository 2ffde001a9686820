"""A server's run metrics and OpenTelemetry export are subscribers of the runtime's node events:
each ended run counts once, with the latency of each of its nodes as its trace has it, and its
spans are exported; a run interrupted (not ended) gives neither."""
from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.node_events import NodeFinished, RunFinished
from agentrt.runtime.otel import OtelExport, tracer_provider
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.runtime.summary import summarize
from agentrt.server.metrics import RunMetrics, ServerMetrics
from agentrt.tools import tool


@tool
async def slow_add(a: int, b: int) -> int:
    """Add two numbers, slowly."""
    await asyncio.sleep(0.05)
    return a + b


def program() -> Program:
    p = Program("calc", inputs={"a": int}, tools=[slow_add])
    p.tool("total", "slow_add", args={"a": p.input("a"), "b": 2})
    p.output(p.llm("say", prompt="Say {total}.", max_tokens=8))
    return p


def count(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_an_ended_run_is_counted_and_exported_as_its_trace_has_it():
    metrics, exporter = ServerMetrics("here:1"), InMemorySpanExporter()
    backend = ScriptedBackend({"say": "Four."}, step_s=0.001)
    async with Runtime(backend, tools=[slow_add]) as rt:
        heard: list = []
        for fn in (RunMetrics(metrics), OtelExport(tracer_provider(exporter, batch=False), rt.trace.run_records),
                   heard.append):
            rt.events.subscribe(fn)
        result = await rt.run(program(), {"a": 2}, run_id="r1")
        records = rt.release("r1")
    await backend.aclose()
    assert result.status == "done"
    nodes = {n["node"]: n for n in summarize(records)["runs"][0]["nodes"]}
    finished = {e.node: e for e in heard if isinstance(e, NodeFinished)}
    assert {n: (e.kind, e.tool, e.duration_s) for n, e in finished.items()} == \
        {n: (s["kind"], s.get("tool"), s["duration_s"]) for n, s in nodes.items()}
    assert count(metrics, "agentrt_runs_total", status="done") == 1
    assert count(metrics, "agentrt_node_duration_seconds_count", kind="tool") == 1
    assert count(metrics, "agentrt_node_duration_seconds_count", kind="llm") == 1
    assert count(metrics, "agentrt_tool_duration_seconds_sum", tool="slow_add") == nodes["total"]["duration_s"]
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.parent is None]
    assert root.name == "invoke_agent calc" and root.attributes["agentrt.run_id"] == "r1"
    assert sorted(s.name for s in spans if s.parent is not None) == \
        sorted(r["name"] for r in records if r["type"] == "span")


async def test_an_interrupted_run_is_neither_counted_nor_exported_until_it_ends():
    metrics, exporter = ServerMetrics("here:1"), InMemorySpanExporter()
    run_metrics = RunMetrics(metrics)
    export = OtelExport(tracer_provider(exporter, batch=False), lambda run_id: [])  # no records: nothing to read
    for fn in (run_metrics, export):
        fn(NodeFinished("r1", "total", "tool", "ok", 4, tool="slow_add", duration_s=0.5))
        fn(RunFinished("r1", "cancelled", None, None, None, interrupted=True))
    assert count(metrics, "agentrt_runs_total", status="cancelled") is None
    assert count(metrics, "agentrt_node_duration_seconds_count", kind="tool") is None
    assert exporter.get_finished_spans() == () and run_metrics.nodes == {}
    run_metrics(NodeFinished("r1", "total", "tool", "ok", 4, replayed=True, duration_s=0.001))
    run_metrics(RunFinished("r1", "done", 4, None, None))  # its resume ended
    assert count(metrics, "agentrt_runs_total", status="done") == 1
    assert count(metrics, "agentrt_tool_duration_seconds_count", tool="slow_add") is None  # a replayed call is none
    assert count(metrics, "agentrt_node_duration_seconds_count", kind="tool") == 1
