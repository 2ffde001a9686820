"""A real MCP server (the SDK's MCPServer) for the MCP tool-source tests.

    python tests/tools/mcp_server_fixture.py                 # stdio
    python tests/tools/mcp_server_fixture.py --http PORT     # streamable HTTP at /mcp (uvicorn)
    python tests/tools/mcp_server_fixture.py --http PORT --token SECRET   # ... asking for a bearer token

Tools: `add` (idempotent hint, structured output), `lookup` (read-only), `slow` (reports progress,
then answers; a cancelled call is noted in the file named by $MCP_FIXTURE_CANCEL_LOG, a finished
one in $MCP_FIXTURE_CALL_LOG), `fail`
(isError result), `bad_output` (structured content that breaks its output schema), `crash` (the
process exits mid-call), `grow` (registers the tool `extra` and announces the list change), `shrink`
(removes `extra` again). Each start appends a line to $MCP_FIXTURE_START_LOG when it is set, so the
tests can count restarts; the process id goes with it so the tests can check it is gone.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Annotated

from pydantic import BaseModel, Field

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent, ToolAnnotations

server = MCPServer("fixture", log_level="ERROR")


class Sum(BaseModel):
    total: int


@server.tool(annotations=ToolAnnotations(idempotent_hint=True))
def add(a: int, b: int) -> Sum:
    """Add two integers."""
    return Sum(total=a + b)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup(key: Annotated[str, Field(description="a key to look up")]) -> str:
    """Look a key up in a small table."""
    return {"alpha": "first", "beta": "second"}.get(key, "unknown")


@server.tool()
async def slow(steps: int, ctx: Context) -> str:
    """Count to `steps`, reporting progress after each step."""
    try:
        for i in range(steps):
            await asyncio.sleep(0.05)
            await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
    except asyncio.CancelledError:
        if os.environ.get("MCP_FIXTURE_CANCEL_LOG"):
            with open(os.environ["MCP_FIXTURE_CANCEL_LOG"], "a") as f:
                f.write("cancelled\n")
        raise
    if os.environ.get("MCP_FIXTURE_CALL_LOG"):
        with open(os.environ["MCP_FIXTURE_CALL_LOG"], "a") as f:
            f.write(f"slow {steps}\n")
    return f"counted to {steps}"


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the reason given."""
    raise ToolError(f"refused: {reason}")


def bad_output() -> CallToolResult:
    """Returns structured content that its output schema does not allow."""
    return CallToolResult(content=[TextContent(type="text", text="many")], structured_content={"count": "many"})


server.add_tool(bad_output)
# The server checks a result against a schema it derived from a return type: this one is published
# only, so the wrong value reaches the client, as from a server that does not check its own output.
server._tool_manager._tools["bad_output"].fn_metadata.output_schema = {
    "type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}


@server.tool()
def crash() -> str:
    """Ends the server process in the middle of the call."""
    sys.stdout.flush()
    os._exit(3)


def extra(text: str) -> str:
    """Echo the text (only listed after `grow`)."""
    return text


@server.tool()
async def grow(ctx: Context) -> str:
    """Register the tool `extra` and announce that the tool list changed."""
    server.add_tool(extra)
    await _announce(ctx)
    return "grown"


@server.tool()
async def shrink(ctx: Context) -> str:
    """Remove the tool `extra` and announce that the tool list changed."""
    server.remove_tool("extra")
    await _announce(ctx)
    return "shrunk"


async def _announce(ctx: Context) -> None:
    """Both spellings of a list change: the 2026 subscription bus and the older notification."""
    try:
        await ctx.notify_tools_changed()
    except Exception:  # noqa: BLE001 - not a modern session
        pass
    try:
        await ctx.request_context.session.send_tool_list_changed()
    except Exception:  # noqa: BLE001 - a modern session has no spontaneous notification
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, metavar="PORT")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    if os.environ.get("MCP_FIXTURE_START_LOG"):
        with open(os.environ["MCP_FIXTURE_START_LOG"], "a") as f:
            f.write(f"{os.getpid()}\n")
    if args.http is None:
        server.run("stdio")
        return
    import uvicorn

    app = server.streamable_http_app()
    if args.token:
        app = _require_token(app, args.token)
    uvicorn.run(app, host="127.0.0.1", port=args.http, log_level="warning")


def _require_token(app, token: str):
    """ASGI middleware: 401 unless `Authorization: Bearer TOKEN`."""

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != f"Bearer {token}".encode():
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"missing or wrong token"})
                return
        await app(scope, receive, send)

    return guarded


if __name__ == "__main__":
    main()
