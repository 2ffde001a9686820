"""The MCP example program end to end on a scripted backend (its server a real child process), and
the command line: `agentrt serve --mcp` starts the servers it names with their tools registered,
a bad --mcp value stops `agentrt run` with the reason."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from agentrt.cli.run import run_example
from agentrt.runtime.loader import load_example, resolve_inputs
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.tools import ToolRegistry
from agentrt.tools.mcp import McpServerSpec

ROOT = Path(__file__).parents[2]
NOTES_SERVER = ROOT / "examples" / "mcp_notes" / "server.py"


async def test_the_notes_desk_example_runs_on_its_mcp_server(tmp_path):
    example = load_example(ROOT / "examples" / "notes_desk.py")
    assert [t.name for t in example.tools] == ["notes.search_notes", "notes.read_note", "notes.word_count"]
    assert all(t.idempotent for t in example.tools)  # readOnlyHint: safe to run again on resume
    backend = ScriptedBackend({"answer#1.llm": {"name": "notes.read_note", "arguments": {"id": "standup-rules"}},
                               "answer#2.llm": "Stand-up starts at 9:30 in room Ada."}, step_s=0.001)
    try:
        result, _ = await run_example(example, resolve_inputs(example, []), backend, trace_path=tmp_path / "t.jsonl",
                                      console=Console(file=io.StringIO(), width=140), live=False)
    finally:
        await backend.aclose()
    assert result.status == "done", result.error
    assert result.output == "Stand-up starts at 9:30 in room Ada."
    assert result.values["search"]["hits"][0]["id"] == "standup-rules"
    assert "9:30 in room Ada" in result.values["answer#1.tool"]["text"]


async def test_serve_starts_the_mcp_servers_it_is_given(capsys):
    from agentrt.cli.serve import _start_mcp_servers

    good = McpServerSpec.of("notes", command=[sys.executable, str(NOTES_SERVER)])
    bad = McpServerSpec.of("broken", command=[str(NOTES_SERVER.parent / "missing")])
    async with ToolRegistry() as reg:
        await _start_mcp_servers(reg, [good, bad])
        assert sorted(reg.names()) == ["notes.read_note", "notes.search_notes", "notes.word_count"]
        progress = []
        r = await reg.call("notes.word_count", {}, on_progress=progress.append)
        assert r.ok and r.value["result"] > 40 and len(progress) == 3
    out = capsys.readouterr().out
    assert "MCP server 'notes': notes.search_notes, notes.read_note, notes.word_count" in out
    assert "MCP server 'broken' did not start" in out and "cannot run the command" in out


def test_a_bad_mcp_flag_stops_the_run_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "agentrt.cli", "run", str(ROOT / "examples" / "notes_desk.py"),
                           "--mcp", "notes"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0
    assert "--mcp 'notes': write NAME=COMMAND or NAME=URL" in proc.stderr + proc.stdout


async def test_a_chat_request_may_name_mcp_tools():
    from aiohttp.test_utils import TestClient, TestServer

    from agentrt.runtime.runtime import Runtime
    from agentrt.server.app import create_app
    from agentrt.server.config import ServerConfig

    backend = ScriptedBackend(lambda req: [{"name": "notes.read_note", "arguments": {"id": "oncall"}}], step_s=0.001)
    client = TestClient(TestServer(create_app(ServerConfig(access_log=False), "m", {}, Runtime(backend))))
    await client.start_server()
    tool = {"type": "function", "function": {"name": "notes.read_note", "parameters": {
        "type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}
    try:
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "on-call?"}], "tools": [tool]})
        out = await r.json()
        assert r.status == 200, out
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "notes.read_note"
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{**tool, "function": {**tool["function"], "name": "notes..read"}}]})
        assert r.status == 400
    finally:
        await client.close()
        await backend.aclose()


def test_run_warns_of_an_mcp_server_the_program_does_not_declare():
    proc = subprocess.run([sys.executable, "-m", "agentrt.cli", "run", str(ROOT / "examples" / "notes_desk.py"),
                           "--mcp", f"other={sys.executable} {NOTES_SERVER}", "--input", "nope=1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "--mcp other: notes_desk.py declares no mcp_tools('other')" in proc.stderr
    assert proc.returncode != 0 and "nope" in proc.stderr + proc.stdout  # stopped before the model loads


async def test_a_chat_tool_named_alone_takes_the_registry_schema():
    from aiohttp.test_utils import TestClient, TestServer

    from agentrt.runtime.runtime import Runtime
    from agentrt.server.app import create_app
    from agentrt.server.config import ServerConfig
    from agentrt.tools.mcp import mcp_tools

    notes = mcp_tools("notes", command=[sys.executable, str(NOTES_SERVER)])
    backend = ScriptedBackend(lambda req: "fine", step_s=0.001)
    client = TestClient(TestServer(create_app(ServerConfig(access_log=False), "m", {}, Runtime(backend, tools=notes))))
    await client.start_server()
    try:
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "on-call?"}],
            "tools": [{"type": "function", "function": {"name": "notes.read_note"}}]})
        assert r.status == 200, await r.text()
        (sent,) = backend.requests[-1].response_format["tools"]
        assert sent["function"]["parameters"] == notes["read_note"].parameters
        assert sent["function"]["description"] == "The full text of one note."
    finally:
        await client.close()
        await backend.aclose()
