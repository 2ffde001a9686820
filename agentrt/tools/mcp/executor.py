"""The "mcp" executor: runs registry tools on MCP servers, one connection per server, and keeps
the registry in step with each server's tool list.

Failures, each naming the server and the tool: a server that cannot start or be reached
(NoWorkerError: retryable, the call was never sent; also an HTTP server that restarted and no
longer knows the session), a server that went away or a transport that failed during the call
(WorkerLostError: lost, so an idempotent tool is sent again once the server is back), a tool
the server no longer lists (UnknownToolError), a result with isError (ToolRaisedError), and
structured content that breaks the tool's output schema (ToolOutputError). Cancelling a call
(its timeout, or the run that made it) makes the SDK send notifications/cancelled.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError

from agentrt.tools.errors import (NoWorkerError, ToolCallError, ToolOutputError, ToolRaisedError, UnknownToolError,
                                  WorkerLostError)
from agentrt.tools.mcp.connection import McpConnection, ServerUnavailable
from agentrt.tools.mcp.convert import error_text, result_value, to_tools
from agentrt.tools.mcp.spec import McpServerSpec
from agentrt.tools.progress import CALL_PROGRESS, ToolProgress
from agentrt.tools.tool import Tool

log = logging.getLogger("agentrt.tools.mcp")


class McpExecutor:
    """Created by a ToolRegistry the first time one of its tools runs on "mcp" (or by
    `registry.executor("mcp")` to start servers ahead: `await ex.start(spec)`)."""

    def __init__(self, registry: Any, *, backoff_s: float = 0.1, backoff_max_s: float = 5.0) -> None:
        self.registry = registry
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._connections: dict[McpServerSpec, McpConnection] = {}
        self._policies: dict[McpServerSpec, tuple[tuple[str, Any], ...]] = {}
        self._listed: dict[McpServerSpec, set[str]] = {}  # the MCP names each server lists now

    def connection(self, spec: McpServerSpec) -> McpConnection:
        conn = self._connections.get(spec)
        if conn is None:
            conn = McpConnection(spec, lambda listed: self._sync(spec, listed), backoff_s=self.backoff_s,
                                 backoff_max_s=self.backoff_max_s)
            self._connections[spec] = conn
        return conn

    async def start(self, spec: McpServerSpec, policy: tuple[tuple[str, Any], ...] = ()) -> list[Tool]:
        """Start (connect to) a server now and register its tools; its tools. Raises NoWorkerError
        when it cannot be started."""
        if policy:
            self._policies[spec] = policy
        try:
            await self.connection(spec).ready()
        except ServerUnavailable as e:
            raise NoWorkerError(spec.name, f"MCP server '{spec.name}' ({spec.where}) cannot be started: {e}") from None
        return [t for t in self.registry if t.mcp is not None and t.mcp.server == spec]

    async def execute(self, tool: Tool, args: dict[str, Any], *, timeout: float | None = None) -> Any:
        ep = tool.mcp
        if ep is None:
            raise ToolCallError(tool.name, f"tool '{tool.name}' is bound to the mcp executor but names no MCP server")
        spec = ep.server
        self._policies.setdefault(spec, ep.policy)
        where = f"MCP server '{spec.name}' tool '{ep.tool}'"
        conn = self.connection(spec)
        try:
            client = await conn.ready()
        except ServerUnavailable as e:
            raise NoWorkerError(tool.name, f"MCP server '{spec.name}' ({spec.where}) is not available for tool "
                                           f"'{ep.tool}': {e}") from None
        if ep.tool not in self._listed.get(spec, {ep.tool}):
            raise UnknownToolError(tool.name, f"{where} is gone: the server no longer lists it")
        listener = CALL_PROGRESS.get()

        async def progress(done: float, total: float | None, message: str | None) -> None:
            if listener is not None:
                listener(ToolProgress(done, total, message, time.time()))

        try:
            result = await client.call_tool(ep.tool, args, progress_callback=progress)
        except MCPError as e:
            if e.code == types.CONNECTION_CLOSED:
                conn.connection_lost()
                raise WorkerLostError(tool.name, f"{where}: the server closed the connection during the call "
                                                 "(it is started again)") from None
            if e.error.message == "Session terminated":  # an HTTP server that restarted: the call never ran
                conn.connection_lost()
                raise NoWorkerError(tool.name, f"{where}: the server no longer knows this session (it restarted); "
                                               "a new one is made") from None
            status = conn.take_http_error()
            raise ToolRaisedError(tool.name, f"{where}: the server answered error {e.code}: {e.error.message}"
                                             + (f" ({status})" if status else ""), retryable=False) from None
        except RuntimeError as e:  # the SDK's own check of structured content against the output schema
            if "structured content" in str(e):
                raise ToolOutputError(tool.name, f"{where} returned a value that breaks its output schema: {e}") from None
            raise ToolRaisedError(tool.name, f"{where}: {e}") from e
        except Exception as e:  # noqa: BLE001 - the transport failed (an HTTP server gone): connect anew next time
            conn.connection_lost()
            raise WorkerLostError(tool.name, f"{where}: the connection failed during the call: "
                                             f"{type(e).__name__}: {e}") from e
        if result.is_error:
            raise ToolRaisedError(tool.name, f"{where} failed: {error_text(result)}")
        return result_value(result)

    def _sync(self, spec: McpServerSpec, listed: list[types.Tool]) -> None:
        """The registry after a listing: the server's tools added or updated, the ones it no
        longer lists removed (a later call of one is told so)."""
        self._listed[spec] = {t.name for t in listed}
        registry = self.registry
        mine = {t.name: t for t in registry if t.mcp is not None and t.mcp.server == spec}
        policy = self._policies.get(spec) or next((t.mcp.policy for t in mine.values()), ())
        fresh = to_tools(spec, listed, policy)
        for t in fresh:
            if t.name in registry and t.name not in mine:
                log.warning("MCP server '%s': tool '%s' is not registered: the name is taken by another tool",
                            spec.name, t.name)
                continue
            registry.register(t, replace=True)
        kept = {t.name for t in fresh}
        for name, t in mine.items():
            if name not in kept:
                registry.unregister(name, reason=f"MCP server '{spec.name}' no longer lists tool '{t.mcp.tool}'")
        added, removed = kept - set(mine), set(mine) - kept
        if mine and (added or removed):
            log.info("MCP server '%s': tools added: %s; removed: %s", spec.name, ", ".join(sorted(added)) or "none",
                     ", ".join(sorted(removed)) or "none")

    async def aclose(self) -> None:
        """Stop every server this executor started (and close its HTTP sessions)."""
        connections, self._connections = list(self._connections.values()), {}
        for conn in connections:
            await conn.aclose()
