"""Checks on JSON values from outside, shared by the engine (schemas) and the tool workers
(arguments): Python's recursive JSON tools (json, jsonschema, pydantic) hit the interpreter's
recursion limit on deeply nested input, so depth is measured first, without recursion."""
from __future__ import annotations

from typing import Any


def json_depth(value: Any, limit: int) -> int:
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
