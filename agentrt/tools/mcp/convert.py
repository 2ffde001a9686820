"""MCP tool descriptions -> agentrt Tools, and MCP call results -> tool values.

A server's tool `read_file` becomes the registry's `files.read_file` (characters OpenAI's function
names do not allow become '_'), with the server's input schema as its parameters (so a tool-call
output is constrained by it like any tool's) and its output schema, where it gives one. A tool is
idempotent (retried and re-run on resume like any idempotent tool) only when the program says so
or the server's annotations say so (idempotentHint or readOnlyHint): MCP's own default is that a
tool may have side effects.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterable

import mcp_types as types

from agentrt.tools.errors import NoWorkerError, ToolDefinitionError
from agentrt.tools.schema import strip_titles
from agentrt.tools.tool import DEFAULT_TIMEOUT_S, McpEndpoint, Tool

log = logging.getLogger("agentrt.tools.mcp")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def registry_name(server: str, tool: str) -> str:
    return f"{server}.{_UNSAFE.sub('_', tool)}"


def annotated_idempotent(t: types.Tool) -> bool:
    a = t.annotations
    return a is not None and (a.idempotent_hint is True or a.read_only_hint is True)


def declared_policy(idempotent: bool | Iterable[str] | None = None, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                    retries: int = 0) -> tuple[tuple[str, Any], ...]:
    """A program's policy for a server's tools, as McpEndpoint.policy keeps it. idempotent: True or
    False for every tool, the names of the idempotent ones (as the server names them), or None
    to follow each tool's annotations."""
    if idempotent is not None and not isinstance(idempotent, bool):
        if isinstance(idempotent, str):
            raise ToolDefinitionError(f"idempotent= takes True, False, None or a list of tool names, got {idempotent!r}")
        idempotent = frozenset(idempotent)
    return (("idempotent", idempotent), ("timeout_s", timeout_s), ("retries", retries))


def to_tool(spec: Any, t: types.Tool, policy: tuple[tuple[str, Any], ...] = ()) -> Tool:
    """One listed MCP tool as a registry Tool bound to the "mcp" executor, under the program's
    policy (declared_policy). Raises ToolDefinitionError naming the server and the tool when its
    name or schemas cannot be used."""
    given = dict(policy)
    idempotent, timeout_s, retries = given.get("idempotent"), given.get("timeout_s", DEFAULT_TIMEOUT_S), \
        given.get("retries", 0)
    name = registry_name(spec.name, t.name)
    parameters = strip_titles(dict(t.input_schema or {"type": "object", "properties": {}}))
    parameters.setdefault("type", "object")
    output = strip_titles(dict(t.output_schema)) if t.output_schema is not None else None
    safe = annotated_idempotent(t) if idempotent is None else idempotent if isinstance(idempotent, bool) \
        else t.name in idempotent
    description = t.description or (t.annotations.title if t.annotations and t.annotations.title else "") or t.name
    try:
        return Tool(name=name, description=description, parameters=parameters, output_schema=output,
                    idempotent=safe, timeout_s=timeout_s, retries=retries, executor="mcp",
                    # a tool not idempotent is retried only when its server was not there: the
                    # call was never sent
                    retry_on=None if safe else (NoWorkerError,),
                    mcp=McpEndpoint(server=spec, tool=t.name, policy=tuple(policy)))
    except ToolDefinitionError as e:
        raise ToolDefinitionError(f"MCP server '{spec.name}' tool '{t.name}': {e}") from None


def to_tools(spec: Any, listed: list[types.Tool], policy: tuple[tuple[str, Any], ...] = ()) -> list[Tool]:
    """The usable tools of a listing; a tool whose name or schemas cannot be used is left out
    with a warning naming it (the server's other tools stay usable)."""
    out: list[Tool] = []
    for t in listed:
        try:
            out.append(to_tool(spec, t, policy))
        except ToolDefinitionError as e:
            log.warning("%s; the tool is left out", e)
    return out


def result_value(result: types.CallToolResult) -> Any:
    """What a call returned: its structured content when it has one; else its text (one text
    block: the string; several: the strings joined by newlines); else the content blocks as JSON."""
    if result.structured_content is not None:
        return result.structured_content
    texts = [b.text for b in result.content if isinstance(b, types.TextContent)]
    if len(texts) == len(result.content):
        return "\n".join(texts)
    return [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content]


def error_text(result: types.CallToolResult, limit: int = 500) -> str:
    """The text of an isError result, shortened for an error message."""
    text = " ".join(b.text for b in result.content if isinstance(b, types.TextContent)).strip()
    text = text or "no message"
    return text if len(text) <= limit else text[:limit] + "..."
