"""What an LLM call produces: Text(), JsonSchema(schema) or ToolCall(tools).

Plain data the engine reads through `to_response_format()` (OpenAI style) without importing dag.
`check(value)` normalises and validates the value a runtime reports for a finished call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from agentrt.dag.tooldefs import ToolDef, value_problem


@dataclass(frozen=True)
class Text:
    """Free text. The node's value is a str.

    >>> Text().to_response_format()
    {'type': 'text'}
    """

    def to_response_format(self) -> dict[str, Any]:
        return {"type": "text"}

    def value_schema(self) -> dict[str, Any]:
        return {"type": "string"}

    def check(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"a Text output must be a str, got {type(value).__name__}")
        return value

    def describe(self) -> str:
        return "text"


@dataclass(frozen=True)
class JsonSchema:
    """JSON matching `schema`. The node's value is the parsed JSON (dict, list, ...).

    The schema is checked against its meta-schema when the node is declared.

    >>> JsonSchema({"type": "array", "items": {"type": "string"}}).to_response_format()["type"]
    'json_schema'
    """

    schema: Mapping[str, Any]
    name: str = "output"

    def to_response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": dict(self.schema)}}

    def value_schema(self) -> Mapping[str, Any]:
        return self.schema

    def check(self, value: Any) -> Any:
        problem = value_problem(self.schema, value)
        if problem is not None:
            raise ValueError(f"output does not match its JSON schema {problem}")
        return value

    def describe(self) -> str:
        return "json"


CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolCall:
    """A call to one of `tools` (named as declared in Program(tools=...)), or text if allow_text.

    The node's value is {"name": tool, "arguments": {...}, "text": None}, or
    {"name": None, "arguments": None, "text": "..."} when the model answered in text.
    compile() attaches the tool definitions that `to_response_format()` needs.

    parallel: the model may make several calls in one turn (a JSON list of calls, each under its
    tool's schema; OpenAI's parallel_tool_calls). The value is then {"calls": [{"name",
    "arguments"}, ...], "text": None}, or {"calls": [], "text": "..."} for a text answer.

    choice (OpenAI's tool_choice) narrows what the model may write, never what its prompt says:
    that describes `tools`, and that text may answer, whatever the choice, so the steps of an
    agent loop share their prompt (and its KV) whichever they allow. "auto": a call, or text if
    allow_text; "none": text (the tools described, not callable); "required": a call; a tool's
    name: a call of that tool (a keyword wins over a tool so named). For a node that must call
    and stands alone, ToolCall(tools) describes just that.

    >>> call = ToolCall(["get_weather"], definitions=(ToolDef("get_weather", "", {"type": "object"}),))
    >>> call.to_response_format()["tools"][0]["function"]["name"]
    'get_weather'
    >>> ToolCall(["search", "lookup"], choice="lookup").describe()
    'tool call: lookup (tools described: search|lookup)'
    """

    tools: tuple[str, ...]
    allow_text: bool = False
    definitions: tuple[ToolDef, ...] = field(default=(), compare=False)
    choice: str = "auto"
    parallel: bool = False

    def __post_init__(self) -> None:
        tools = (self.tools,) if isinstance(self.tools, str) else tuple(self.tools)
        if not tools or not all(isinstance(t, str) for t in tools):
            raise ValueError(f"ToolCall needs one or more tool names (str), got {self.tools!r}")
        if not isinstance(self.choice, str) or (self.choice not in CHOICES and self.choice not in tools):
            raise ValueError(f"ToolCall choice must be 'auto', 'none', 'required' or one of its tools "
                             f"{list(tools)}, got {self.choice!r}")
        if not isinstance(self.parallel, bool):
            raise ValueError(f"ToolCall parallel must be a bool, got {self.parallel!r}")
        object.__setattr__(self, "tools", tools)
        if self.choice != "auto":  # "none" answers in text; "required" and a named tool never do
            object.__setattr__(self, "allow_text", self.choice == "none")

    @property
    def named(self) -> str | None:
        """The one tool a named choice makes the model call, else None."""
        return None if self.choice in CHOICES else self.choice

    @property
    def callable_tools(self) -> tuple[str, ...]:
        """The tools a call may name: all of them, the named one, or none (choice "none")."""
        if self.choice == "none":
            return ()
        return (self.named,) if self.named else self.tools

    def to_response_format(self) -> dict[str, Any]:
        if len(self.definitions) != len(self.tools):
            raise ValueError(f"ToolCall{list(self.tools)} has no tool definitions attached: use the spec of "
                             f"a compiled program (Program.compile() attaches them)")
        rf = {"type": "tool_call", "tools": [d.openai_schema() for d in self.definitions],
              "allow_text": self.allow_text, **({"parallel": True} if self.parallel else {})}
        if self.choice == "auto":
            return rf
        choice = {"type": "function", "function": {"name": self.named}} if self.named else self.choice
        return {**rf, "tool_choice": choice}

    def value_schema(self) -> dict[str, Any]:
        # With one callable tool, its parameters describe "arguments"; with several, they are unknown here.
        defs = [d for d in self.definitions if d.name in self.callable_tools]
        arguments = dict(defs[0].parameters) if len(defs) == 1 else {}
        if self.parallel:
            call = {"type": "object", "properties": {"name": {}, "arguments": arguments}, "additionalProperties": False}
            return {"type": "object", "properties": {"calls": {"type": "array", "items": call}, "text": {}},
                    "additionalProperties": False}
        return {"type": "object", "properties": {"name": {}, "arguments": arguments, "text": {}},
                "additionalProperties": False}

    def check(self, value: Any) -> dict[str, Any]:
        if isinstance(value, str):  # a text answer given as the text itself
            value = {"text": value}
        if self.parallel:
            return self._check_calls(value)
        if isinstance(value, Mapping) and value.get("name") is not None:
            return {**self.check_call(value), "text": None}
        return self._check_text(value, "a ToolCall output must be {'name': tool, 'arguments': {...}} or {'text': '...'}")

    def check_call(self, call: Any) -> dict[str, Any]:
        """One call ({"name", "arguments"}) this node may make, normalised; ValueError says why not."""
        if not isinstance(call, Mapping) or call.get("name") is None:
            raise ValueError(f"a tool call must be {{'name': tool, 'arguments': {{...}}}}, got {call!r}")
        if self.choice == "none":
            raise ValueError(f"called tool '{call['name']}', but this call answers in text (the tools are "
                             "described, not callable)")
        if call["name"] not in self.tools:
            raise ValueError(f"called tool '{call['name']}', which is not one of {list(self.tools)}")
        if self.named and call["name"] != self.named:
            raise ValueError(f"called tool '{call['name']}', but this call must call '{self.named}'")
        if not isinstance(call.get("arguments"), Mapping):
            raise ValueError(f"tool call to '{call['name']}' has no arguments object")
        return {"name": call["name"], "arguments": dict(call["arguments"])}

    def _check_calls(self, value: Any) -> dict[str, Any]:
        """A parallel node's value: its calls (a list of calls, {"calls": [...]}, or one call), or its text."""
        if isinstance(value, Mapping) and value.get("name") is not None:
            value = [value]
        elif isinstance(value, Mapping) and isinstance(value.get("calls"), list) and value["calls"]:
            value = value["calls"]
        if isinstance(value, list):
            if not value:
                raise ValueError("a parallel ToolCall output makes at least one call, got an empty list")
            return {"calls": [self.check_call(c) for c in value], "text": None}
        return {"calls": [], **self._check_text(value, "a parallel ToolCall output must be {'calls': [{'name': tool, "
                                                       "'arguments': {...}}, ...]} or {'text': '...'}")}

    def _check_text(self, value: Any, shape: str) -> dict[str, Any]:
        if isinstance(value, Mapping) and isinstance(value.get("text"), str):
            if not self.allow_text:
                raise ValueError(f"answered in text, but this call must call one of {list(self.callable_tools)}")
            return {"text": value["text"]} if self.parallel else {"name": None, "arguments": None, "text": value["text"]}
        raise ValueError(f"{shape}, got {value!r}")

    def describe(self) -> str:
        return self._describe() + (", parallel calls" if self.parallel and self.choice != "none" else "")

    def _describe(self) -> str:
        tools = "|".join(self.tools)
        if self.choice == "none":
            return f"text (tools described: {tools})"
        if self.named:
            return f"tool call: {self.named} (tools described: {tools})"
        if self.choice == "required":
            return f"tool call (required): {tools}"
        return f"tool call: {tools}" + (" or text" if self.allow_text else "")


OutputSpec = Text | JsonSchema | ToolCall
