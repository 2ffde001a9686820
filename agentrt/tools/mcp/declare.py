"""`mcp_tools(...)`: an MCP server's tools, declared in a program module.

    files = mcp_tools("files", command=[sys.executable, "files_server.py"])
    db = mcp_tools("db", url="https://db.example/mcp", headers={"Authorization": f"Bearer {TOKEN}"})
    program = Program("ask", inputs={...}, tools=[*files, *db])
    tools = [*files, *db]

The server is asked for its tools when the module is imported (the program's nodes are checked
against their schemas then); that first connection is closed again at once, on a thread of its
own, so it works whether or not an event loop runs. Runs start the server again on first use,
in the runtime's loop, and keep it.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterable, Iterator, Mapping, Sequence

from agentrt.tools.errors import ToolDefinitionError
from agentrt.tools.mcp.connection import McpConnection, ServerUnavailable
from agentrt.tools.mcp.convert import declared_policy, registry_name, to_tools
from agentrt.tools.mcp.spec import McpServerSpec, resolve_spec
from agentrt.tools.tool import DEFAULT_TIMEOUT_S, Tool


class McpToolset:
    """The tools an MCP server listed when the program was declared, as registry Tools
    (`files.read_file`, ...). Iterate it (or `*files`) into Program(tools=...) and `tools`."""

    def __init__(self, spec: McpServerSpec, tools: Sequence[Tool]) -> None:
        self.spec = spec
        self.tools = tuple(tools)

    @property
    def name(self) -> str:
        return self.spec.name

    def __iter__(self) -> Iterator[Tool]:
        return iter(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    def names(self) -> list[str]:
        """The registry names, `server.tool`."""
        return [t.name for t in self.tools]

    def __getitem__(self, tool: str) -> Tool:
        """A tool by the server's name for it (`files["read_file"]`) or the registry's."""
        for t in self.tools:
            if tool in (t.name, t.mcp.tool if t.mcp else None):
                return t
        raise KeyError(f"MCP server '{self.name}' lists no tool '{tool}' (tools: {', '.join(self.names()) or 'none'})")

    def __repr__(self) -> str:
        return f"McpToolset({self.name!r}, {self.names()!r})"


def mcp_tools(name: str, *, command: Sequence[str] | str | None = None, url: str | None = None,
              headers: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None, cwd: str | None = None,
              idempotent: bool | Iterable[str] | None = None, timeout_s: float | None = DEFAULT_TIMEOUT_S,
              retries: int = 0, connect_timeout_s: float = 30.0) -> McpToolset:
    """The tools of the MCP server `name`: started with `command` (stdio) or reached at `url`
    (streamable HTTP, `headers` on every request), or the server `--mcp NAME=...` gives (which
    wins over both). idempotent: True/False for all its tools, the names of the idempotent ones,
    or None (default) to follow each tool's annotations (idempotentHint, readOnlyHint).
    timeout_s, retries: as for any tool (a tool not idempotent is retried only when its server
    was not there). Raises ToolDefinitionError naming the server when it cannot be listed."""
    declared = None if command is None and url is None else McpServerSpec.of(
        name, command=command, url=url, headers=headers, env=env, cwd=cwd)
    spec = resolve_spec(declared, name)
    policy = declared_policy(idempotent, timeout_s, retries)
    listed = _list_in_thread(spec, connect_timeout_s)
    return McpToolset(spec, to_tools(spec, listed, policy))


def _list_in_thread(spec: McpServerSpec, connect_timeout_s: float) -> list[Any]:
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["tools"] = asyncio.run(_list_once(spec, connect_timeout_s))
        except BaseException as e:  # noqa: BLE001 - handed to the declaring thread
            out["error"] = e

    thread = threading.Thread(target=work, name=f"agentrt-mcp-list:{spec.name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        e = out["error"]
        why = str(e) if isinstance(e, ServerUnavailable) else f"{type(e).__name__}: {e}"
        raise ToolDefinitionError(f"MCP server '{spec.name}' ({spec.where}): cannot list its tools: {why}") from None
    return out["tools"]


async def _list_once(spec: McpServerSpec, connect_timeout_s: float) -> list[Any]:
    listed: list[Any] = []
    conn = McpConnection(spec, listed.extend, connect_timeout_s=connect_timeout_s, restart=False)
    try:
        await conn.ready()
    finally:
        await conn.aclose()
    return listed


__all__ = ["McpToolset", "mcp_tools", "registry_name"]
