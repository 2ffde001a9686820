"""Traces: every node's phase spans tile its node span, names and attributes follow the
OpenTelemetry GenAI conventions, the engine lane has its steps and idle gaps, JSON lines
round-trip."""
from __future__ import annotations

import asyncio
import json

import pytest

from agentrt.dag import JsonSchema, Program
from agentrt.errors import RunConfigError
from agentrt.runtime import PHASES, Runtime, read_trace
from agentrt.runtime.phases import LLM_PHASES, TOOL_PHASES, WAIT_FOR_PHASES, PhaseLog
from agentrt.runtime.trace import idle_gaps
from agentrt.tools import tool

EPS = 1e-6


@tool(retries=1, backoff_s=0.01, retry_on=KeyError)
def lookup(key: str) -> dict:
    """Look a key up (fails for 'missing')."""
    if key == "missing":
        raise KeyError(key)
    return {"key": key, "value": len(key)}


def program():
    p = Program("traced", inputs={"topic": str}, tools=[lookup])
    keys = p.llm("keys", prompt="Keys for {topic}", output=JsonSchema({"type": "array", "items": {"type": "string"}}))

    def body(b):
        b.tool("get", "lookup", args={"key": b.item}, fallback={"value": None})
        return b.llm("note", prompt="Note on {get}")

    p.fan_out("notes", over=keys, body=body)
    p.output(p.llm("report", prompt="Report {notes}"))
    return p


def check_tiling(records):
    """Every node span's children tile it: contiguous, non-overlapping, phases valid for its kind."""
    spans = [r for r in records if r["type"] == "span"]
    nodes = [s for s in spans if s["parent_id"] is None]
    assert nodes
    for node in nodes:
        kids = sorted((s for s in spans if s["parent_id"] == node["span_id"]), key=lambda s: s["start"])
        kind = node["attributes"]["agentrt.node.kind"]
        assert kids, node["name"]
        assert kids[0]["start"] == pytest.approx(node["start"], abs=EPS)
        assert kids[-1]["end"] == pytest.approx(node["end"], abs=EPS)
        for a, b in zip(kids, kids[1:]):
            assert b["start"] == pytest.approx(a["end"], abs=EPS), (node["attributes"]["agentrt.node"], a, b)
            assert a["name"] != b["name"]
        for k in kids:
            assert k["end"] >= k["start"]
            assert k["name"] == k["attributes"]["agentrt.phase"]
            assert k["name"] in {"llm": LLM_PHASES, "tool": TOOL_PHASES, "wait_for": WAIT_FOR_PHASES}[kind]
            assert k["trace_id"] == node["trace_id"] and k["run_id"] == node["run_id"]
            for e in k["events"]:
                assert k["start"] - EPS <= e["time"] <= k["end"] + EPS
    return nodes


async def test_finished_run_has_complete_non_overlapping_phase_spans(scripted):
    backend = scripted({"keys": ["alpha", "missing", "b"], "notes*note": "a short note", "report": "all good here and now done"},
                       k=4, accepted=2)
    rt = Runtime(backend, tools=[lookup])
    result = await rt.run(program(), {"topic": "x"})
    assert result.status == "done"
    nodes = check_tiling(rt.trace.records())
    by_node = {n["attributes"]["agentrt.node"]: n for n in nodes}
    assert set(by_node) == {"keys", "report"} | {f"notes[{i}].{k}" for i in range(3) for k in ("get", "note")}
    llm, tool_span = by_node["notes[0].note"], by_node["notes[1].get"]
    assert llm["name"] == "chat scripted"
    assert llm["attributes"]["gen_ai.operation.name"] == "chat"
    assert llm["attributes"]["gen_ai.request.model"] == "scripted"
    assert llm["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert tool_span["name"] == "execute_tool lookup"
    assert tool_span["attributes"]["gen_ai.tool.name"] == "lookup"
    assert tool_span["attributes"]["gen_ai.tool.call.id"]
    assert tool_span["status"] == "error" and "KeyError" in tool_span["error"]
    assert [p["name"] for p in sorted((s for s in rt.trace.records() if s["type"] == "span"
                                       and s["parent_id"] == tool_span["span_id"]), key=lambda s: s["start"])] == \
        ["waiting", "queued", "tool_retried", "tool_backoff", "tool_failed"]
    # decode events carry k and accepted; they add up to the node's α accounting
    decode = [s for s in rt.trace.records() if s["type"] == "span" and s["parent_id"] == by_node["report"]["span_id"]
              and s["name"] == "decode"]
    accepted = sum(e["attributes"]["agentrt.accepted"] for d in decode for e in d["events"])
    assert accepted == by_node["report"]["attributes"]["agentrt.spec.accepted"] > 0
    assert {"agentrt.k", "agentrt.batch_size", "agentrt.step"} <= set(decode[0]["events"][0]["attributes"])


async def test_failed_and_cancelled_runs_close_every_node(scripted):
    backend = scripted({"keys": "not json", "report": "x"})
    rt = Runtime(backend, tools=[lookup])
    result = await rt.run(program(), {"topic": "x"})
    assert result.status == "failed"
    nodes = {n["attributes"]["agentrt.node"]: n["status"] for n in check_tiling(rt.trace.records())}
    assert nodes == {"keys": "error", "report": "cancelled"}

    backend = scripted({"keys": ["a"], "notes*note": "w " * 5000, "report": "x"})
    rt = Runtime(backend, tools=[lookup])
    handle = rt.submit(program(), {"topic": "x"})
    while not any(r.node.node == "notes[0].note" for r in backend.requests):
        await asyncio.sleep(0.002)
    handle.cancel()
    assert (await handle).status == "cancelled"
    statuses = {n["attributes"]["agentrt.node"]: n["status"] for n in check_tiling(rt.trace.records())}
    assert statuses == {"keys": "ok", "notes[0].get": "ok", "notes[0].note": "cancelled", "report": "cancelled"}


async def test_engine_lane_steps_and_idle_gaps(scripted):
    backend = scripted({"keys": ["a", "b"], "notes*note": "n n", "report": "r r r"})
    rt = Runtime(backend, tools=[lookup])
    await rt.run(program(), {"topic": "x"})
    await asyncio.sleep(0.02)  # engine idle before the trace closes
    rt.trace.close()
    records = rt.trace.records()
    steps = [r for r in records if r["type"] == "engine_step"]
    idle = [r for r in records if r["type"] == "engine_idle"]
    end = next(r["end"] for r in records if r["type"] == "trace_end")
    assert steps and idle and idle[-1]["end"] == pytest.approx(end)
    busy = steps + idle
    busy.sort(key=lambda r: r["start"])
    for a, b in zip(busy, busy[1:]):
        assert b["start"] >= a["end"] - EPS  # steps and idle gaps never overlap
    covered = sum(r["end"] - r["start"] for r in busy)
    assert covered <= end + EPS
    assert all(s["batch_size"] >= 1 and s["end"] >= s["start"] for s in steps)
    assert {"batch_size", "drafted", "accepted", "num_tokens", "max_k"} <= set(steps[0])


async def test_trace_round_trips_as_json_lines(scripted, tmp_path):
    rt = Runtime(scripted({"keys": ["a"], "notes*note": "n", "report": "r"}), tools=[lookup])
    await rt.run(program(), {"topic": "x"})
    path = rt.trace.write(tmp_path / "runs" / "t.jsonl")
    lines = path.read_text().splitlines()
    assert all(json.loads(line)["type"] for line in lines)
    records = read_trace(path)
    assert records == json.loads(json.dumps(rt.trace.records()))
    assert records[0]["type"] == "trace" and records[0]["phases"] == PHASES
    assert records[-1]["type"] == "trace_end"
    program_rec = next(r for r in records if r["type"] == "program")
    assert program_rec["output"] == "r" and program_rec["inputs"] == {"topic": "x"}
    assert program_rec["service"]["llm_calls"] == 3 and program_rec["service"]["tool_calls"] == 1


def test_read_trace_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "trace", "version": 1}\nnot json\n')
    with pytest.raises(RunConfigError, match=r"bad.jsonl:2: not a JSON line"):
        read_trace(bad)
    bad.write_text('{"type": "span"}\n')
    with pytest.raises(RunConfigError, match="not an agentrt trace"):
        read_trace(bad)
    with pytest.raises(RunConfigError, match="no such trace file"):
        read_trace(tmp_path / "nope.jsonl")


def test_phase_log_tiles_and_clamps():
    log = PhaseLog(1.0)
    log.enter("queued", 2.0)
    log.enter("prefill", 1.5)  # earlier than the last transition: clamped
    log.enter("prefill", 3.0)  # same phase: ignored
    log.enter("decode", 4.0)
    assert log.spans(6.0) == [("waiting", 1.0, 2.0), ("prefill", 2.0, 4.0), ("decode", 4.0, 6.0)]
    log.replace_from(1, [("queued", 2.0), ("tool_running", 2.5)])
    assert log.spans(3.0) == [("waiting", 1.0, 2.0), ("queued", 2.0, 2.5), ("tool_running", 2.5, 3.0)]
    assert PhaseLog(2.0).spans(2.0) == [("waiting", 2.0, 2.0)]
    with pytest.raises(ValueError, match="unknown phase 'thinking'"):
        log.enter("thinking", 5.0)


def test_idle_gaps():
    assert idle_gaps([(1.0, 2.0), (2.0005, 3.0), (5.0, 6.0)], 0.0, 7.0) == [(0.0, 1.0), (3.0, 5.0), (6.0, 7.0)]
    assert idle_gaps([], 0.0, 1.0) == [(0.0, 1.0)]
    assert idle_gaps([(0.0, 1.0)], 0.0, 1.0) == []


def test_node_phases_tile_its_span_when_a_step_ends_after_the_output():
    from agentrt.runtime.backend import LLMStepEvent
    from agentrt.runtime.node_state import NodeState
    from agentrt.runtime.summary import node_summary

    def summarized(ns):
        node, *phases = (s.to_record() for s in ns.spans("run", "trace"))
        return node_summary(node, phases)

    # the prefill step's reported end (1.5) is after the moment the runtime finished the node (1.2)
    ns = NodeState("a", "llm", "chat m", created=1.0)
    ns.on_llm_step(LLMStepEvent(step=1, start=0.0, duration_s=0.5, batch_size=1, num_new=8), 1.0)
    ns.finish("ok", 1.2)
    n = summarized(ns)
    assert sum(n["phases"].values()) == pytest.approx(n["duration_s"], abs=1e-9)
    # a step that began after the runtime's clock read: the node lasts until that phase began
    ns = NodeState("b", "llm", "chat m", created=1.0)
    ns.on_llm_step(LLMStepEvent(step=1, start=0.0, duration_s=0.1, batch_size=1, num_new=8), 1.3)
    ns.finish("ok", 1.25)
    n = summarized(ns)
    assert ns.end == pytest.approx(1.3) and sum(n["phases"].values()) == pytest.approx(n["duration_s"], abs=1e-9)
