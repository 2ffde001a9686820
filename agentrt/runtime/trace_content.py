"""What of a node's content a trace keeps: prompts, raw outputs, values, tool arguments, results.

Traces are for debugging a program, so by default they keep what each node was sent and what it
produced, as JSON values (not JSON text inside JSON). A value whose JSON is longer than
max_chars is kept as the start of that JSON text, marked cut; with redact, content is replaced by
its size, for traces that leave the machine (token counts, timings and α stay; error messages
too, less the raw output the engine's errors quote).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, MutableMapping

from agentrt.errors import RunConfigError

RAW_TEXT = "raw text:"  # how the engine's errors quote an output (engine.llm_engine._structured)
TRUNCATED_ATTR = "agentrt.content.truncated"
REDACTED_ATTR = "agentrt.content.redacted"


@dataclass(frozen=True)
class TraceContent:
    """max_chars: the longest JSON text kept per attribute; redact: keep sizes, not content."""

    max_chars: int = 32_000
    redact: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) or self.max_chars < 16:
            raise RunConfigError(f"TraceContent.max_chars must be an int >= 16, got {self.max_chars!r}")

    def put(self, attributes: MutableMapping[str, Any], name: str, value: Any) -> None:
        """attributes[name] = value, cut to max_chars or redacted; cut or redacted names are listed
        under TRUNCATED_ATTR / REDACTED_ATTR so a reader knows the value is not whole."""
        text = json.dumps(value, ensure_ascii=False, default=repr)
        if self.redact:
            attributes[name] = f"[redacted: {len(text)} characters of JSON]"
            _mark(attributes, REDACTED_ATTR, name)
        elif len(text) > self.max_chars:
            attributes[name] = text[: self.max_chars] + "…"
            _mark(attributes, TRUNCATED_ATTR, name)
        else:
            attributes[name] = json.loads(text)  # a copy: the trace keeps the value as it was then

    def error(self, message: str | None) -> str | None:
        """An error message as the trace keeps it: with redact, without the model's raw text the
        engine quotes in it (other error messages are kept as they are)."""
        if not self.redact or message is None or RAW_TEXT not in message:
            return message
        return message[: message.index(RAW_TEXT)] + RAW_TEXT + " [redacted]"


def _mark(attributes: MutableMapping[str, Any], key: str, name: str) -> None:
    names = attributes.setdefault(key, [])
    if name not in names:
        names.append(name)
