"""`/mcp`: the served programs as Model Context Protocol tools (Streamable HTTP, the official SDK).

Each loaded program is a tool: its name, the program file's docstring as the description, the
program's inputs as the input schema (the schema POST /v1/programs/NAME/runs validates against).
A call starts a run through the RunManager, as the programs API does (recorded in the run store,
listed in /v1/runs and the console, metadata {"via": "mcp"}), and follows its event log:

- each finished node sends a progress notification (when the client gave a progress token);
- the result's structuredContent is {run_id, status, output} (output matching the program's
  output shape, in outputSchema where it is known) with the output as text beside it;
- a run that waits for input (wait_for) returns at once with status "waiting" and the nodes it
  waits at, their schemas and prompts, and how to answer: the tool `agentrt.provide_input`, or
  POST /v1/runs/RUN_ID/input/NODE; that tool then follows the run as the first call did;
- a failed or cancelled run returns isError with the node and message;
- the client cancelling the call (notifications/cancelled) cancels the run.

An unknown tool is a JSON-RPC error (invalid params) naming it and the tools there are; arguments
the program's schema refuses come back as a tool error (isError) naming the field, so the model
can correct its call, as the MCP spec asks. Requests pass the server's middlewares first: the
same bearer keys as the rest of the API (401 without one), and each MCP session is bound to the
key that opened it. On a loopback bind the SDK's DNS-rebinding checks (Host, Origin) are on.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any, Mapping

import mcp.types as types
from aiohttp import web
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from agentrt.dag.compiled import CompiledProgram
from agentrt.dag.refs import Ref
from agentrt.dag.typecheck import Shapes
from agentrt.errors import InputValueError, RunConfigError
from agentrt.runtime.loader import Example
from agentrt.server.asgi_bridge import serve_asgi
from agentrt.server.config import is_loopback
from agentrt.server.errors import ApiError
from agentrt.server.runs import RunManager, ServedRun
from agentrt.server.state import STATE, ServerState

log = logging.getLogger("agentrt.server")
MCP_PATH = "/mcp"
PROVIDE_INPUT = "agentrt.provide_input"  # a dot: program names are identifiers in practice
_PROGRESS_KINDS = ("llm", "tool", "wait_for")
FOLLOW_POLL_S = 1.0  # a call following its run looks at the server's state at least this often
_WAITING_ITEM = {"type": "object", "properties": {"node": {"type": "string"}, "schema": {"type": "object"},
                                                  "prompt": {"type": ["string", "null"]}},
                 "required": ["node", "schema"]}
_PROVIDE_INPUT_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["run_id", "node", "value"],
    "properties": {"run_id": {"type": "string", "description": "the waiting run (run_id of the earlier result)"},
                   "node": {"type": "string", "description": "the wait_for node it waits at"},
                   "value": {"description": "the answer, valid against that node's schema"},
                   "by": {"type": "string", "description": "who answers (kept in the run's trace)"}}}


def output_schema(program: CompiledProgram) -> Mapping[str, Any] | None:
    """The JSON schema of a program's output where the shapes of its output nodes are known
    (JSON-schema LLM outputs, text, tool output schemas, wait_for schemas), else None."""
    shapes = Shapes({n: a["spec"] for n, a in program.graph.nodes(data=True)}, program.tools)
    if isinstance(program.output, Ref):
        return shapes.at(program.output)[0]
    parts = {name: shapes.at(ref)[0] for name, ref in program.output.items()}
    return {"type": "object", "properties": {k: dict(v) if v is not None else {} for k, v in parts.items()},
            "required": list(parts)}


def result_schema(program: CompiledProgram) -> dict[str, Any]:
    """A tool's outputSchema: the run envelope, its `output` the program's output shape (any
    JSON where unknown). An object at the root, as every MCP protocol version allows."""
    shape = output_schema(program)
    return {"type": "object", "required": ["run_id", "status"],
            "properties": {"run_id": {"type": "string"}, "status": {"type": "string", "enum": ["done", "waiting"]},
                           "output": dict(shape) if shape is not None else {},
                           "waiting_for": {"type": "array", "items": _WAITING_ITEM}}}


def program_tool(example: Example) -> types.Tool:
    description = example.description.strip() or f"Runs the agentrt program '{example.name}'."
    return types.Tool(name=example.name, title=example.name, description=description,
                      input_schema=example.program.input_schema(example.default_inputs),
                      output_schema=result_schema(example.program))


def provide_input_tool() -> types.Tool:
    return types.Tool(
        name=PROVIDE_INPUT, title="Answer a waiting run",
        description="Gives the value a run waits for at a wait_for node (a program call answered with status "
                    "'waiting' names the run and the node), then follows the run as the program call did: "
                    "its output when it ends, or where it waits next.",
        input_schema=_PROVIDE_INPUT_SCHEMA,
        output_schema={"type": "object", "required": ["run_id", "status"],
                       "properties": {"run_id": {"type": "string"}, "status": {"type": "string"}, "output": {},
                                      "waiting_for": {"type": "array", "items": _WAITING_ITEM}}})


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=repr)


def _tool_error(message: str, structured: Mapping[str, Any] | None = None) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True,
                                structured_content=dict(structured) if structured is not None else None)


class McpEndpoint:
    """The MCP server of one app: tools from its programs, runs through its RunManager."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.server = Server("agentrt", version=_version(), instructions=(
            "Each tool runs an agentrt program; a run that waits for input returns status 'waiting': "
            f"answer it with {PROVIDE_INPUT}."), on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        security = None
        if is_loopback(state.config.host):  # a browser page must not reach a loopback server by DNS rebinding
            security = TransportSecuritySettings(
                allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*", "127.0.0.1", "localhost", "[::1]"],
                allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*",
                                 *state.config.cors_origins])
        self.sessions = StreamableHTTPSessionManager(self.server, security_settings=security,
                                                     max_request_body_size=state.config.limits.max_body_bytes)
        if PROVIDE_INPUT in state.programs:
            log.warning("program '%s' is not served over MCP: the tool of that name answers waiting runs", PROVIDE_INPUT)
        self.closing = False
        self._following = 0  # calls in flight, following their runs
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- lifecycle (aiohttp on_startup / on_shutdown) --
    async def start(self, app: web.Application) -> None:
        started = asyncio.Event()

        async def run() -> None:  # one task enters and leaves the manager's task group
            async with self.sessions.run():
                started.set()
                await self._stop.wait()

        self._task = asyncio.get_running_loop().create_task(run(), name="agentrt-mcp-sessions")
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait([self._task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task.done():
            self._task.result()  # the manager failed to start: say why

    async def stop(self, app: web.Application) -> None:
        """Before aiohttp waits for open requests (after the runs' shutdown grace): the calls in
        flight answer, then every MCP session ends, so open streams close. Their runs are not
        cancelled by this: with a run store they resume at the next start."""
        self.closing = True
        for _ in range(int(2 * FOLLOW_POLL_S / 0.05)):  # each follower notices within FOLLOW_POLL_S
            if not self._following:
                break
            await asyncio.sleep(0.05)
        self._stop.set()
        if self._task is not None:
            await self._task

    # -- HTTP --
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Every method on /mcp (POST messages, GET the server's stream, DELETE the session)."""
        extra: dict[str, Any] = {}
        key = _bearer(request)
        if self.state.config.api_keys and key:  # checked by the auth middleware; the session is bound to it
            fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
            extra["user"] = AuthenticatedUser(AccessToken(token="", client_id=f"key:{fingerprint}", scopes=[]))
        return await serve_asgi(self.sessions.handle_request, request, **extra)

    # -- MCP handlers --
    async def _list_tools(self, ctx: ServerRequestContext, params: types.PaginatedRequestParams | None
                          ) -> types.ListToolsResult:
        tools = [program_tool(ex) for name, ex in sorted(self.state.programs.items()) if name != PROVIDE_INPUT]
        return types.ListToolsResult(tools=[*tools, provide_input_tool()])

    async def _call_tool(self, ctx: ServerRequestContext, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name == PROVIDE_INPUT:
            return await self._provide_input(ctx, params.arguments or {})
        if params.name not in self.state.programs:
            names = ", ".join([*sorted(self.state.programs), PROVIDE_INPUT])
            raise MCPError(types.INVALID_PARAMS, f"unknown tool '{params.name}' (tools: {names})",
                           data={"tool": params.name})
        try:
            runs, _ = self.state.ready()
            run, _ = runs.submit(params.name, params.arguments or {}, metadata={"via": "mcp"})
        except ApiError as e:  # invalid arguments (naming the field), too many runs, loading, stopping
            what = "invalid arguments" if e.code == "invalid_inputs" else "cannot start a run"
            return _tool_error(f"tool '{params.name}': {what}: {e.message}")
        return await self._follow(ctx, runs, run)

    async def _provide_input(self, ctx: ServerRequestContext, args: Mapping[str, Any]) -> types.CallToolResult:
        missing = [k for k in ("run_id", "node", "value") if k not in args]
        extra = sorted(set(args) - set(_PROVIDE_INPUT_SCHEMA["properties"]))
        if missing or extra or not isinstance(args.get("run_id"), str) or not isinstance(args.get("node"), str):
            return _tool_error(f"tool '{PROVIDE_INPUT}': invalid arguments: "
                               + (f"missing {', '.join(missing)}" if missing else
                                  f"unknown {', '.join(extra)}" if extra else "run_id and node must be strings"))
        by = args.get("by")
        try:
            runs, _ = self.state.ready()
            run = runs.get(args["run_id"])
            if run.ended:
                return _tool_error(f"run '{run.run_id}' has already ended ({run.status})")
            runs.provide_input(run, args["node"], args["value"], by=by if isinstance(by, str) else None)
        except ApiError as e:  # no such run, loading, stopping
            return _tool_error(f"tool '{PROVIDE_INPUT}': {e.message}")
        except (InputValueError, RunConfigError) as e:  # the schema refuses the value; not waiting there
            return _tool_error(f"tool '{PROVIDE_INPUT}': {e}")
        await asyncio.sleep(0)  # the run takes the value before its log is read again
        return await self._follow(ctx, runs, run, after_waiting=True)

    async def _follow(self, ctx: ServerRequestContext, runs: RunManager, run: ServedRun,
                      after_waiting: bool = False) -> types.CallToolResult:
        """Follow the run's event log until it ends or waits for input, reporting each finished
        node as progress. A call the client cancels cancels the run."""
        expected = sum(1 for _, a in self.state.programs[run.program].program.graph.nodes(data=True)
                       if a["kind"] in _PROGRESS_KINDS and not a["template"])
        after, finished = 0, 0
        if after_waiting:  # answering: progress counts on from what had finished, waits are past
            after = len(run.events)
            finished = sum(1 for _, type, _ in run.events if type == "node_finished")
        self._following += 1
        try:
            while True:
                for event_id, type, data in run.events[after:]:
                    after = event_id
                    if type == "node_finished":
                        finished += 1
                        await ctx.session.report_progress(finished, max(expected, finished),
                                                          f"{data.get('node')} {data.get('status')}")
                if run.ended and after >= len(run.events):
                    return self._ended(run)
                waiting = runs.waiting_for(run)
                if run.status == "waiting" and waiting:
                    return self._waiting(run, waiting)
                if self.closing:  # past the shutdown grace: runs still going were stopped to resume later
                    resumes = "it resumes when the server starts again" if runs.store.durable else "it is lost"
                    return _tool_error(f"the server stopped before run '{run.run_id}' ended ({run.status}): {resumes}")
                await run.changed(after, timeout=FOLLOW_POLL_S)
        except asyncio.CancelledError:
            if not self.closing:  # the client cancelled the call: stop its run
                runs.cancel(run)
            raise
        finally:
            self._following -= 1

    def _ended(self, run: ServedRun) -> types.CallToolResult:
        envelope = {"run_id": run.run_id, "status": run.status}
        if run.status == "done":
            return types.CallToolResult(content=[types.TextContent(type="text", text=_text(run.output))],
                                        structured_content={**envelope, "output": run.output})
        error = run.error or {}
        where = f" at node '{error['node']}'" if error.get("node") else ""
        return _tool_error(f"run '{run.run_id}' {run.status}{where}: {error.get('message', 'no reason given')}",
                           {**envelope, "error": error})

    def _waiting(self, run: ServedRun, waiting: Mapping[str, Any]) -> types.CallToolResult:
        items = [{"node": node, "schema": dict(w.schema), "prompt": w.prompt} for node, w in waiting.items()]
        lines = [f"run '{run.run_id}' is waiting for input:"]
        for item in items:
            node = item["node"]
            lines += [f"- node '{node}'" + (f": {item['prompt']}" if item["prompt"] else "")
                      + f" (a value valid against {json.dumps(item['schema'])})",
                      f"  answer with the tool {PROVIDE_INPUT} {{\"run_id\": \"{run.run_id}\", \"node\": \"{node}\", "
                      f"\"value\": ...}}, or POST /v1/runs/{run.run_id}/input/{node} {{\"value\": ...}}"]
        return types.CallToolResult(content=[types.TextContent(type="text", text="\n".join(lines))],
                                    structured_content={"run_id": run.run_id, "status": "waiting",
                                                        "waiting_for": items})


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentrt")
    except PackageNotFoundError:
        return "0"


async def _mcp_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """A browser client of an allowed origin (the server's CORS headers are on the response
    already) also sends MCP's headers, DELETEs its session, and reads the session id it got."""
    if request.path == MCP_PATH and "Access-Control-Allow-Origin" in response.headers:
        response.headers["Access-Control-Allow-Headers"] += ", Mcp-Session-Id, Mcp-Protocol-Version"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        response.headers["Access-Control-Expose-Headers"] = "Mcp-Session-Id"


def mount_mcp(app: web.Application) -> McpEndpoint:
    """Serve /mcp on the app (its state set, its CORS hook added): routes, the session manager's
    lifecycle, MCP's CORS headers."""
    endpoint = McpEndpoint(app[STATE])
    app.router.add_route("*", MCP_PATH, endpoint.handle)
    app.on_startup.append(endpoint.start)
    app.on_shutdown.append(endpoint.stop)
    if endpoint.state.config.cors_origins:
        app.on_response_prepare.append(_mcp_cors_headers)
    return endpoint
