"""The programs API with a run store on (a real SQLite file and a real PostgreSQL database, a
scripted engine): 50 runs
submitted at once all finish, each node's outcome recorded exactly once, every event stored with
the id a client reads; retention leaves unfinished runs alone; PostgreSQL restarting under the
server: 503 while it is down, and the run it stopped resumes, nothing acknowledged lost."""
from __future__ import annotations

import asyncio
import collections
import contextlib
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from agentrt.runtime.loader import load_example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.runtime.store import SQLiteRunStore, file_hash
from agentrt.runtime.store_postgres import PostgresRunStore
from agentrt.server.app import create_app
from agentrt.server.config import Limits, ServerConfig

PROGRAM = Path(__file__).parent / "calc_program.py"
REPLIES = {"plan": {"a": 2, "b": 3}, "answer": "The sum is five."}


@contextlib.asynccontextmanager
async def served(tmp_path, store, replies=REPLIES, step_s=0.002, **config):
    """An aiohttp test client on a server whose runtime records runs in `store`."""
    example = load_example(PROGRAM)
    backend = ScriptedBackend(replies, step_s=step_s)
    runtime = Runtime(backend, tools=example.tools, store=store)
    app = create_app(ServerConfig(runs_dir=tmp_path / "runs", access_log=False,
                                  limits=Limits(max_running_runs=64, max_queued_runs=64), **config),
                     "scripted", {example.name: example}, runtime)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        await runtime.aclose()
        await backend.aclose()


async def test_fifty_runs_at_once_record_every_node_outcome_exactly_once(tmp_path, open_run_store):
    store = open_run_store()
    async with served(tmp_path, store) as client:
        async def one(i: int) -> str:
            r = await client.post("/v1/programs/calc/runs", json={"inputs": {"delay": 0.01 * (i % 5)}},
                                  headers={"Idempotency-Key": f"k{i}"})
            assert r.status == 201, await r.text()
            run_id = (await r.json())["run_id"]
            r = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "60"})
            assert (await r.json())["status"] == "done"
            return run_id

        ids = await asyncio.gather(*(one(i) for i in range(50)))
        r = await client.get(f"/v1/runs/{ids[7]}/events")
        served_ids = [int(line[4:]) for line in (await r.text()).splitlines() if line.startswith("id: ")]
    assert len(set(ids)) == 50
    for run_id in ids:
        stored = store.get_run(run_id)
        assert stored.status == "done" and stored.output == "The sum is five."
        outcomes = collections.Counter(c.node for c in store.node_changes(run_id) if c.state != "running")
        assert outcomes == {"plan": 1, "sum": 1, "answer": 1}
        assert [a.status for a in store.tool_attempts(run_id)] == ["finished"]
    assert [i for i, _, _ in store.events(ids[7])] == served_ids == list(range(1, len(served_ids) + 1))
    assert store.run_by_key("k7").run_id == ids[7]


async def test_retention_prunes_ended_runs_and_their_traces_but_not_a_running_one(tmp_path, open_run_store):
    store = open_run_store()
    async with served(tmp_path, store, prune_keep=2) as client:
        slow = await client.post("/v1/programs/calc/runs", json={"inputs": {"delay": 30.0}})
        slow_id = (await slow.json())["run_id"]
        done = []
        for _ in range(4):
            r = await client.post("/v1/programs/calc/runs", json={"inputs": {}})
            run_id = (await r.json())["run_id"]
            await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "60"})
            done.append(run_id)
        await asyncio.sleep(0.05)
        left = {r.run_id: r.status for r in store.runs()}
        assert left == {slow_id: "running", done[2]: "done", done[3]: "done"}
        assert sorted(p.stem for p in (tmp_path / "runs").glob("*.jsonl")) == sorted(done[2:])
        assert (await client.get(f"/v1/runs/{done[0]}")).status == 404
        await client.post(f"/v1/runs/{slow_id}/cancel")


async def test_a_stored_run_whose_program_file_changed_is_not_resumed_silently(tmp_path):
    from agentrt.runtime.store import StoredRun

    store = SQLiteRunStore(tmp_path / "runs.db")
    for run_id in ("changed", "same"):
        store.create_run(StoredRun(run_id, "calc", "a hash of another version", {"question": "1 + 1?", "delay": 0.0},
                                   "running", created_at=1.0))
    store.update_run("same", program_hash=file_hash(PROGRAM))
    async with served(tmp_path, store) as client:
        r = await client.get("/v1/runs/changed")
        info = await r.json()
        assert info["status"] == "failed" and "changed since the run started" in info["error"]["message"]
        assert "--allow-changed-programs" in info["error"]["message"]
        r = await client.get("/v1/runs/same/wait", params={"timeout": "30"})
        assert (await r.json())["status"] == "done"
    store2 = SQLiteRunStore(tmp_path / "runs2.db")
    store2.create_run(StoredRun("changed", "calc", "old", {"question": "1 + 1?", "delay": 0.0}, "running"))
    async with served(tmp_path, store2, allow_changed_programs=True) as client:
        r = await client.get("/v1/runs/changed/wait", params={"timeout": "30"})
        assert (await r.json())["status"] == "done"


async def test_retention_applies_when_the_server_starts(tmp_path, open_run_store):
    from agentrt.runtime.store import StoredRun

    store = open_run_store()
    for i in range(3):
        store.create_run(StoredRun(f"old{i}", "calc", "h", {}, "done", created_at=float(i), ended_at=float(i)))
    async with served(tmp_path, store, prune_after_s=3600.0):
        assert store.runs() == []


async def test_postgres_restarting_under_the_server_answers_503_and_loses_nothing(tmp_path, postgres_cluster):
    store = PostgresRunStore(postgres_cluster.new_database(), wait_s=0.5)
    answer = " ".join(["five"] * 24)  # the answer's max_tokens
    try:
        async with served(tmp_path, store, replies={**REPLIES, "answer": answer}, step_s=0.05,
                          store_retry_s=0.1) as client:
            async def submit(key: str) -> tuple[int, dict, dict]:
                r = await client.post("/v1/programs/calc/runs", json={"inputs": {}}, headers={"Idempotency-Key": key})
                return r.status, await r.json(), dict(r.headers)

            async def ended(run_id: str) -> dict:
                r = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "60"})
                return await r.json()

            status, before, _ = await submit("before")
            reference = await ended(before["run_id"])  # uninterrupted
            assert status == 201 and reference["status"] == "done"
            status, going, _ = await submit("going")
            assert status == 201
            run_id = going["run_id"]
            async with asyncio.timeout(30):  # the answer is being generated
                while not any(t == "token" and d.get("node") == "answer" for _, t, d in store.events(run_id)):
                    await asyncio.sleep(0.02)
            postgres_cluster.stop()
            try:
                status, err, headers = await submit("during")
                assert status == 503 and err["error"]["code"] == "store_unavailable", err
                assert f"run store {store.location} is unavailable" in err["error"]["message"]
                assert headers["Retry-After"] == "1"
                await asyncio.sleep(0.3)  # the running run's next write fails: it stops
            finally:
                postgres_cluster.start()
            status, during, _ = await submit("during")  # nothing of the refused submit was recorded
            assert status == 201
            done = await ended(run_id)
            assert done["status"] == "done" and done["output"] == reference["output"], done
            assert (await ended(during["run_id"]))["status"] == "done"
            status, again, _ = await submit("before")
            assert status == 200 and again["run_id"] == before["run_id"]
        assert [r.status for r in store.runs()] == ["done"] * 3
        events = store.events(run_id)
        ids, types = [i for i, _, _ in events], [t for _, t, _ in events]
        assert ids == list(range(1, len(ids) + 1)) and types.count("run_finished") == 1 and "run_resumed" in types
        outcomes = collections.Counter(c.node for c in store.node_changes(run_id) if c.state != "running")
        assert outcomes == {"plan": 1, "sum": 1, "answer": 1}  # recorded once, plan and sum not run again
    finally:
        store.close()
