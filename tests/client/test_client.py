"""agentrt.client (Client and AsyncClient) against the real server application on a real port
(tests/client/served.py): programs, runs with idempotency keys, events resumed with
Last-Event-ID, wait, wait_for input, cancel, output, summary, trace, and the server's error
bodies as typed errors."""
from __future__ import annotations

import json
import socket

import pytest

from agentrt.client import (AsyncClient, BadRequest, Client, Conflict, ConnectionFailed, NotFound, RunFailed,
                            RunNotEnded, Unauthorized, UnprocessableEntity, WaitTimedOut, split_run_url)
from agentrt.client.errors import BadUrl

APPROVAL_SCHEMA = {"type": "object", "properties": {"approved": {"type": "boolean"}}, "required": ["approved"],
                   "additionalProperties": False}


def test_a_run_from_start_to_output_with_its_events_resumed_in_the_middle(served):
    with Client(served.url, api_key="") as c:
        [calc, approve] = sorted(c.programs(), key=lambda p: p.name != "calc")
        assert calc.name == "calc" and calc.input_schema["properties"]["delay"]["type"] == "number"
        assert approve.name == "approve" and calc.tools == ["add", "slow_add"]
        run = c.start_run("calc", {"question": "2 + 3?"}, metadata={"who": "test"})
        assert run.created and run.run_id.startswith("run_")
        events = list(c.events(run.run_id))
        assert [e.id for e in events] == list(range(1, len(events) + 1))
        assert events[0].type == "run_queued" and events[-1].type == "run_finished"
        assert [e.data["node"] for e in events if e.type == "node_finished"] == ["plan", "sum", "answer"]
        rest = list(c.events(run.run_id, last_event_id=events[4].id))
        assert rest == events[5:]
        assert list(c.events(run.run_id, last_event_id=events[-1].id)) == []  # ended: nothing more
        info = c.wait(run.run_id, timeout=10)
        assert info.status == "done" and info.metadata == {"who": "test"}
        assert c.output(run.run_id) == "The sum is five."
        summary = c.summary(run.run_id)
        assert [n["node"] for n in summary["runs"][0]["nodes"]] == ["plan", "sum", "answer"]
        trace = c.trace(run.run_id)
        [program] = [r for r in trace if r["type"] == "program"]
        assert program["status"] == "done" and program["output"] == "The sum is five."
        assert run.run_id in [r.run_id for r in c.list_runs(program="calc").data]


def test_the_same_idempotency_key_returns_the_run_it_started(served):
    with Client(served.url, api_key="") as c:
        first = c.start_run("calc", {"question": "1 + 1?"}, idempotency_key="order-7")
        again = c.start_run("calc", {"question": "1 + 1?"}, idempotency_key="order-7")
        assert first.created and not again.created and again.run_id == first.run_id
        with pytest.raises(UnprocessableEntity) as e:
            c.start_run("calc", {"question": "2 + 2?"}, idempotency_key="order-7")
        assert e.value.code == "idempotency_key_reused" and "different request" in e.value.message
        other = c.start_run("calc", {"question": "1 + 1?"})  # no key given: a key of its own, a new run
        assert other.created and other.run_id != first.run_id


def test_a_waiting_run_is_seen_answered_and_ends(served):
    with Client(served.url, api_key="") as c:
        run = c.start_run("approve", {"sql": "DROP TABLE t"})
        for ev in c.events(run.run_id):
            if ev.type == "input_wanted":
                break
        assert ev.data["node"] == "approval" and ev.data["schema"] == APPROVAL_SCHEMA
        info = c.get_run(run.run_id)
        assert info.status == "waiting" and [w.node for w in info.waiting_for] == ["approval"]
        assert info.waiting_for[0].prompt == "Run DROP TABLE t?"
        trace = c.trace(run.run_id)  # answers before the end: what ran so far
        [program] = [r for r in trace if r["type"] == "program"]
        assert program["status"] == "waiting" and program["output"] is None
        with pytest.raises(RunNotEnded, match="has not ended"):
            c.output(run.run_id)
        with pytest.raises(WaitTimedOut) as timed_out:
            c.wait(run.run_id, timeout=0.5)
        assert timed_out.value.run.status == "waiting"
        with pytest.raises(UnprocessableEntity) as bad:
            c.provide_input(run.run_id, "approval", {"approved": "yes"})
        assert bad.value.code == "invalid_input" and "approval" in bad.value.message
        with pytest.raises(Conflict) as wrong_node:
            c.provide_input(run.run_id, "answer", {"approved": True})
        assert "not waiting for input at node 'answer'" in wrong_node.value.message
        c.provide_input(run.run_id, "approval", {"approved": True}, by="ops-oncall")
        assert c.wait(run.run_id, timeout=10).status == "done"
        assert c.output(run.run_id) == "The sum is five."
        assert "ops-oncall" in json.dumps(c.trace(run.run_id))  # who answered is kept in the trace


def test_cancel_and_what_a_cancelled_run_answers(served):
    with Client(served.url, api_key="") as c:
        run = c.start_run("approve", {})
        next(e for e in c.events(run.run_id) if e.type == "input_wanted")
        assert c.cancel(run.run_id).status == "cancelled"
        with pytest.raises(RunFailed, match="cancelled"):
            c.output(run.run_id)
        with pytest.raises(Conflict) as again:
            c.cancel(run.run_id)
        assert again.value.code == "run_ended" and again.value.status == 409


def test_error_bodies_become_typed_errors_with_the_servers_reason(served):
    with Client(served.url, api_key="") as c:
        with pytest.raises(NotFound) as e:
            c.get_run("run_nope")
        assert e.value.code == "run_not_found" and "no run with id 'run_nope'" in str(e.value)
        with pytest.raises(NotFound, match="no program named 'nope'"):
            c.start_run("nope")
        with pytest.raises(BadRequest) as e:
            c.start_run("calc", {"question": 3})
        assert e.value.param == "inputs" and "inputs.question" in e.value.message
        with pytest.raises(BadRequest, match="status must be queued"):
            c.list_runs(status="sleeping")
        with pytest.raises(NotFound):
            list(c.events("run_nope"))
    with pytest.raises(BadUrl, match="not a server URL"):
        Client("localhost:8000")
    assert split_run_url("http://h:1/v1/runs/run_ab/") == ("http://h:1", "run_ab")
    with pytest.raises(BadUrl, match="not a run URL"):
        split_run_url("http://h:1/v1/programs")


def test_keys_are_sent_and_a_missing_or_wrong_one_is_unauthorized(served_with_key, monkeypatch):
    monkeypatch.delenv("AGENTRT_API_KEY", raising=False)
    with Client(served_with_key.url, api_key="") as c:
        with pytest.raises(Unauthorized, match="missing API key"):
            c.programs()
    with Client(served_with_key.url, api_key="wrong") as c:
        with pytest.raises(Unauthorized, match="invalid API key"):
            c.programs()
    monkeypatch.setenv("AGENTRT_API_KEY", "client-test-key")
    with Client(served_with_key.url) as c:  # the key from the environment
        assert {p.name for p in c.programs()} == {"calc", "approve"}
    monkeypatch.delenv("AGENTRT_API_KEY")
    monkeypatch.setenv("AGENTRT_SERVE_API_KEYS", "client-test-key")
    with pytest.warns(UserWarning, match="AGENTRT_SERVE_API_KEYS is set, but that is the server's list of keys"):
        Client(served_with_key.url).close()


def test_a_server_that_is_not_there_fails_to_connect_after_the_retries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", api_key="", max_retries=1, reconnect_s=0.3) as c:
        with pytest.raises(ConnectionFailed, match="cannot reach the server"):
            c.programs()
        with pytest.raises(ConnectionFailed, match="the server was gone for over 0.3 s"):
            list(c.events("run_x"))


async def test_the_async_client_follows_a_run_and_answers_its_input(served):
    async with AsyncClient(served.url, api_key="") as c:
        assert {p.name for p in await c.programs()} == {"calc", "approve"}
        run = await c.start_run("approve", {"sql": "SELECT 1"}, idempotency_key="async-1")
        types = []
        async for ev in c.events(run.run_id):
            types.append(ev.type)
            if ev.type == "input_wanted":
                info = await c.provide_input(run.run_id, ev.data["node"], {"approved": False})
                assert info.status in ("running", "waiting")
        assert types[0] == "run_queued" and types[-1] == "run_finished" and "input_given" in types
        assert (await c.wait(run.run_id, timeout=10)).status == "done"
        assert await c.output(run.run_id) == "The sum is five."
        assert [r["type"] for r in await c.trace(run.run_id)][0] == "trace"
        with pytest.raises(Conflict):
            await c.cancel(run.run_id)
