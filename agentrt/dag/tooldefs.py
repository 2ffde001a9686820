"""Tool definitions as plain data: what a program needs to know about a tool (name, schemas).

Tools are duck-typed: any object with name/description/parameters (and optionally output_schema),
e.g. agentrt.tools.Tool, or an OpenAI-format dict. Executing them is the runtime's business.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import jsonschema

from agentrt.retry import RetryPolicy

# OpenAI's rule for function names, plus '.' between parts (an MCP server's tools are `server.tool`)
_TOOL_NAME = re.compile(r"^(?=.{1,64}$)[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


@dataclass(frozen=True)
class ToolDef:
    """A tool as the DSL sees it. `openai_schema()` is the chat-completions tool dict.

    >>> ToolDef("get_weather", "Weather for a city", {"type": "object"}).openai_schema()["function"]["name"]
    'get_weather'
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    output_schema: Mapping[str, Any] | None = None
    idempotent: bool = False  # safe to run twice (agentrt.tools.Tool.idempotent)
    retry: RetryPolicy | None = None  # the tool's own retries (Tool.retry_policy): a node's retry= lays over it

    def openai_schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


def schema_problems(schema: Any) -> list[str]:
    """What is wrong with a JSON schema under its draft's meta-schema (2020-12 by default), each
    naming the offending part as a JSON pointer; [] when it is valid."""
    if not isinstance(schema, Mapping):
        return [f"a JSON schema must be a dict, got {type(schema).__name__}"]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    problems = []
    for err in sorted(cls(cls.META_SCHEMA).iter_errors(schema), key=lambda e: list(map(str, e.absolute_path))):
        pointer = "/" + "/".join(str(p) for p in err.absolute_path)
        problems.append(f"at {pointer}: {err.message}")
    return problems


def value_problem(schema: Mapping[str, Any], value: Any) -> str | None:
    """Why `value` does not match `schema` (the most relevant error), or None."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    err = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    if err is None:
        return None
    return f"at /{'/'.join(str(p) for p in err.absolute_path)}: {err.message}"


def to_tool_def(tool: Any) -> ToolDef:
    """Normalise a duck-typed tool or an OpenAI-format dict; raises ValueError naming the tool."""
    if isinstance(tool, ToolDef):
        found = tool
    elif isinstance(tool, Mapping):
        inner = tool.get("function", tool)  # {"type": "function", "function": {...}} or the flat form
        if not isinstance(inner, Mapping) or "name" not in inner:
            raise ValueError(f"tool dict {dict(tool)!r} has no name (expected OpenAI format "
                             f"{{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}})")
        found = ToolDef(inner["name"], inner.get("description", ""),
                        inner.get("parameters", {"type": "object", "properties": {}}), tool.get("output_schema"),
                        idempotent=tool.get("idempotent") is True)
    elif all(hasattr(tool, a) for a in ("name", "description", "parameters")):
        policy = getattr(tool, "retry_policy", None)
        found = ToolDef(tool.name, tool.description or "", tool.parameters, getattr(tool, "output_schema", None),
                        idempotent=getattr(tool, "idempotent", False) is True,
                        retry=policy if isinstance(policy, RetryPolicy) else None)
    else:
        raise ValueError(f"{tool!r} is not a tool: give an object with name, description and parameters, "
                         f"or an OpenAI tool dict")
    if not isinstance(found.name, str) or not _TOOL_NAME.match(found.name):
        raise ValueError(f"tool name {found.name!r} must be 1-64 letters, digits, '_' or '-' (parts may be joined by '.')")
    for what, schema in (("parameters", found.parameters), ("output_schema", found.output_schema)):
        if schema is None:
            continue
        problems = schema_problems(schema)
        if problems:
            raise ValueError(f"tool '{found.name}': {what} is not a valid JSON schema: {'; '.join(problems)}")
    if found.parameters.get("type", "object") != "object":
        raise ValueError(f"tool '{found.name}': parameters must be an object schema")
    return found
