"""MCP servers as tool sources, over streamable HTTP: the same fixture server, run by uvicorn in a
subprocess on a free 127.0.0.1 port, asking for a bearer token; and the --mcp flag."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrt.tools import ToolRegistry
from agentrt.tools.errors import ToolDefinitionError
from agentrt.tools.mcp import McpServerSpec, configure_servers, mcp_tools, parse_flag
from agentrt.tools.mcp.spec import resolve_spec

FIXTURE = str(Path(__file__).parent / "mcp_server_fixture.py")
TOKEN = "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, FIXTURE, "--http", str(port), "--token", TOKEN])
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "the fixture server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the fixture server did not open its port"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_url_server_is_listed_with_its_headers(http_url):
    db = mcp_tools("db", url=http_url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert "db.add" in db.names() and db["add"].mcp.server.url == http_url
    with pytest.raises(ToolDefinitionError, match=r"MCP server 'db' \(http://127\.0\.0\.1:\d+/mcp\): cannot list .*"
                                                  r"\(HTTP 401 Unauthorized\)"):
        mcp_tools("db", url=http_url, headers={"Authorization": "Bearer wrong"})


async def test_calls_progress_and_errors_over_http(http_url):
    db = mcp_tools("db", url=http_url, headers={"Authorization": f"Bearer {TOKEN}"})
    async with ToolRegistry(db) as reg:
        assert (await reg.call("db.add", {"a": 20, "b": 22})).value == {"total": 42}
        progress = []
        r = await reg.call("db.slow", {"steps": 2}, on_progress=progress.append)
        assert r.ok and [p.progress for p in progress] == [1, 2]
        r = await reg.call("db.fail", {"reason": "closed"})
        assert r.error.kind == "tool_raised" and "MCP server 'db' tool 'fail' failed" in r.error.message


def test_the_mcp_flag_names_a_command_or_a_url_and_wins_over_the_program(http_url):
    assert parse_flag(f"db={http_url}") == McpServerSpec("db", url=http_url)
    assert parse_flag("files=python 'my server.py' --root /tmp").command == ("python", "my server.py", "--root", "/tmp")
    for bad in ("files", "=python x", "files="):
        with pytest.raises(ToolDefinitionError, match="write NAME=COMMAND or NAME=URL"):
            parse_flag(bad)
    flag = McpServerSpec.of("fx", command=[sys.executable, FIXTURE])
    configure_servers([flag])
    try:
        # the program's URL is replaced by the flag's command; a name alone takes the flag's server
        assert resolve_spec(McpServerSpec.of("fx", url="http://127.0.0.1:9/mcp"), "fx") == flag
        assert mcp_tools("fx")["add"].mcp.server == flag
    finally:
        configure_servers([])
    with pytest.raises(ToolDefinitionError, match=r"mcp_tools\('fx'\): no command= or url= given, and no --mcp fx"):
        mcp_tools("fx")


def start_fixture(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, FIXTURE, "--http", str(port)])
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, "the fixture server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            assert time.monotonic() < deadline, "the fixture server did not open its port"
            time.sleep(0.05)


async def test_a_restarted_http_server_gets_a_new_session():
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    proc = start_fixture(port)
    try:
        db = mcp_tools("db", url=url)
        async with ToolRegistry(db) as reg:
            assert (await reg.call("db.add", {"a": 1, "b": 2})).ok
            proc.kill()  # a crash (a graceful stop would wait for the client's open event stream)
            proc.wait(timeout=10)
            proc = start_fixture(port)
            first = await reg.call("db.add", {"a": 2, "b": 2})
            if not first.ok:  # the old session is unknown to the new process: the call names why
                assert "MCP server 'db' tool 'add'" in first.error.message, first.error.message
            assert (await reg.call("db.add", {"a": 3, "b": 2})).value == {"total": 5}
    finally:
        proc.kill()
        proc.wait(timeout=10)
