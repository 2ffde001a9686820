"""JSON from outside (request bodies, program inputs, answers to waiting runs, tool arguments and
results, MQTT payloads, schemas): one depth limit and one parser that enforces it.

Python's JSON tools (json, jsonschema, pydantic) recurse once per level and hit the interpreter's
recursion limit (RecursionError, which is not a ValueError) on deeply nested input, so depth is
measured first, without recursion: in the text before it is parsed (`parse_json`), or in a value
that arrived already parsed (`json_depth`)."""
from __future__ import annotations

import json
import re
from typing import Any

# How deeply any JSON from outside may nest (a scalar is 0, [1] is 1). Legitimate documents rarely
# pass a dozen levels; the recursive validators behind them overflow past a few hundred.
MAX_JSON_DEPTH = 64

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # brackets inside strings do not nest
_NOT_BRACKET = re.compile(r"[^\[\]]+")
_OPENERS_AS_SQUARE = str.maketrans("{}", "[]")


class JsonDepthError(ValueError):
    """A JSON text or value nests deeper than the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"nested deeper than {limit} levels (the JSON depth limit)")
        self.limit = limit


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a JSON value (a scalar is 0), counted no further than limit + 1."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d + 1 > limit:
                return d + 1
            deepest = max(deepest, d + 1)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def text_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests deeper than limit: exact for valid JSON, and for invalid JSON
    at least as deep as json.loads gets before it fails. Runs at C speed: the brackets outside
    strings are kept, then innermost pairs are removed at most limit times."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text.translate(_OPENERS_AS_SQUARE)))
    for layers in range(limit + 1):  # each round removes the innermost layer of pairs
        if not brackets:
            return False
        reduced = brackets.replace("[]", "")
        if reduced == brackets:  # only unmatched brackets are left ("]][["): the parser descends
            return layers + brackets.count("[") > limit  # into the openers before it fails
        brackets = reduced
    return True


def parse_json(data: str | bytes | bytearray, limit: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for text from outside. Raises ValueError on anything it cannot take:
    json.JSONDecodeError, UnicodeDecodeError, or JsonDepthError past limit (never RecursionError)."""
    text = data if isinstance(data, str) else bytes(data).decode(json.detect_encoding(data), "surrogatepass")
    if text_depth_exceeds(text, limit):
        raise JsonDepthError(limit)
    return json.loads(text)
