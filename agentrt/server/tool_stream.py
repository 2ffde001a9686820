"""Streaming a constrained tool-call output as OpenAI's tool_call deltas.

The engine writes a call as `{"name": "<tool>", "arguments": {...}}` (a JSON list of them for
parallel calls), name before arguments (the grammar keeps the schema's property order). OpenAI
clients expect, per call, one delta with its index, id and name, then the arguments' JSON text
in fragments that add up to it. ToolCallStream reads the output character by character (tracking
nesting and strings, so braces inside string values do not count) and returns those deltas as
soon as the text that makes them is generated.

>>> s = ToolCallStream(parallel=False, new_id=lambda: "call_1")
>>> s.feed('{"name": "get_weather", "arguments": {"city": "Os')
[(0, 'call_1', 'get_weather', ''), (0, None, None, '{"city": "Os')]
>>> s.feed('lo}"}}')
[(0, None, None, 'lo}"}')]
"""
from __future__ import annotations

import json
from typing import Callable

from agentrt.structured.tool_formats import ToolCallFormat
from agentrt.structured.tool_parse import call_wrappers, calls_start

Delta = tuple[int, "str | None", "str | None", str]  # (call index, id, name, arguments fragment)


class ToolCallStream:
    def __init__(self, parallel: bool, new_id: Callable[[], str], arguments_key: str = "arguments") -> None:
        self.call_depth = 2 if parallel else 1  # nesting depth of a call object's members
        self.arguments_key = arguments_key  # Llama 3 and Gemma 3 call them "parameters"
        self.new_id = new_id
        self.index = -1  # the call being written
        self.depth = 0
        self.in_string = self.escape = False
        self.expect_key = False
        self.key: str | None = None
        self.string = ""  # the current string token at call depth, raw
        self.args_depth: int | None = None  # depth just outside the arguments object while inside it

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        fragment: list[str] = []

        def flush() -> None:
            if fragment:
                out.append((self.index, None, None, "".join(fragment)))
                fragment.clear()

        for ch in text:
            in_args = self.args_depth is not None
            if in_args:
                fragment.append(ch)
            if self.in_string:
                if not in_args and self.depth == self.call_depth:
                    self.string += ch
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if not in_args and self.depth == self.call_depth:
                        self._string_done(out, flush)
                continue
            if ch == '"':
                self.in_string = True
                if not in_args and self.depth == self.call_depth:
                    self.string = ch
            elif ch in "{[":
                if self.depth == self.call_depth and self.key == self.arguments_key and not in_args:
                    self.args_depth = self.depth
                    fragment.append(ch)
                self.depth += 1
                if self.depth == self.call_depth and ch == "{":
                    self.index += 1
                    self.expect_key, self.key = True, None
            elif ch in "}]":
                self.depth -= 1
                if in_args and self.depth == self.args_depth:
                    self.args_depth = None
                    flush()
            elif self.depth == self.call_depth and not in_args:
                if ch == ",":
                    self.expect_key = True
                elif ch == ":":
                    self.expect_key = False
        flush()
        return out

    def _string_done(self, out: list[Delta], flush: Callable[[], None]) -> None:
        value = json.loads(self.string)
        if self.expect_key:
            self.key = value
        elif self.key == "name":
            flush()
            out.append((self.index, self.new_id(), value, ""))


class FamilyToolCallStream:
    """A model family's call turn (structured.tool_formats) as it is generated: the text before the
    calls as content (held back while it could be the start of a marker such as <tool_call>),
    each call object through a ToolCallStream (index, id and name, then argument fragments), and
    what wraps and separates the calls (markers, <tool_call> tags, list brackets, "; ", fences)
    dropped. feed() returns content strings and Delta tuples in the order they were written.

    >>> from agentrt.structured.tool_formats import QWEN
    >>> s = FamilyToolCallStream(QWEN, new_id=lambda: "call_1")
    >>> s.feed('Checking.\\n<tool')
    ['Checking.\\n']
    >>> s.feed('_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>')
    [(0, 'call_1', 'f', ''), (0, None, None, '{"a": 1}')]
    """

    def __init__(self, fmt: ToolCallFormat, new_id: Callable[[], str], parallel: bool = True) -> None:
        self.fmt, self.parallel = fmt, parallel
        self.wrappers = call_wrappers(fmt) + [o for o in fmt.text_openers]
        self.calls = ToolCallStream(parallel=True, new_id=new_id, arguments_key=fmt.arguments_key)
        self.calls.feed("[")  # every call object then sits one level in, as in a parallel list
        self.mode: str | None = None  # None: only blanks so far; "text"; "calls"
        self.pending = ""

    def feed(self, text: str) -> list["str | Delta"]:
        self.pending += text
        out: list[str | Delta] = []
        if self.mode != "calls":
            out += self._text()
        if self.mode == "calls":
            out += self._calls()
        return out

    def end(self) -> list[str]:
        """Text held back at the end (it did not become a marker)."""
        held, self.pending = self.pending, ""
        return [held] if held and self.mode != "calls" else []

    def _text(self) -> list[str]:
        if self.mode is None:
            stripped = self.pending.lstrip()
            if not stripped:
                return []
            # a bare JSON value opens calls only where this turn's calls start so: text the grammar
            # let through ("[1] First, ...") must not vanish into a call that never comes
            json_opens = stripped[0] in "{[" and self.fmt.starts_call(stripped, self.parallel)
            if json_opens or (not stripped.startswith(self.fmt.text_openers)
                              and calls_start(self.fmt, stripped) == 0 and stripped[0] not in "{["):
                self.mode, self.pending = "calls", stripped
                return []
            if any(w.startswith(stripped) and w != stripped for w in self.wrappers if w != "```"):
                return []  # may still open a call (or be a text opener)
            self.mode = "text"
        found = [i for i in (self.pending.find(m) for m in self.fmt.markers) if i >= 0]
        if found:
            cut = min(found)
            self.mode = "calls"
        else:  # hold back a tail that may be the start of a marker
            cut = len(self.pending) - max((k for m in self.fmt.markers for k in range(1, len(m))
                                           if self.pending.endswith(m[:k])), default=0)
        content, self.pending = self.pending[:cut], self.pending[cut:]
        return [content] if content else []

    def _calls(self) -> list[Delta]:
        out: list[Delta] = []
        for ch in self.pending:
            if self.calls.depth == 1 and not self.calls.in_string and ch != "{":
                continue  # the wrapper around and between calls
            for d in self.calls.feed(ch):
                if out and d[1] is None and out[-1][1] is None and out[-1][0] == d[0]:
                    d = (d[0], None, None, out.pop()[3] + d[3])  # one fragment per feed, not per character
                out.append(d)
        self.pending = ""
        return out
