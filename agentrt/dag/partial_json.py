"""Which top-level members of a JSON document still being streamed are already final.

An LLM that writes a plan or a tool call's arguments as one JSON object (or array) streams it as text
deltas. A runtime that dispatches work as soon as its inputs are known (LLMCompiler-style streaming:
start a tool call whose arguments are final while the LLM is still generating the rest) wants each
top-level member the moment it can no longer change. ``JsonMembers`` scans the deltas incrementally
(each character once; strings, escapes and nesting tracked) and reports ``(key, value)`` members of an
object, or ``(index, value)`` items of an array, each parsed with ``json.loads``.

The delimiter rule: a member is final only when the ``,`` after it or the closing ``}``/``]`` of the
top-level value is seen at depth 1. For a number or a literal nothing earlier would do (``4`` may still
become ``42``, ``tru`` is not yet ``true``); strings, objects and arrays could be reported at their own
closing character, but one rule for every kind keeps the scanner simple and costs at most the
whitespace before the delimiter. Duplicate keys are reported each time (``json.loads`` keeps the last).

Malformed text (a member that ``json.loads`` rejects, a key that is not a string, mismatched brackets,
a top-level value that is not an object or array) sets ``broken`` and stops reporting; ``feed`` never
raises. Text after the top-level value has closed is ignored.
"""
from __future__ import annotations

import json
import re
from typing import Any

_STRING_STOP = re.compile(r'["\\]')      # inside a string only these matter
_STRUCTURAL = re.compile(r'["{}\[\],:]')  # outside a string only these matter
_OPENER = {"}": "{", "]": "["}


class JsonMembers:
    """Incremental scanner of a streamed JSON object or array: ``feed`` deltas, get the top-level
    members that became final with each one."""

    def __init__(self) -> None:
        self._kind: str | None = None
        self._done = False
        self._broken: str | None = None
        self._stack: list[str] = []      # open brackets; len() is the depth
        self._in_str = False
        self._esc = False
        self._parts: list[str] = []      # text of the current key or value from earlier deltas
        self._key: str | None = None     # object: the current member's key once its ':' was seen
        self._count = 0                  # members reported so far (the next array index)
        self._offset = 0                 # characters fed before the current delta

    @property
    def kind(self) -> str | None:
        """"object", "array", or None before the first '{' / '['."""
        return self._kind

    @property
    def done(self) -> bool:
        """The top-level value has closed."""
        return self._done

    @property
    def broken(self) -> str | None:
        """Why scanning stopped (text that is not JSON), else None."""
        return self._broken

    def feed(self, delta: str) -> list[tuple[str | int, Any]]:
        """Append text; return the top-level members that became final with it, in order:
        (key, value) for an object, (index, value) for an array. Values are parsed with json.loads."""
        out: list[tuple[str | int, Any]] = []
        i, n, start = 0, len(delta), 0   # start: where this delta's part of the pending text begins
        while i < n and not self._done and self._broken is None:
            if self._kind is None:       # before the top-level value: whitespace, then '{' or '['
                ch = delta[i]
                if ch in " \t\r\n":
                    i += 1
                    continue
                if ch not in "{[":
                    self._fail(f"the top-level value starts with {ch!r}: not an object or array", i)
                    break
                self._kind = "object" if ch == "{" else "array"
                self._stack.append(ch)
                i = start = i + 1
                continue
            if self._in_str:
                if self._esc:
                    self._esc = False
                    i += 1
                    continue
                m = _STRING_STOP.search(delta, i)
                if m is None:
                    break
                i = m.start()
                self._esc, self._in_str = delta[i] == "\\", delta[i] == "\\"
                i += 1
                continue
            m = _STRUCTURAL.search(delta, i)
            if m is None:
                break
            i, ch = m.start(), m.group()
            if ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._stack.append(ch)
            elif ch in "}]":
                if self._stack.pop() != _OPENER[ch]:
                    self._fail(f"mismatched {ch!r}", i)
                    break
                if not self._stack:
                    self._close(self._take(delta, start, i), i, out, closing=True)
                    self._done = self._broken is None
            elif len(self._stack) == 1:
                text = self._take(delta, start, i)
                start = i + 1
                if ch == ",":
                    self._close(text, i, out, closing=False)
                elif self._kind == "object" and self._key is None:
                    self._read_key(text, i)
                else:
                    self._fail("unexpected ':'", i)
            i += 1
        if not self._done and self._broken is None and self._kind is not None:
            self._parts.append(delta[start:])
        self._offset += n
        return out

    def _take(self, delta: str, start: int, i: int) -> str:
        text = "".join(self._parts) + delta[start:i]
        self._parts = []
        return text

    def _fail(self, why: str, i: int) -> None:
        self._broken = f"{why} at character {self._offset + i}"

    def _read_key(self, text: str, i: int) -> None:
        try:
            key = json.loads(text)
        except ValueError as e:
            return self._fail(f"object key {text.strip()[:40]!r} is not valid JSON ({e.msg})", i)
        if not isinstance(key, str):
            return self._fail(f"object key {text.strip()[:40]!r} is not a string", i)
        self._key = key

    def _close(self, text: str, i: int, out: list, closing: bool) -> None:
        """The delimiter after a member (or the top-level closer) at index i of the delta."""
        if closing and self._count == 0 and self._key is None and not text.strip():
            return                       # {} or []
        if self._kind == "object" and self._key is None:
            return self._fail(f"expected '\"key\": value' before {'the closing brace' if closing else ','}", i)
        name = self._key if self._kind == "object" else self._count
        try:
            value = json.loads(text)
        except ValueError as e:
            return self._fail(f"member {name!r}: {text.strip()[:40]!r} is not valid JSON ({e.msg})", i)
        out.append((name, value))
        self._key = None
        self._count += 1
