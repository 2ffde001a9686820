"""An LLM response as the value of its node, by the node's output spec.

Text: the text. JsonSchema: the engine's parsed value; without one (an engine that does not
constrain decoding), the JSON found in the text. ToolCall: {"name", "arguments"} from the parsed
call (or from a call the model wrote as JSON text), with parallel calls {"calls": [...]}, else
{"text"}: the model answered in text.
ProgramRun.complete() then checks the value against the spec (schema, tool names).
"""
from __future__ import annotations

import json
import re
from typing import Any

from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, text_depth_exceeds
from agentrt.runtime.backend import LLMResponse

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


class OutputParseError(ValueError):
    """The model's text holds no JSON value where the node needs one."""


def parse_json_text(text: str) -> Any:
    """The JSON value in a model's text: the whole text, a ```json fenced block, or the first
    object/array that parses. Raises OutputParseError quoting the start of the text."""
    stripped = text.strip()
    if text_depth_exceeds(text):  # json's decoder recurses per level
        raise OutputParseError(f"the model's output is {JsonDepthError(MAX_JSON_DEPTH)}")
    candidates = [stripped, *(m.strip() for m in _FENCE.findall(text))]
    for c in candidates:
        try:
            return json.loads(c)
        except json.JSONDecodeError:
            pass
    decoder = json.JSONDecoder()
    for m in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, m.start())
            return value
        except json.JSONDecodeError:
            continue
    shown = stripped if len(stripped) <= 80 else stripped[:77] + "..."
    raise OutputParseError(f"the model's output is not JSON: {shown!r}")


def _tool_names(response_format: dict[str, Any]) -> set[str]:
    return {t.get("function", t).get("name") for t in response_format.get("tools", []) if isinstance(t, dict)}


def _calls(response_format: dict[str, Any], value: Any, parallel: bool) -> list[dict[str, Any]] | None:
    """The calls in a parsed output: one call object ({"name": tool, "arguments": {...}}), or with
    parallel calls a list of them too; None if the value is not that."""
    names = _tool_names(response_format)
    calls = value if parallel and isinstance(value, list) else [value]
    if calls and all(isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict)
                     for c in calls):
        return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    return None


def _calls_in_text(response_format: dict[str, Any], text: str, parallel: bool) -> list[dict[str, Any]] | None:
    """Tool calls written as JSON text, which is how models without a tool-call grammar call
    tools; None if the text is not exactly that."""
    try:
        return _calls(response_format, parse_json_text(text), parallel)
    except OutputParseError:
        return None


def node_value(response_format: dict[str, Any], response: LLMResponse) -> Any:
    kind = response_format.get("type", "text")
    if kind == "text":
        return response.text
    if kind == "json_schema":
        if response.parsed is not None:
            return response.parsed
        return parse_json_text(response.text)
    if kind == "tool_call":
        if response_format.get("tool_choice") == "none":  # described, not callable: the text answers
            return {"text": response.text}
        parallel = bool(response_format.get("parallel"))  # a list of calls (ToolCall.parallel)
        call = response.parsed
        if isinstance(call, dict) and call.get("name") is not None:
            calls = [{"name": call["name"], "arguments": call.get("arguments")}]
        elif parallel and isinstance(call, list) and call:
            calls = [{"name": c.get("name"), "arguments": c.get("arguments")} if isinstance(c, dict) else c for c in call]
        else:
            calls = _calls_in_text(response_format, response.text, parallel)
        if not calls:
            return {"text": response.text}
        return {"calls": calls} if parallel else calls[0]
    raise OutputParseError(f"unknown response_format type {kind!r}")
