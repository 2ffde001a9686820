"""Reading tool calls back out of a model's output, in its family's format (structured.tool_formats).

A constrained output is exactly a format's call turn, but the parser does not count on it: a
model writing freely (tool_choice "auto" with text allowed, a peer engine, a truncated turn) puts
text before its calls, wraps them in fences, drops the wrapper (a special token such as Mistral's
[TOOL_CALLS] is skipped when the output is decoded), or breaks the JSON. Calls that read as calls
come back as {"name", "arguments"}; everything else comes back as content, never as an error.

>>> from agentrt.structured.tool_formats import QWEN
>>> parse_tool_calls(QWEN, 'Let me look.\\n<tool_call>\\n{"name": "find", "arguments": {"q": "x"}}\\n</tool_call>')
ParsedCalls(content='Let me look.', calls=({'name': 'find', 'arguments': {'q': 'x'}},))
>>> parse_tool_calls(QWEN, '<tool_call>\\n{"name": "find", "arguments": {"q": ').calls
()
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from agentrt.structured.tool_formats import ToolCallFormat

_DECODER = json.JSONDecoder()
# Llama 3's built-in tools: <|python_tag|>brave_search.call(query="...") (the tag itself is a
# special token, gone from decoded text)
_BUILTIN = re.compile(r"([A-Za-z_]\w*)\.call\(((?:[^()\"]|\"(?:[^\"\\]|\\.)*\")*)\)")
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(\"(?:[^\"\\]|\\.)*\"|[^,]*)\s*(?:,|$)")


@dataclass(frozen=True)
class ParsedCalls:
    content: str  # the text that is not a call (before, between or after them, or unreadable)
    calls: tuple[dict[str, Any], ...]  # {"name", "arguments"} in the order written


def call_wrappers(fmt: ToolCallFormat) -> list[str]:
    """Text around and between calls that carries nothing: markers, a call's own wrapper, fences."""
    pieces = [*fmt.markers, fmt.call_prefix.strip(), fmt.call_suffix.strip(), "```"]
    return sorted({p for p in pieces if p}, key=len, reverse=True)


def calls_start(fmt: ToolCallFormat, text: str) -> int | None:
    """Where the calls begin: at the output's start when it opens like a call (a JSON value, a
    marker, the call's wrapper), else at the first marker after some text; None: no call."""
    stripped = text.lstrip()
    first = len(text) - len(stripped)
    if stripped[:1] in ("{", "[") or any(stripped.startswith(w) for w in call_wrappers(fmt) if w != "```"):
        return first
    found = [i for i in (text.find(m) for m in fmt.markers) if i >= 0]
    return min(found) if found else None


def _call(value: Any, fmt: ToolCallFormat, names: Collection[str] | None) -> dict[str, Any] | None:
    """{"name", "arguments"} from one decoded object, or None when it is not a call of a tool."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    keys = [k for k in (fmt.arguments_key, "arguments", "parameters") if k in value]
    args = value[keys[0]] if keys else {}
    if isinstance(args, str):  # arguments sent as a JSON string, as OpenAI's API writes them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or (names is not None and value["name"] not in names):
        return None
    return {"name": value["name"], "arguments": args}


def _builtin_call(match: re.Match, names: Collection[str] | None) -> dict[str, Any] | None:
    name, body = match.group(1), match.group(2)
    if names is not None and name not in names:
        return None
    args: dict[str, Any] = {}
    pos = 0
    while pos < len(body):
        kw = _KWARG.match(body, pos)
        if kw is None or kw.end() == pos:
            return None
        raw = kw.group(2).strip()
        try:
            args[kw.group(1)] = json.loads(raw) if raw.startswith('"') else raw
        except ValueError:
            return None
        pos = kw.end()
    return {"name": name, "arguments": args}


def parse_tool_calls(fmt: ToolCallFormat, text: str, names: Collection[str] | None = None) -> ParsedCalls:
    """The calls in `text` (of the tools `names`, when given) and the rest as content."""
    start = calls_start(fmt, text)
    if start is None:
        return ParsedCalls(text.strip(), ())
    calls: list[dict[str, Any]] = []
    content = [text[:start]]
    wrappers = call_wrappers(fmt)
    i, n = start, len(text)
    while i < n:
        if text[i].isspace() or text[i] in ";,":
            i += 1
            continue
        wrapper = next((w for w in wrappers if text.startswith(w, i)), None)
        if wrapper is not None:
            i += len(wrapper)
            if wrapper == "```" and text.startswith(("tool_code", "json"), i):
                i = text.index("\n", i) + 1 if "\n" in text[i:] else n
            continue
        if text[i] in "{[":
            try:
                value, end = _DECODER.raw_decode(text, i)
            except ValueError:  # malformed or cut short: the rest is content
                content.append(text[i:])
                break
            found = [_call(v, fmt, names) for v in (value if isinstance(value, list) else [value])]
            if found and all(found):
                calls += found
            else:
                content.append(text[i:end])
            i = end
            continue
        builtin = _BUILTIN.match(text, i)
        call = _builtin_call(builtin, names) if builtin else None
        if call is None:
            content.append(text[i:])  # text after the calls
            break
        calls.append(call)
        i = builtin.end()
    if not calls:  # nothing read as a call: the text as it was written
        return ParsedCalls(text.strip(), ())
    return ParsedCalls("\n".join(c.strip() for c in content if c.strip()), tuple(calls))
