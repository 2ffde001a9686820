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

Delta = tuple[int, "str | None", "str | None", str]  # (call index, id, name, arguments fragment)


class ToolCallStream:
    def __init__(self, parallel: bool, new_id: Callable[[], str]) -> None:
        self.call_depth = 2 if parallel else 1  # nesting depth of a call object's members
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
                if self.depth == self.call_depth and self.key == "arguments" and not in_args:
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
