"""Tool retries as a run records them: every failed attempt's error, duration and back-off, and
why the last one was not tried again, in the live events, the trace's phase spans, the run store,
`inspect --node` and `run -v`; a node's RetryPolicy laid over its tool's."""
from __future__ import annotations

import argparse
import io
import json
import sqlite3

from rich.console import Console

from agentrt.cli import inspect_run
from agentrt.cli.run import print_finished_node
from agentrt.dag import Program
from agentrt.retry import RetryPolicy
from agentrt.runtime import Runtime
from agentrt.runtime.store import SCHEMA_VERSION, SQLiteRunStore, StoredRun
from agentrt.tools import tool


def payment_tool(calls: list[str]):
    @tool(retries=3, backoff_s=0.01, retry_on=ConnectionRefusedError)
    def pay(amount: int) -> str:
        """Charge a card (not idempotent: a second call is a second charge)."""
        calls.append("pay")
        if len(calls) == 1:
            raise ConnectionRefusedError("gateway down")
        raise ValueError("card declined after the charge was booked")

    return pay


async def test_each_failed_attempt_is_in_the_events_trace_store_and_inspect(scripted, tmp_path, capsys,
                                                                           open_run_store):
    calls: list[str] = []
    pay = payment_tool(calls)
    p = Program("shop", inputs={}, tools=[pay])
    p.output(p.tool("charge", "pay", args={"amount": 5}, fallback="not charged"))
    store = open_run_store()  # SQLite and PostgreSQL
    rt = Runtime(scripted(), tools=[pay], store=store)
    events, shown = [], Console(file=io.StringIO(), width=300)
    rt.subscribe_events(events.append)
    rt.subscribe_events(lambda ev: print_finished_node(ev, shown))
    result = await rt.run(p, {}, run_id="r1")
    await rt.aclose()
    assert result.output == "not charged" and calls == ["pay", "pay"]  # ValueError is not in retry_on

    [retried] = [e.data for e in events if e.type == "node_retried"]
    assert retried["attempt"] == 1 and "gateway down" in retried["error"] and retried["backoff_s"] == 0.01

    spans = [s for s in rt.trace.records() if s["type"] == "span"]
    node = next(s for s in spans if s["parent_id"] is None and s["attributes"]["agentrt.node"] == "charge")
    phases = {s["name"]: s for s in spans if s["parent_id"] == node["span_id"]}
    first, last = phases["tool_retried"], phases["tool_failed"]
    assert first["status"] == "error" and "ConnectionRefusedError: gateway down" in first["error"]
    assert first["attributes"]["agentrt.tool.attempt"] == 1 and first["attributes"]["error.type"] == "tool_raised"
    assert first["attributes"]["agentrt.tool.backoff_s"] == 0.01
    assert last["status"] == "error" and "card declined" in last["error"]
    assert last["attributes"]["agentrt.tool.not_retried"] == \
        "retry_on (ConnectionRefusedError) does not cover ToolRaisedError (raised ValueError)"
    log = node["attributes"]["agentrt.tool.attempt_log"]
    assert [(a["attempt"], a["ok"], a["backoff_s"]) for a in log] == [(1, False, 0.01), (2, False, None)]
    # each attempt's time lies within its phase span, and the retry waited its backoff
    for a, span in zip(log, (first, last)):
        assert 0 < a["duration_s"] <= span["end"] - span["start"] + 2e-6, (a, span)
    assert last["start"] >= first["end"] + 0.01

    rows = store.tool_attempts("r1")
    assert [(r.attempt, r.status, r.backoff_s) for r in rows] == [(1, "failed", 0.01), (2, "failed", None)]
    assert "gateway down" in rows[0].error and "does not cover" in rows[1].not_retried

    verbose = shown.file.getvalue()
    assert "charge (tool) attempt 1 failed (tool_raised)" in verbose and "gateway down" in verbose
    assert "retrying in 0.010 s" in verbose and "card declined" in verbose

    path = rt.trace.write(tmp_path / "shop.jsonl")
    assert inspect_run.run(argparse.Namespace(trace=str(path), html=None, json=False, node="charge")) == 0
    text = " ".join(capsys.readouterr().out.split())  # as one line, whatever the terminal's width
    assert "attempt 1: tool_raised" in text and "gateway down" in text and "retried after 0.010 s" in text
    assert "attempt 2: tool_raised" in text and "card declined" in text
    assert "not retried: retry_on (ConnectionRefusedError) does not cover ToolRaisedError (raised ValueError)" in text
    assert inspect_run.run(argparse.Namespace(trace=str(path), html=None, json=True, node=None)) == 0
    [summary_node] = json.loads(capsys.readouterr().out)["runs"][0]["nodes"]
    assert [a["error_kind"] for a in summary_node["attempt_log"]] == ["tool_raised", "tool_raised"]


async def test_a_node_retry_policy_is_laid_over_the_tools_own(scripted):
    calls: list[float] = []

    @tool(idempotent=True, backoff_s=0.0)
    def lookup(key: str) -> str:
        """Read a key (idempotent: fails twice, then answers)."""
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow replica")
        return key.upper()

    p = Program("read", inputs={}, tools=[lookup])
    p.output(p.tool("get", "lookup", args={"key": "k"}, retry=RetryPolicy(max_attempts=3)))
    rt = Runtime(scripted(), tools=[lookup])
    result = await rt.run(p, {})
    await rt.aclose()
    assert result.output == "K" and len(calls) == 3
    node = next(s for s in rt.trace.records() if s["type"] == "span" and s["parent_id"] is None)
    assert [a["ok"] for a in node["attributes"]["agentrt.tool.attempt_log"]] == [False, False, True]
    assert node["attributes"]["agentrt.tool.attempt_log"][0]["backoff_s"] == 0.0  # the tool's backoff_s


def test_a_version_1_store_gains_the_attempt_columns(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    from agentrt.runtime.store import MIGRATIONS

    for sql in MIGRATIONS[1]:
        db.execute(sql)
    db.execute("INSERT INTO runs (run_id, program, program_hash, inputs, status, created_at) "
               "VALUES ('r', 'p', 'h', '{}', 'done', 0)")
    db.execute("INSERT INTO tool_attempts VALUES ('r', 'n', 1, 'failed', NULL, 0, 1, 'timeout', 'slow')")
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    store = SQLiteRunStore(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    [old] = store.tool_attempts("r")
    assert old.error == "slow" and old.backoff_s is None and old.not_retried is None
    store.create_run(StoredRun("r2", "p", "h", {}))
    store.tool_attempt("r2", "n", 1, "failed", error="boom", backoff_s=0.5)
    assert store.tool_attempts("r2")[0].backoff_s == 0.5
