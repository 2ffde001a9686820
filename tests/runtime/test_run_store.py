"""The run store and resuming runs from it, each test against both stores (a real SQLite file and a
real PostgreSQL database, tests/pg_cluster.py); the LLM is scripted.

A crash is simulated in-process by Runtime.interrupt (the run stops without ending in the store,
as after kill -9: outcomes recorded so far stay, nodes in flight stay "running"); the server
tests kill a real process."""
from __future__ import annotations

import asyncio
import re
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from agentrt.dag import JsonSchema, Program
from agentrt.runtime import Runtime
from agentrt.runtime.store import SCHEMA_VERSION, SQLiteRunStore, StoredRun, StoreError, StoreUnavailable
from agentrt.runtime.store_location import PostgresLocation
from agentrt.runtime.store_postgres import SCHEMA_VERSION as PG_SCHEMA_VERSION
from agentrt.runtime.store_postgres import PostgresRunStore
from agentrt.tools.mosquitto import free_port
from agentrt.tools import tool


def counting_tools(calls: dict[str, int], gate: asyncio.Event, slow_idempotent: bool = False):
    @tool
    def record(a: int, b: int) -> dict:
        "Record two numbers."
        calls["record"] = calls.get("record", 0) + 1
        return {"a": a, "b": b}

    @tool(idempotent=slow_idempotent)
    async def slow_add(a: int, b: int) -> int:
        "Add once the gate opens."
        calls["slow_add"] = calls.get("slow_add", 0) + 1
        await gate.wait()
        return a + b

    return [record, slow_add]


def program(tools) -> Program:
    p = Program("durable", inputs={"question": str}, tools=tools)
    plan = p.llm("plan", prompt="Pick the numbers in {question}", output=JsonSchema(
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}))
    rec = p.tool("record", "record", args={"a": plan["a"], "b": plan["b"]})
    p.tool("sum", "slow_add", args={"a": rec["a"], "b": rec["b"]})
    p.output(p.llm("answer", prompt="Say that the sum is {sum}"))
    return p


REPLIES = {"plan": {"a": 2, "b": 3}, "answer": "The sum is 5."}


async def until(cond, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def crash_in_slow_add(store, scripted, calls, gate, slow_idempotent=False) -> str:
    """Run until slow_add is running, then stop the run as a crash would."""
    tools = counting_tools(calls, gate, slow_idempotent)
    rt = Runtime(scripted(REPLIES), tools=tools, store=store)
    handle = rt.submit(program(tools), {"question": "2 + 3?"}, run_id="r1")
    await until(lambda: calls.get("slow_add"))
    rt.interrupt("r1")
    await handle.wait()
    await rt.aclose()
    return "r1"


async def test_a_resumed_run_takes_finished_nodes_from_the_store_and_fails_an_interrupted_non_idempotent_tool(
        open_run_store, scripted):
    store = open_run_store()
    calls: dict[str, int] = {}
    gate = asyncio.Event()
    await crash_in_slow_add(store, scripted, calls, gate)
    assert store.get_run("r1").status == "running"
    rec = store.recorded("r1")
    assert set(rec.outcomes) == {"plan", "record"} and rec.interrupted == {"sum"}

    gate.set()
    backend = scripted(REPLIES)
    tools = counting_tools(calls, gate)
    rt = Runtime(backend, tools=tools, store=store)
    result = await rt.run(program(tools), {"question": "2 + 3?"}, run_id="r1", resume=store.recorded("r1"))
    await rt.aclose()
    assert calls == {"record": 1, "slow_add": 1}  # nothing that finished ran again; sum was not retried
    assert [r.node.node for r in backend.requests] == []  # plan came from the store
    assert result.status == "failed" and result.failed_node == "sum"
    assert "may or may not have run" in result.error and "slow_add" in result.error
    stored = store.get_run("r1")
    assert stored.status == "failed" and stored.error["node"] == "sum"


async def test_an_interrupted_idempotent_tool_runs_again_and_the_run_completes(open_run_store, scripted):
    store = open_run_store()
    calls: dict[str, int] = {}
    gate = asyncio.Event()
    await crash_in_slow_add(store, scripted, calls, gate, slow_idempotent=True)
    gate.set()
    backend = scripted(REPLIES)
    tools = counting_tools(calls, gate, slow_idempotent=True)
    rt = Runtime(backend, tools=tools, store=store)
    result = await rt.run(program(tools), {"question": "2 + 3?"}, run_id="r1", resume=store.recorded("r1"))
    await rt.aclose()
    assert result.status == "done" and result.output == "The sum is 5."
    assert calls == {"record": 1, "slow_add": 2}
    assert [r.node.node for r in backend.requests] == ["answer"]
    outcomes = [c for c in store.node_changes("r1") if c.state != "running"]
    assert sorted(c.node for c in outcomes) == ["answer", "plan", "record", "sum"]  # each exactly once
    attempts = store.tool_attempts("r1")
    assert [(a.node, a.status) for a in attempts] == [("record", "finished"), ("sum", "finished")]


async def test_a_sampled_llm_node_is_regenerated_with_the_seed_it_recorded(open_run_store, scripted):
    store = open_run_store()
    p = Program("sampled", inputs={"q": str})
    p.output(p.llm("say", prompt="{q}", temperature=0.8))
    backend = scripted({"say": "word " * 500}, step_s=0.01)  # generating for seconds
    rt = Runtime(backend, store=store)
    handle = rt.submit(p, {"q": "hello"}, run_id="s1")
    await until(lambda: backend.requests)
    first_seed = backend.requests[0].sampling["seed"]
    rt.interrupt("s1")
    await handle.wait()
    await rt.aclose()
    assert store.recorded("s1").seeds == {"say": first_seed}
    again = scripted({"say": "hi"})
    rt = Runtime(again, store=store)
    assert (await rt.run(p, {"q": "hello"}, run_id="s1", resume=store.recorded("s1"))).output == "hi"
    await rt.aclose()
    assert again.requests[0].sampling["seed"] == first_seed


async def test_without_a_store_nothing_is_seeded(scripted):
    p = Program("sampled", inputs={"q": str})
    p.output(p.llm("say", prompt="{q}", temperature=0.8))
    backend = scripted({"say": "hi"})
    async with Runtime(backend) as rt:
        await rt.run(p, {"q": "x"})
    assert "seed" not in backend.requests[0].sampling


def test_prune_deletes_only_ended_runs_with_everything_they_recorded(open_run_store):
    store = open_run_store()
    for i, status in enumerate(["done", "failed", "running", "queued", "done"]):
        store.create_run(StoredRun(f"r{i}", "p", "h", {}, status, created_at=float(i),
                                   ended_at=100.0 + i if status in ("done", "failed") else None))
        store.node_finished(f"r{i}", "n", "tool", True, i)
        store.add_event(f"r{i}", 1, "run_queued", {})
    assert sorted(store.prune(keep=1)) == ["r0", "r1"]  # r4 is the newest ended run
    assert [r.run_id for r in store.runs()] == ["r2", "r3", "r4"]
    assert store.node_changes("r0") == [] and store.events("r0") == []
    assert store.prune(older_than_s=0) == ["r4"]
    assert {r.run_id for r in store.runs()} == {"r2", "r3"}


def test_a_node_outcome_is_recorded_once(open_run_store):
    store = open_run_store()
    store.create_run(StoredRun("r", "p", "h", {}))
    store.node_finished("r", "n", "llm", True, "x")
    with pytest.raises(StoreError, match="node n already has a recorded outcome"):
        store.node_finished("r", "n", "llm", True, "y")


def test_a_store_from_a_newer_version_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "runs.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="newer agentrt"):
        SQLiteRunStore(path)
    assert path.read_bytes() == before


def test_a_corrupt_store_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not a database" * 100)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a readable SQLite database"):
        SQLiteRunStore(path)
    assert path.read_bytes() == before


def test_a_store_survives_reopening_and_keeps_its_schema(open_run_store, store_location):
    store = open_run_store()
    store.create_run(StoredRun("r", "p", "h", {"x": [1, 2], "z": {"b": 1, "a": 2}}, idempotency_key="k",
                               metadata={"a": "b"}))
    store.add_event("r", 1, "run_queued", {"y": 1, "x": float("nan")})
    store.close()
    again = open_run_store()  # the migrations run again at open and change nothing
    run = again.run_by_key("k")
    assert run.run_id == "r" and run.metadata == {"a": "b"}
    assert list(run.inputs["z"]) == ["b", "a"]  # documents come back as written, key order included
    [(event_id, kind, data)] = again.events("r")
    assert (event_id, kind, list(data)) == (1, "run_queued", ["y", "x"])
    if isinstance(store_location, PostgresLocation):
        assert again.schema_version() == PG_SCHEMA_VERSION
    else:
        assert again.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_postgres_store_from_a_newer_version_is_refused_and_left_alone(postgres_cluster):
    url = postgres_cluster.new_database()
    PostgresRunStore(url).close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (PG_SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=f"run store {re.escape(url)} was written by a newer agentrt"):
        PostgresRunStore(url)
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] == PG_SCHEMA_VERSION + 1


def test_stores_opened_at_once_migrate_once(postgres_cluster):
    url = postgres_cluster.new_database()
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: PostgresRunStore(url), range(4)))
    for store in stores:
        store.close()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == \
            [(v,) for v in range(1, PG_SCHEMA_VERSION + 1)]  # each step once


def test_an_unreachable_postgres_is_named_without_its_password():
    url = f"postgresql://someone:s3cret@127.0.0.1:{free_port()}/runs"
    with pytest.raises(StoreUnavailable) as e:
        PostgresRunStore(url, connect_timeout_s=2)
    message = str(e.value)
    assert f"run store postgresql://someone@127.0.0.1:{url.split(':')[3]} cannot be reached" in message
    assert "s3cret" not in message and "refused" in message.lower()


APPROVAL = {"type": "object", "properties": {"approved": {"type": "boolean"}}, "required": ["approved"],
            "additionalProperties": False}


def approval_program() -> Program:
    p = Program("approve", inputs={"sql": str})
    ok = p.wait_for("approval", APPROVAL, prompt="Run {sql}?")
    p.output(p.branch("outcome", on=ok["approved"], cases={
        True: lambda b: b.llm("done", prompt="Say that {sql} ran"),
        False: lambda b: b.llm("refused", prompt="Say that {sql} was refused")}))
    return p


async def test_a_run_waits_for_outside_input_and_a_bad_value_leaves_it_waiting(scripted):
    from agentrt.errors import InputValueError, RunConfigError

    events = []
    backend = scripted({"*.done": "It ran.", "*.refused": "Refused."})
    async with Runtime(backend) as rt:
        rt.subscribe_events(lambda ev: events.append((ev.type, dict(ev.data))))
        handle = rt.submit(approval_program(), {"sql": "DELETE FROM t"}, run_id="w1")
        await until(lambda: rt.waiting_for("w1"))
        wait = rt.waiting_for("w1")["approval"]
        assert wait.prompt == "Run DELETE FROM t?" and wait.schema == APPROVAL
        assert ("input_wanted", {"node": "approval", "schema": APPROVAL, "prompt": "Run DELETE FROM t?"}) in events
        with pytest.raises(InputValueError, match="approval.*'approved' is a required property"):
            rt.provide_input("w1", "approval", {"ok": True})
        with pytest.raises(RunConfigError, match="not waiting for input at node 'nope'"):
            rt.provide_input("w1", "nope", {"approved": True})
        assert not handle.done() and backend.requests == []
        rt.provide_input("w1", "approval", {"approved": False})
        result = await handle.wait()
    assert result.output == "Refused." and [r.node.node for r in backend.requests] == ["outcome?false.refused"]
    given = next(data for kind, data in events if kind == "input_given")
    assert given["node"] == "approval" and given["via"] == "python" and given["by"] is None


async def test_a_waiting_run_survives_being_stopped_and_takes_its_input_after_resume(open_run_store, scripted):
    store = open_run_store()
    for _ in range(2):  # stopped twice while waiting
        rt = Runtime(scripted({"*": "x"}), store=store)
        rec = store.recorded("w1") if store.get_run("w1") else None
        handle = rt.submit(approval_program(), {"sql": "DROP TABLE t"}, run_id="w1", resume=rec)
        await until(lambda: rt.waiting_for("w1"))
        rt.interrupt("w1")
        await handle.wait()
        await rt.aclose()
        assert store.get_run("w1").status == "running" and "approval" in store.recorded("w1").interrupted
    backend = scripted({"*.done": "It ran."})
    rt = Runtime(backend, store=store)
    handle = rt.submit(approval_program(), {"sql": "DROP TABLE t"}, run_id="w1", resume=store.recorded("w1"))
    await until(lambda: rt.waiting_for("w1"))
    rt.provide_input("w1", "approval", {"approved": True})
    assert (await handle.wait()).output == "It ran."
    await rt.aclose()
    assert store.recorded("w1").outcomes["approval"].value == {"approved": True}
    assert store.get_run("w1").status == "done"
