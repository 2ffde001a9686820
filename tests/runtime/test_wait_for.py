"""A wait_for node is its own kind everywhere: in the graph, the events, the trace, the summary's
time split, `agentrt run -v` and `agentrt inspect --node`."""
from __future__ import annotations

import asyncio
import io

import pytest

from rich.console import Console

from agentrt.cli.run import print_finished_node
from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.node_report import render_node
from agentrt.runtime.summary import summarize
from agentrt.runtime.terminal import render_report

DECISION = {"type": "object", "properties": {"approved": {"type": "boolean"}, "note": {"type": "string", "maxLength": 50}},
            "required": ["approved"], "additionalProperties": False}


def refund_program() -> Program:
    p = Program("refund", inputs={"order": str})
    p.llm("proposal", prompt="Propose a refund for {order}", max_tokens=8)
    p.wait_for("approval", DECISION, prompt="Refund {order}? {proposal}")
    p.output(p.llm("reply", prompt="Tell the customer: {approval}", max_tokens=8))
    return p


async def until(cond, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


def test_the_graph_names_a_wait_for_node_with_its_question_and_schema():
    graph = refund_program().compile().to_json()
    node = next(n for n in graph["nodes"] if n["id"] == "approval")
    assert node["kind"] == "wait_for" and "tool" not in node
    assert node["schema"] == DECISION and node["prompt"] == "Refund {order}? {proposal}"
    assert node["label"].startswith("waits for input")
    assert "approval" in refund_program().compile().to_mermaid()


async def test_a_wait_for_node_is_traced_as_a_person_answering_not_a_tool(scripted):
    events = []
    async with Runtime(scripted({"proposal": "10 EUR", "reply": "Done."})) as rt:
        rt.subscribe_events(lambda ev: events.append(ev))
        handle = rt.submit(refund_program(), {"order": "#7"}, run_id="w")
        await until(lambda: rt.waiting_for("w"))
        await asyncio.sleep(0.05)  # the person takes a while
        rt.provide_input("w", "approval", {"approved": True, "note": "ok"}, by="alice", via="terminal")
        result = await handle.wait()
        records = rt.trace.records()
    assert result.output == "Done."
    started = next(ev.data for ev in events if ev.type == "node_started" and ev.data["node"] == "approval")
    assert started["kind"] == "wait_for" and "tool" not in started
    given = next(ev.data for ev in events if ev.type == "input_given")
    assert given["by"] == "alice" and given["via"] == "terminal" and given["at"] > 0

    span = next(r for r in records if r["type"] == "span" and r["attributes"].get("agentrt.node") == "approval"
                and r["parent_id"] is None)
    a = span["attributes"]
    assert span["name"] == "await_input" and a["agentrt.node.kind"] == "wait_for"
    assert a["agentrt.input.prompt"] == "Refund #7? 10 EUR" and a["agentrt.input.schema"] == DECISION
    assert a["agentrt.value"] == {"approved": True, "note": "ok"} and a["agentrt.input.answered_by"] == "alice"
    assert a["agentrt.input.answered_at"] - a["agentrt.input.asked_at"] >= 0.05

    run = summarize(records)["runs"][0]
    node = next(n for n in run["nodes"] if n["node"] == "approval")
    assert node["kind"] == "wait_for" and node["answered_by"] == "alice" and node["via"] == "terminal"
    assert "attempts" not in node and "usage" not in node
    st = run["stalls"]
    assert st["waiting_for_input_s"] >= 0.05 and st["waiting_on_tool_s"] == 0
    assert st["waiting_on_input_s"] >= 0.05  # the reply waited on the person
    assert sum(st[k] for k in ("llm_active_s", "tool_only_s", "waiting_for_input_s", "neither_s")) == \
        pytest.approx(run["duration_s"], abs=1e-5)

    buf = io.StringIO()
    shown = render_node(Console(file=buf, width=120, color_system=None), records, "approval")
    text = buf.getvalue()
    assert "approval (wait_for, await_input): ok" in text and "answered by alice via terminal" in text
    for part in ("question", "Refund #7? 10 EUR", "schema", '"maxLength": 50', "value given", '"note": "ok"'):
        assert part in text, part
    assert "tool:" not in text and "attempts" not in text
    assert shown["answered_by"] == "alice"

    buf = io.StringIO()
    render_report(Console(file=buf, width=160, color_system=None), summarize(records), records)
    report = buf.getvalue()
    assert "approval (wait_for) asked 'Refund #7? 10 EUR': answered by alice via terminal after" in report
    assert '{"approved": true, "note": "ok"}' in report
    assert "waiting for input (wait_for: a person or system)" in report and "waiting on input (wait_for nodes)" in report

    buf = io.StringIO()
    finished = next(ev for ev in events if ev.type == "node_finished" and ev.data["node"] == "approval")
    print_finished_node(finished, Console(file=buf, width=200, color_system=None))
    assert "approval (wait_for) = " in buf.getvalue()


async def test_an_answer_nobody_signed_says_so_and_a_run_that_ends_waiting_says_not_answered(scripted):
    async with Runtime(scripted({"proposal": "10 EUR", "reply": "Done."})) as rt:
        handle = rt.submit(refund_program(), {"order": "#8"}, run_id="x")
        await until(lambda: rt.waiting_for("x"))
        handle.cancel()
        await asyncio.gather(handle.wait(), return_exceptions=True)
        records = rt.trace.records()
    buf = io.StringIO()
    render_node(Console(file=buf, width=120, color_system=None), records, "approval")
    assert "not answered (asked at " in buf.getvalue()
    buf = io.StringIO()
    render_report(Console(file=buf, width=160, color_system=None), summarize(records), records)
    assert "approval (wait_for) asked 'Refund #8? 10 EUR': not answered (cancelled)" in buf.getvalue()
