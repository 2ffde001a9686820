"""MCP servers as tool sources (the official `mcp` SDK's client).

    from agentrt.tools.mcp import mcp_tools

    files = mcp_tools("files", command=["python", "files_server.py"])     # stdio
    db = mcp_tools("db", url="http://127.0.0.1:9000/mcp", headers={"Authorization": "Bearer ..."})

A server's tools enter the registry as `NAME.tool` (spec.py: how a server is reached and the
--mcp flag; declare.py: mcp_tools; convert.py: schemas, idempotence, results; connection.py:
one supervised connection; executor.py: the registry's "mcp" executor). The SDK is imported on
first use, so that the command line's --mcp flag costs nothing where no server is named.
"""
from typing import Any

from agentrt.tools.mcp.spec import McpServerSpec, configure_servers, parse_flag

__all__ = ["McpServerSpec", "McpToolset", "configure_servers", "mcp_tools", "parse_flag"]


def __getattr__(name: str) -> Any:
    if name in ("McpToolset", "mcp_tools"):
        from agentrt.tools.mcp import declare

        return getattr(declare, name)
    raise AttributeError(f"module 'agentrt.tools.mcp' has no attribute {name!r}")
