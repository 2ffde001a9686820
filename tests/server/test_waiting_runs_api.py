"""A run waiting for a person, seen through the HTTP API (scripted engine): the finished LLM node
before the wait shows no running phase and a duration that stays put, the waiting node's wait
grows; values nested past the JSON depth limit are refused naming it, and the run still takes a
good value afterwards."""
from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from agentrt.jsonutil import MAX_JSON_DEPTH
from agentrt.runtime.loader import load_example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.server.app import create_app
from agentrt.server.config import ServerConfig

PROGRAM = Path(__file__).parent / "review_program.py"


async def make_client(tmp_path) -> TestClient:
    example = load_example(PROGRAM)
    runtime = Runtime(ScriptedBackend({"draft": "Rain falls softly on the roofs."}, step_s=0.002))
    app = create_app(ServerConfig(runs_dir=tmp_path / "runs", db=None, access_log=False), "scripted",
                     {example.name: example}, runtime)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def waiting_run(client: TestClient) -> str:
    r = await client.post("/v1/programs/review/runs", json={"inputs": {"topic": "rain"}})
    assert r.status == 201, await r.text()
    run_id = (await r.json())["run_id"]
    for _ in range(500):
        info = await (await client.get(f"/v1/runs/{run_id}")).json()
        if info["status"] == "waiting":
            return run_id
        await asyncio.sleep(0.01)
    raise AssertionError(f"the run never waited: {info}")


def nodes(info: dict) -> dict[str, dict]:
    return {n["node"]: n for n in info["summary"]["nodes"]}


async def test_a_finished_llm_node_shows_no_running_phase_while_the_run_waits(tmp_path):
    client = await make_client(tmp_path)
    try:
        run_id = await waiting_run(client)
        first = nodes(await (await client.get(f"/v1/runs/{run_id}")).json())
        await asyncio.sleep(0.2)
        second = nodes(await (await client.get(f"/v1/runs/{run_id}")).json())
        for seen in (first, second):
            assert seen["draft"]["status"] == "ok"
            assert seen["draft"]["phase"] is None and seen["draft"]["phase_elapsed_s"] is None, seen["draft"]
            assert seen["review"]["status"] == "running" and seen["review"]["phase"] == "input_wait"
            assert seen["review"]["duration_s"] is None
        assert second["draft"]["duration_s"] == first["draft"]["duration_s"] > 0  # ended: it does not grow
        assert second["review"]["phase_elapsed_s"] >= first["review"]["phase_elapsed_s"] + 0.15  # still waiting
    finally:
        await client.close()


async def test_a_value_nested_past_the_limit_is_refused_and_a_good_one_is_taken(tmp_path):
    client = await make_client(tmp_path)
    try:
        run_id = await waiting_run(client)
        for depth in (MAX_JSON_DEPTH + 1, 5000, 200_000):
            deep = "[" * depth + "]" * depth
            r = await client.post(f"/v1/runs/{run_id}/input/review", data='{"value": ' + deep + "}",
                                  headers={"Content-Type": "application/json"})
            body = await r.json()
            assert r.status == 400, (depth, body)
            assert f"nested deeper than {MAX_JSON_DEPTH} levels" in body["error"]["message"]
        shallow = {"approved": True, "note": [[["fine"]]]}  # nested well within the limit: a 422 from the schema
        r = await client.post(f"/v1/runs/{run_id}/input/review", json={"value": shallow})
        assert r.status == 422 and "note" in (await r.json())["error"]["message"]
        assert (await (await client.get(f"/v1/runs/{run_id}")).json())["status"] == "waiting"
        r = await client.post(f"/v1/runs/{run_id}/input/review", json={"value": {"approved": True}})
        assert r.status == 200, await r.text()
        info = await (await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": "10"})).json()
        assert info["status"] == "done" and info["output"] is True
    finally:
        await client.close()
