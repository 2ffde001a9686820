"""MCP servers as tool sources, over stdio: a real server (tests/tools/mcp_server_fixture.py, the
SDK's MCPServer) started as a child process by the registry's "mcp" executor."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from agentrt.tools import ToolRegistry
from agentrt.tools.errors import NoWorkerError, ToolDefinitionError
from agentrt.tools.mcp import McpServerSpec, mcp_tools
from agentrt.tools.tool import McpEndpoint

FIXTURE = str(Path(__file__).parent / "mcp_server_fixture.py")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """The fixture's start and cancel logs (one declaration serves the module's tests)."""
    d = tmp_path_factory.mktemp("mcp")
    return {"start": d / "starts.log", "cancel": d / "cancels.log"}


@pytest.fixture(scope="module")
def fx(logs):
    return mcp_tools("fx", command=[sys.executable, FIXTURE],
                     env={"MCP_FIXTURE_START_LOG": str(logs["start"]), "MCP_FIXTURE_CANCEL_LOG": str(logs["cancel"])})


def starts(logs) -> list[int]:
    return [int(line) for line in logs["start"].read_text().split()] if logs["start"].exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a child that exited but was not reaped yet is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def test_the_servers_tools_are_declared_as_name_dot_tool_with_its_schemas(fx, logs):
    assert set(fx.names()) == {f"fx.{n}" for n in ("add", "lookup", "slow", "fail", "bad_output", "crash", "grow",
                                                   "shrink")}
    add = fx["add"]
    assert add.executor == "mcp" and add.mcp.tool == "add"
    assert add.parameters["required"] == ["a", "b"] and add.parameters["properties"]["a"] == {"type": "integer"}
    assert add.output_schema["properties"]["total"] == {"type": "integer"}
    # idempotent only where the annotations say so (idempotentHint / readOnlyHint)
    assert {t.mcp.tool for t in fx if t.idempotent} == {"add", "lookup"}
    assert fx["lookup"].parameters["properties"]["key"]["description"] == "a key to look up"
    # listing the tools started the server and stopped it again
    assert starts(logs) and not any(alive(p) for p in starts(logs))


def test_the_program_decides_idempotence_over_the_annotations(logs):
    some = mcp_tools("fx", command=[sys.executable, FIXTURE], idempotent=["slow"])
    assert {t.mcp.tool for t in some if t.idempotent} == {"slow"}
    with pytest.raises(ToolDefinitionError, match="idempotent= takes"):
        mcp_tools("fx", command=[sys.executable, FIXTURE], idempotent="slow")


async def test_calls_results_errors_and_progress(fx):
    async with ToolRegistry(fx) as reg:
        r = await reg.call("fx.add", {"a": 2, "b": 3})
        assert r.ok and r.value == {"total": 5} and r.attempts[0].executor == "mcp"
        progress = []
        r = await reg.call("fx.slow", {"steps": 3}, on_progress=progress.append)
        assert r.ok and r.value == {"result": "counted to 3"}
        assert [(p.progress, p.total, p.message) for p in progress] == [
            (1, 3, "step 1 of 3"), (2, 3, "step 2 of 3"), (3, 3, "step 3 of 3")]
        r = await reg.call("fx.fail", {"reason": "no stock"})
        assert r.error.kind == "tool_raised" and "MCP server 'fx' tool 'fail' failed" in r.error.message
        assert "refused: no stock" in r.error.message
        r = await reg.call("fx.bad_output", {})
        assert r.error.kind == "invalid_output"
        assert "MCP server 'fx' tool 'bad_output'" in r.error.message and "output schema" in r.error.message
        r = await reg.call("fx.add", {"a": "two", "b": 3})  # checked here, never sent
        assert r.error.kind == "invalid_arguments"


async def test_a_timed_out_call_is_cancelled_on_the_server(fx, logs):
    async with ToolRegistry(fx) as reg:
        await reg.executor("mcp").start(fx.spec)  # the timeout is then the call's alone
        r = await reg.call("fx.slow", {"steps": 100}, timeout_s=0.5)
        assert r.error.kind == "timeout"
        await until(lambda: logs["cancel"].exists() and "cancelled" in logs["cancel"].read_text())
        assert (await reg.call("fx.add", {"a": 1, "b": 1})).value == {"total": 2}  # the server goes on


async def test_a_crashed_server_is_started_again_and_none_outlives_the_registry(fx, logs):
    before = set(starts(logs))
    reg = ToolRegistry(fx)
    assert (await reg.call("fx.lookup", {"key": "alpha"})).value == {"result": "first"}
    (first,) = set(starts(logs)) - before
    r = await reg.call("fx.crash", {})
    assert r.error.kind == "worker_lost" and "MCP server 'fx' tool 'crash'" in r.error.message
    assert "not declared idempotent" in r.attempts[-1].not_retried  # so it is not sent again
    # the next call waits for the restart
    assert (await reg.call("fx.lookup", {"key": "beta"})).value == {"result": "second"}
    (second,) = set(starts(logs)) - before - {first}
    assert not alive(first) and alive(second)
    await reg.aclose()
    assert not alive(second)


async def test_list_changes_update_the_registry(fx):
    async with ToolRegistry(fx) as reg:
        assert (await reg.call("fx.grow", {})).ok
        await until(lambda: "fx.extra" in reg)
        assert reg.get("fx.extra").parameters["required"] == ["text"]
        assert (await reg.call("fx.extra", {"text": "hi"})).value == {"result": "hi"}
        assert (await reg.call("fx.shrink", {})).ok
        await until(lambda: "fx.extra" not in reg)
        r = await reg.call("fx.extra", {"text": "hi"})
        assert r.error.kind == "unknown_tool"
        assert r.error.message == "tool 'fx.extra' is gone: MCP server 'fx' no longer lists tool 'extra'"


async def test_a_server_that_cannot_start_fails_its_calls_naming_it(fx, tmp_path):
    with pytest.raises(ToolDefinitionError, match=r"MCP server 'nope' \(.*no-such-server.*\): cannot list its tools"):
        mcp_tools("nope", command=[str(tmp_path / "no-such-server")])
    # declared while it worked, gone at run time: the call fails, retryable, naming the server
    spec = McpServerSpec.of("gone", command=[str(tmp_path / "no-such-server")])
    moved = dataclasses.replace(fx["add"], name="gone.add", mcp=McpEndpoint(server=spec, tool="add"))
    async with ToolRegistry([moved]) as reg:
        r = await reg.call("gone.add", {"a": 1, "b": 2})
        assert r.error.kind == "no_worker" and r.error.retryable
        assert "MCP server 'gone'" in r.error.message and "tool 'add'" in r.error.message
        assert "cannot run the command" in r.error.message
        with pytest.raises(NoWorkerError, match="MCP server 'gone'.*cannot be started.*cannot run the command"):
            await reg.executor("mcp").start(spec)


def test_server_specs_are_checked():
    with pytest.raises(ToolDefinitionError, match="exactly one of command"):
        McpServerSpec.of("x")
    with pytest.raises(ToolDefinitionError, match="must be 1-32 letters"):
        McpServerSpec.of("a.b", command=["x"])
    with pytest.raises(ToolDefinitionError, match="headers= only apply"):
        McpServerSpec.of("x", command=["x"], headers={"a": "b"})


def test_a_process_that_dies_without_closing_leaves_no_server_behind(tmp_path):
    """The parent is killed (no aclose, no cleanup): the server sees its stdin close and exits."""
    import subprocess
    import time

    start_log = tmp_path / "starts.log"
    script = f"""
import asyncio, os, sys
from agentrt.tools import ToolRegistry
from agentrt.tools.mcp import mcp_tools
fx = mcp_tools("fx", command=[sys.executable, {FIXTURE!r}], env={{"MCP_FIXTURE_START_LOG": {str(start_log)!r}}})
async def main():
    reg = ToolRegistry(fx)
    assert (await reg.call("fx.add", {{"a": 1, "b": 1}})).ok
    os._exit(0)
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    pids = [int(p) for p in start_log.read_text().split()]
    assert len(pids) == 2  # the listing's server, then the registry's
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"servers still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


async def test_a_server_that_keeps_failing_is_left_alone_until_the_next_call(tmp_path):
    from agentrt.tools.mcp.connection import McpConnection, ServerUnavailable

    conn = McpConnection(McpServerSpec.of("gone", command=[str(tmp_path / "missing")]), lambda tools: None,
                         backoff_s=0.01, give_up_after=3)
    try:
        with pytest.raises(ServerUnavailable, match="cannot run the command"):
            await conn.ready()
        await until(lambda: conn._task.done())  # three attempts, then nobody waits: it stops trying
        with pytest.raises(ServerUnavailable, match="cannot run the command"):
            await conn.ready()  # a call tries again
    finally:
        await conn.aclose()
