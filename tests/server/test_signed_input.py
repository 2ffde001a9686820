"""A wait_for node over HTTP (scripted engine): the programs API shows it as its own kind with its
question and schema, and the value posted to it keeps who gave it (`by`), how and when."""
from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from agentrt.runtime.loader import load_example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.runtime.summary import summarize
from agentrt.runtime.trace import read_trace
from agentrt.server.app import create_app
from agentrt.server.config import ServerConfig

PROGRAM = Path(__file__).parent / "approval_program.py"


async def make_client(tmp_path) -> TestClient:
    example = load_example(PROGRAM)
    runtime = Runtime(ScriptedBackend({"answer": "It may run."}, step_s=0.002))
    app = create_app(ServerConfig(runs_dir=tmp_path / "runs", access_log=False), "scripted", {example.name: example},
                     runtime)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def status_of(client: TestClient, run_id: str, wanted: str) -> dict:
    for _ in range(500):
        info = await (await client.get(f"/v1/runs/{run_id}")).json()
        if info["status"] == wanted:
            return info
        await asyncio.sleep(0.01)
    raise AssertionError(f"the run never got to {wanted}: {info}")


async def test_the_value_posted_keeps_who_gave_it(tmp_path):
    client = await make_client(tmp_path)
    try:
        programs = (await (await client.get("/v1/programs")).json())["data"]
        node = next(n for n in programs[0]["graph"]["nodes"] if n["id"] == "approval")
        assert node["kind"] == "wait_for" and node["prompt"] == "Run {sql}?" and node["schema"]["required"] == ["approved"]
        r = await client.post("/v1/programs/approve/runs", json={"inputs": {"sql": "DROP TABLE t"}})
        run_id = (await r.json())["run_id"]
        await status_of(client, run_id, "waiting")
        await asyncio.sleep(0.05)  # the person reads the question
        r = await client.post(f"/v1/runs/{run_id}/input/approval", json={"value": {"approved": True}, "by": ""})
        assert r.status == 400 and (await r.json())["error"]["param"] == "by"
        assert (await r.json())["error"]["message"].startswith("by: ") and "at least 1 character" in await r.text()
        r = await client.post(f"/v1/runs/{run_id}/input/approval", json={"value": {"approved": True}, "by": "maria"})
        assert r.status == 200, await r.text()
        await status_of(client, run_id, "done")
        trace = tmp_path / "trace.jsonl"
        trace.write_text(await (await client.get(f"/v1/runs/{run_id}/trace")).text())
    finally:
        await client.close()
    run = summarize(read_trace(trace))["runs"][0]
    approval = next(n for n in run["nodes"] if n["node"] == "approval")
    assert approval["kind"] == "wait_for" and approval["answered_by"] == "maria" and approval["via"] == "http"
    assert approval["prompt"] == "Run DROP TABLE t?" and approval["answered_at"] > approval["asked_at"]
    assert run["stalls"]["waiting_for_input_s"] >= 0.05 and run["stalls"]["waiting_on_tool_s"] == 0
