"""Tool calls in a call turn still being streamed, each reported the moment its arguments close.

A model calls tools by writing JSON: `{"name": T, "arguments": {...}}` (the house format), a list
of such objects for parallel calls, or the same objects in a family's wrapping (Qwen's
`<tool_call>` blocks, Llama's `; `-separated calls, `"parameters"` for `"arguments"`; see
structured/tool_formats.py; Mistral's `[TOOL_CALLS]` marker is not recognized: it reads as a list). A call's arguments cannot change once the `}` that
closes its arguments object is written, so the tool can start then, while the model still writes
the rest of the turn (the call's own `}`, the next calls, the end-of-turn tokens).

`StreamedCalls.feed(delta)` scans the text once (strings and escapes tracked, like
partial_json.JsonMembers) and returns `(index, {"name": T, "arguments": {...}})` for each call
whose name is known and whose arguments object has closed; `closed_at[index]` is the number of
characters fed up to and including the character that completed it. `kind` says whether the
turn is one call object ("object") or a list of them ("list"). Text that is not a call turn (a
text answer, mismatched brackets, arguments that are not JSON) sets `broken` and stops
reporting; `feed` never raises. The final parsed output stays the authority: whoever starts a
call early must check it against the output once the output ends.
"""
from __future__ import annotations

import json
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")
# what a call turn may start with before its first JSON value (formats that wrap their calls)
MARKERS = ("<tool_call>",)
_OPENER = {"}": "{", "]": "["}


class StreamedCalls:
    """Incremental scanner of a streamed call turn: `feed` deltas, get the calls whose arguments
    closed with each one."""

    def __init__(self) -> None:
        self.kind: str | None = None     # "object" (one call per top-level value) or "list"
        self.broken: str | None = None
        self.closed_at: dict[int, int] = {}
        self._text: list[str] = []       # everything fed (outputs are short)
        self._pos = 0                    # characters scanned
        self._lead = ""                  # text before the first JSON value (a marker, whitespace)
        self._stack: list[str] = []
        self._in_str = False
        self._esc = False
        self._count = 0                  # calls opened so far
        self._call: dict[str, Any] | None = None  # the call object being scanned

    def feed(self, delta: str) -> list[tuple[int, dict[str, Any]]]:
        out: list[tuple[int, dict[str, Any]]] = []
        self._text.append(delta)
        for ch in delta:
            if self.broken is None:
                self._scan(ch, out)
            self._pos += 1
        return out

    # -- the scanner --
    def _scan(self, ch: str, out: list) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                self._string_closed(out)
            return
        if not self._stack:
            self._between_values(ch)
            return
        call = self._call
        if ch == '"':
            self._in_str = True
            if call is not None and len(self._stack) == call["depth"]:
                call["str_start"] = self._pos
        elif ch in "{[":
            self._stack.append(ch)
            if call is None and ch == "{" and self.kind == "list" and len(self._stack) == 2:
                self._open_call()
            elif call is not None and len(self._stack) == call["depth"] + 1 and call["key"] in ARGUMENT_KEYS \
                    and call["expect"] == "value":
                call["args_start"] = self._pos
        elif ch in "}]":
            if self._stack.pop() != _OPENER[ch]:
                self.broken = f"mismatched {ch!r} at character {self._pos}"
                return
            if call is None:
                return
            if len(self._stack) == call["depth"] and call.get("args_start") is not None:
                self._arguments_closed(out)
            elif len(self._stack) == call["depth"] - 1:
                self._call = None            # the call object closed
        elif call is not None and len(self._stack) == call["depth"]:
            if ch == ":":
                call["expect"] = "value"
            elif ch == ",":
                call["key"], call["expect"] = None, "key"

    def _between_values(self, ch: str) -> None:
        """Depth 0: before the first value only whitespace or a marker; after it, anything (the
        separators and closing tags between wrapped calls) until the next call opens."""
        if ch in "{[":
            if self.kind is None and self._lead.strip() and self._lead.strip() not in MARKERS:
                self.broken = f"the output starts with {self._lead.strip()[:40]!r}: not a call turn"
                return
            self.kind = self.kind or ("object" if ch == "{" else "list")
            self._stack.append(ch)
            if ch == "{" and self.kind == "object":
                self._open_call()
            return
        if self.kind is None:
            self._lead += ch
            lead = self._lead.lstrip()
            if lead and not any(m.startswith(lead) or lead.startswith(m) for m in MARKERS):
                self.broken = f"the output starts with {lead[:40]!r}: not a call turn"

    def _open_call(self) -> None:
        self._call = {"depth": len(self._stack), "index": self._count, "key": None, "expect": "key",
                      "name": None, "arguments": None, "reported": False}
        self._count += 1

    def _string_closed(self, out: list) -> None:
        call = self._call
        if call is None or len(self._stack) != call["depth"] or call.get("str_start") is None:
            return
        text = self._since(call["str_start"])
        call["str_start"] = None
        try:
            value = json.loads(text)
        except ValueError as e:
            self.broken = f"string {text[:40]!r} is not valid JSON ({e.msg})"
            return
        if call["expect"] == "key":
            call["key"] = value
        elif call["key"] == "name":
            call["name"] = value
            self._report(out)

    def _arguments_closed(self, out: list) -> None:
        call = self._call
        text = self._since(call.pop("args_start"))
        try:
            args = json.loads(text)
        except ValueError as e:
            self.broken = f"call {call['index']}: arguments {text[:40]!r} are not valid JSON ({e.msg})"
            return
        if isinstance(args, dict) and call["arguments"] is None:
            call["arguments"] = args
            self._report(out)

    def _report(self, out: list) -> None:
        call = self._call
        if call["reported"] or not isinstance(call["name"], str) or call["arguments"] is None:
            return
        call["reported"] = True
        self.closed_at[call["index"]] = self._pos + 1
        out.append((call["index"], {"name": call["name"], "arguments": call["arguments"]}))

    def _since(self, start: int) -> str:
        """The text from character `start` through the current one."""
        text = "".join(self._text)
        self._text = [text]
        return text[start:self._pos + 1]
