"""`agentrt inspect`: the --json summary agrees with the trace it reads, --html is one
self-contained page, the terminal report shows the α table and timeline."""
from __future__ import annotations

import argparse
import io
import json
import re

import pytest
from rich.console import Console

from agentrt.cli import inspect_run, main
from agentrt.dag import Program
from agentrt.runtime import Runtime, read_trace
from agentrt.runtime.summary import STALL_KEYS, summarize
from agentrt.runtime.terminal import render_report
from agentrt.tools import tool


@tool(retries=1, backoff_s=0.01, retry_on=ConnectionError)
def fetch(url: str) -> str:
    """Fetch a page (fails for 'down')."""
    if url == "down":
        raise ConnectionError("unreachable")
    return f"<page {url}>"


@pytest.fixture
async def trace_path(scripted, tmp_path):
    p = Program("site", inputs={"url": str}, tools=[fetch])
    page = p.tool("page", "fetch", args={"url": p.input("url")})
    mirror = p.tool("mirror", "fetch", args={"url": "down"}, fallback="no mirror")
    p.output(p.llm("summary", prompt="Summarise {page} and {mirror}"))
    rt = Runtime(scripted({"summary": "one two three four five six"}, k=3, accepted=1), tools=[fetch])
    runs = [rt.submit(p, {"url": u}) for u in ("a", "b")]
    for r in runs:
        assert (await r).status == "done"
    return rt.trace.write(tmp_path / "site.jsonl")


def inspect_json(path, capsys) -> dict:
    assert inspect_run.run(argparse.Namespace(trace=str(path), html=None, json=True)) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_json_agrees_with_the_trace(trace_path, capsys):
    summary = inspect_json(trace_path, capsys)
    records = read_trace(trace_path)
    spans = [r for r in records if r["type"] == "span"]
    assert [r["run_id"] for r in summary["runs"]] == [r["run_id"] for r in records if r["type"] == "program"]
    for run in summary["runs"]:
        assert run["status"] == "done" and run["output"] == "one two three four five six"
        node_spans = {s["attributes"]["agentrt.node"]: s for s in spans
                      if s["run_id"] == run["run_id"] and s["parent_id"] is None}
        assert {n["node"] for n in run["nodes"]} == set(node_spans) == {"page", "mirror", "summary"}
        for n in run["nodes"]:
            span = node_spans[n["node"]]
            assert n["kind"] == span["attributes"]["agentrt.node.kind"] and n["status"] == span["status"]
            phases: dict[str, float] = {}
            for s in spans:
                if s["parent_id"] == span["span_id"]:
                    phases[s["name"]] = phases.get(s["name"], 0.0) + s["end"] - s["start"]
            assert n["phases"] == pytest.approx(phases, abs=1e-5)
            assert sum(n["phases"].values()) == pytest.approx(span["end"] - span["start"], abs=1e-5)
        summary_node = next(n for n in run["nodes"] if n["node"] == "summary")
        attrs = node_spans["summary"]["attributes"]
        assert summary_node["spec"]["drafted"] == attrs["agentrt.spec.drafted"] > 0
        assert summary_node["spec"]["alpha"] == pytest.approx(attrs["agentrt.spec.accepted"] / attrs["agentrt.spec.drafted"])
        assert summary_node["spec"]["alpha_free"] == summary_node["spec"]["alpha"]  # nothing forced
        assert summary_node["spec"]["tokens_per_pass"] == attrs["agentrt.spec.tokens_per_pass"]
        assert summary_node["usage"] == {"input_tokens": attrs["gen_ai.usage.input_tokens"],
                                         "cached_input_tokens": attrs["gen_ai.usage.cache_read.input_tokens"],
                                         "output_tokens": attrs["gen_ai.usage.output_tokens"]}
        mirror = next(n for n in run["nodes"] if n["node"] == "mirror")
        assert mirror["status"] == "error" and mirror["attempts"] == 2 and mirror["phases"]["tool_backoff"] > 0
        stalls = run["stalls"]
        assert set(stalls) == set(STALL_KEYS)
        waiting = sum(n["phases"].get("waiting", 0.0) for n in run["nodes"])
        assert stalls["waiting_on_llm_s"] + stalls["waiting_on_tool_s"] + stalls["waiting_on_input_s"] + \
            stalls["waiting_other_s"] == pytest.approx(waiting, abs=1e-5)
        assert stalls["waiting_on_tool_s"] == pytest.approx(summary_node["phases"]["waiting"], abs=1e-5)
        assert stalls["tool_backoff_s"] == pytest.approx(mirror["phases"]["tool_backoff"], abs=1e-5)
        assert sum(stalls[k] for k in ("llm_active_s", "tool_only_s", "waiting_for_input_s", "neither_s")) == \
            pytest.approx(run["duration_s"], abs=1e-5)
    engine_steps = [r for r in records if r["type"] == "engine_step"]
    assert summary["engine"]["steps"] == len(engine_steps)
    assert summary["engine"]["drafted"] == sum(s["drafted"] for s in engine_steps)


def test_inspect_html_is_self_contained(trace_path, tmp_path, capsys):
    out = tmp_path / "view" / "timeline.html"
    assert inspect_run.run(argparse.Namespace(trace=str(trace_path), html=str(out), json=False)) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "</html>" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched from elsewhere
    assert "<link" not in page and not re.search(r"<script[^>]*\bsrc=", page)
    # the renderer is inlined (the page draws the SVG when opened) and the trace embedded
    assert '<script type="module">' in page and "function renderTimeline" in page and "engine-batch" in page
    data = json.loads(re.search(r'<script type="application/json" id="agentrt-trace">(.*?)</script>', page, re.S).group(1))
    assert data["records"] == read_trace(trace_path)
    assert [r["run_id"] for r in data["summary"]["runs"]] == [r["run_id"] for r in data["records"] if r["type"] == "program"]
    for text in ("summary", "mirror", "tool_backoff", "decode"):
        assert text in page
    assert "timeline:" in capsys.readouterr().out


def test_terminal_report_shows_alpha_table_and_timeline(trace_path):
    records = read_trace(trace_path)
    buf = io.StringIO()
    render_report(Console(file=buf, width=140, color_system=None), summarize(records), records)
    text = buf.getvalue()
    for part in ("output of site", "speculation per LLM node", "α free", "tok/pass", "where the time went",
                 "engine batch", "engine k", "timeline", "summary", "mirror"):
        assert part in text, part
    clock, summed = text.index("the run's clock, split"), text.index("summed over nodes")
    assert clock < text.index("only tools running") < summed < text.index("waiting on LLM nodes")
    run = summarize(records)["runs"][0]
    split = sum(run["stalls"][k] for k in ("llm_active_s", "tool_only_s", "waiting_for_input_s", "neither_s"))
    assert split == pytest.approx(run["duration_s"], abs=0.002)  # the first part adds up to the run
    lane = next(line for line in text.splitlines() if "│ mirror" in line).split("mirror", 1)[1]
    assert "r" in lane and "X" in lane and "T" not in lane  # retried, then failed
    # the "all" row sums the LLM nodes' counts and derives its rates from the sums
    llm = [n["spec"] for n in run["nodes"] if n["kind"] == "llm"]
    drafted, accepted = sum(s["drafted"] or 0 for s in llm), sum(s["accepted"] or 0 for s in llm)
    passes, emitted = sum(s["target_passes"] or 0 for s in llm), sum(s["emitted"] or 0 for s in llm)
    assert passes > 0 and emitted >= passes
    cells = next(line for line in text.splitlines() if line.strip("│ ").startswith("all ")).replace("│", " ").split()
    assert cells[1:3] == [str(drafted), str(accepted)] and cells[-1] == f"{emitted / passes:.2f}"


def test_inspect_cli_reports_bad_traces(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text("hello\n")
    assert main(["inspect", str(bad)]) == 2
    assert "x.jsonl:1: not a JSON line" in capsys.readouterr().err


async def test_cut_and_tool_call_shaped_answers_are_flagged(scripted, tmp_path, capsys):
    """A node cut at max_tokens and a text answer shaped like a tool call finish "done", so the
    summary, `inspect` and `run`'s report say what looks wrong."""
    p = Program("flags", inputs={"q": str})
    cut = p.llm("cut", prompt="Tell me about {q}", max_tokens=3)
    p.output(p.llm("answer", prompt="Use {cut}"))
    rt = Runtime(scripted({"cut": "one two three four five six", "answer": '{"name": "search", "arguments": {"q": "x"}}'}))
    assert (await rt.submit(p, {"q": "cats"})).status == "done"
    path = rt.trace.write(tmp_path / "flags.jsonl")
    (run,) = inspect_json(path, capsys)["runs"]
    assert run["warnings"] == ["cut: cut at max_tokens (3 tokens): the answer may be incomplete",
                               "answer: answered with text shaped like a tool call, which no tool ran"]
    assert inspect_run.run(argparse.Namespace(trace=str(path), html=None, json=False)) == 0
    shown = capsys.readouterr().out
    assert "warning: cut: cut at max_tokens" in shown and "warning: answer: answered with text" in shown
    # piped (capsys is no terminal): the tables get room instead of 80 columns of "cac…" and "α f…"
    assert "…" not in shown
    for header in ("cached", "drafted", "accepted", "α free", "α forced", "tok/pass"):
        assert header in shown


def test_a_tool_waiting_in_its_queue_is_not_llm_time():
    from agentrt.runtime.summary import run_stalls

    nodes = [{"node": "fetch", "kind": "tool", "waited_on": None, "phases": {"queued": 1.0, "tool_running": 2.0}}]
    spans = [{"start": 0.0, "end": 1.0, "attributes": {"agentrt.phase": "queued", "agentrt.node": "fetch"}},
             {"start": 1.0, "end": 3.0, "attributes": {"agentrt.phase": "tool_running", "agentrt.node": "fetch"}}]
    st = run_stalls(nodes, spans, 0.0, 3.0)
    assert st["llm_active_s"] == 0 and st["tool_only_s"] == 2.0 and st["neither_s"] == 1.0
    assert st["queued_tool_s"] == 1.0


def test_a_person_answering_is_input_time_not_tool_time():
    """A wait_for node's wait is its own part of the run's clock, and a node that waited on it
    counts as waiting on input, not on a tool."""
    from agentrt.runtime.summary import run_stalls

    def node(name, kind, waited_on, **phases):
        return {"node": name, "kind": kind, "waited_on": waited_on, "phases": phases}

    def span(name, phase, start, end):
        return {"start": start, "end": end, "attributes": {"agentrt.phase": phase, "agentrt.node": name}}

    nodes = [node("order", "tool", None, tool_running=1.0),
             node("approval", "wait_for", "order", waiting=1.0, input_wait=24.0),
             node("refund", "tool", "approval", waiting=25.0, tool_running=2.0)]
    spans = [span("order", "tool_running", 0.0, 1.0), span("approval", "input_wait", 1.0, 25.0),
             span("refund", "tool_running", 25.0, 27.0)]
    st = run_stalls(nodes, spans, 0.0, 28.0)
    assert st["waiting_for_input_s"] == 24.0 and st["tool_only_s"] == 3.0 and st["neither_s"] == 1.0
    assert st["waiting_on_input_s"] == 25.0 and st["waiting_on_tool_s"] == 1.0
