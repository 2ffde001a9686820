"""Compile-time type checks: references into outputs whose shape is known (JSON schemas, Text,
tool output schemas), tool arguments against tool parameters, fan-out lists, branch enums.

Where a shape is unknown (a tool without output_schema, a schema without "type", a branch with
such a case) the check is skipped rather than guessed. A branch's shape is the union of its cases'
results, a constant's inferred from its value.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import replace
from typing import Any, Mapping

from agentrt.dag.outputs import ToolCall
from agentrt.dag.refs import Ref, Template, path_text
from agentrt.dag.specs import (AgentLoopSpec, BranchSpec, Constant, FanOutSpec, InputSpec, ItemSpec, LLMSpec,
                               NodeSpec, ToolSpec, WaitForSpec)
from agentrt.dag.tooldefs import ToolDef, value_problem

Problems = list[tuple[str, str]]


class Shapes:
    """Known output schemas of the nodes of one program (None where unknown)."""

    def __init__(self, specs: Mapping[str, NodeSpec], tools: Mapping[str, ToolDef]) -> None:
        self.specs = specs
        self.tools = tools
        self._cache: dict[str, Mapping[str, Any] | None] = {}
        self._busy: set[str] = set()

    def of_node(self, node: str) -> Mapping[str, Any] | None:
        if node in self._cache:
            return self._cache[node]
        if node in self._busy or node not in self.specs:  # a cycle (reported elsewhere) or unknown
            return None
        self._busy.add(node)
        spec = self.specs[node]
        if isinstance(spec, InputSpec):
            found = {"type": spec.type}
        elif isinstance(spec, LLMSpec):
            found = spec.output.value_schema()
        elif isinstance(spec, ToolSpec):
            found = self.tools[spec.tool].output_schema if spec.tool in self.tools else None
        elif isinstance(spec, WaitForSpec):
            found = spec.schema
        elif isinstance(spec, ItemSpec):
            over = self.at(spec.over)[0]
            found = over.get("items") if isinstance(over, Mapping) and isinstance(over.get("items"), Mapping) else None
        elif isinstance(spec, FanOutSpec):
            found = {"type": "array", "items": self.at(spec.result)[0] or {}}
        elif isinstance(spec, AgentLoopSpec):
            found = spec.value_schema()
        else:  # a branch: whichever case is taken
            found = union_schema([constant_schema(c.result.value) if isinstance(c.result, Constant)
                                  else self.at(c.result)[0] for c in spec.cases])
        self._busy.discard(node)
        self._cache[node] = found
        return found

    def at(self, ref: Ref) -> tuple[Mapping[str, Any] | None, str | None]:
        """(schema of the referenced part or None if unknown, why the reference cannot exist)."""
        schema = self.of_node(ref.node)
        for depth, key in enumerate(ref.path):
            if not isinstance(schema, Mapping):
                return None, None
            here = ref.node + path_text(ref.path[:depth])
            types = json_types(schema)
            if isinstance(key, int):
                if types is not None and "array" not in types:
                    return None, f"{here} is {' or '.join(sorted(types))}, not a list: no index [{key}]"
                items = schema.get("items")
                schema = items if isinstance(items, Mapping) else None
                continue
            if types is not None and "object" not in types:
                return None, f"{here} is {' or '.join(sorted(types))}, not an object: no key '{key}'"
            props = schema.get("properties")
            extra = schema.get("additionalProperties")
            if isinstance(props, Mapping) and key in props:
                schema = props[key]
            elif isinstance(extra, Mapping):
                schema = extra
            elif isinstance(props, Mapping) and extra is not True:
                names = ", ".join(props) or "none"
                return None, f"{here} has no property '{key}' in its schema (properties: {names})"
            else:
                schema = None
        return schema, None


def json_types(schema: Mapping[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return set(t)
    return None


def json_type(value: Any) -> str:
    """The JSON type name of a scalar (bool before int: true is not 1)."""
    for py, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, py):
            return name
    return "null"


def constant_schema(value: Any) -> dict[str, Any]:
    """The exact shape of a JSON value: scalars as a one-value enum, objects with every property.

    >>> constant_schema({"action": "none", "score": 0})["properties"]["action"]
    {'type': 'string', 'enum': ['none']}
    """
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: constant_schema(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, (list, tuple)):
        items = union_schema([constant_schema(v) for v in value]) if value else None
        return {"type": "array", **({"items": items} if items else {})}
    return {"type": json_type(value), "enum": [value]}


def union_schema(schemas: list[Mapping[str, Any] | None]) -> Mapping[str, Any] | None:
    """A shape every one of `schemas` fits: the one schema if they agree, objects with each
    property any of them has, else their JSON types (and enums, if each has one). None if any is
    unknown or has no type: nothing is guessed.

    >>> union_schema([{"type": "string"}, {"type": "null", "enum": [None]}])
    {'type': ['null', 'string']}
    >>> union_schema([{"type": "string", "enum": ["low"]}, {"type": "string", "enum": ["high"]}])
    {'type': 'string', 'enum': ['low', 'high']}
    """
    distinct: list[Mapping[str, Any]] = []
    for s in schemas:
        if not isinstance(s, Mapping):
            return None
        if s not in distinct:
            distinct.append(s)
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    types = [json_types(s) for s in distinct]
    if any(t is None for t in types):
        return None
    union = sorted(set().union(*types))
    if union == ["object"] and all(isinstance(s.get("properties"), Mapping) for s in distinct):
        return _union_objects(distinct)
    merged: dict[str, Any] = {"type": union[0] if len(union) == 1 else union}
    if all(isinstance(s.get("enum"), list) for s in distinct):
        merged["enum"] = _unique([v for s in distinct for v in s["enum"]])
    return merged


def _union_objects(schemas: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Each property any schema has (its shape: the union over those that have it; {} if that is
    unknown), required where every schema requires it, open if any schema is (other properties
    shaped as the union of the schemas that shape them)."""
    names = list(dict.fromkeys(k for s in schemas for k in s["properties"]))
    properties = {k: union_schema([s["properties"][k] for s in schemas if k in s["properties"]]) or {} for k in names}
    required = [k for k in names if all(k in s.get("required", ()) for s in schemas)]
    merged: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    extras = [s.get("additionalProperties") for s in schemas]
    shaped = [e for e in extras if isinstance(e, Mapping)]
    if any(e is True for e in extras):
        merged["additionalProperties"] = True
    elif shaped:
        merged["additionalProperties"] = union_schema(shaped) or True
    return merged


def _unique(values: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for v in values:  # JSON semantics: true and 1 are different values
        if not any(isinstance(k, bool) == isinstance(v, bool) and k == v for k in kept):
            kept.append(v)
    return kept


def _disjoint(a: set[str], b: set[str]) -> bool:
    widen = lambda s: s | {"number"} if "integer" in s else s | ({"integer"} if "number" in s else set())
    return not (widen(a) & widen(b))


def check_types(specs: dict[str, NodeSpec], tools: Mapping[str, ToolDef], output_refs: list[Ref],
                problems: Problems) -> None:
    """Append type problems; marks tool specs whose args are a ToolCall output (args_from_call)."""
    shapes = Shapes(specs, tools)
    for node, spec in list(specs.items()):
        for use in spec.refs():
            if use.ref.path and use.ref.node in specs:
                why = shapes.at(use.ref)[1]
                if why:
                    problems.append((node, f"{use.where}: {use.ref!s} cannot exist: {why}"))
        if isinstance(spec, ToolSpec) and spec.tool in tools:
            specs[node] = _check_tool_args(spec, tools[spec.tool], specs, shapes, problems)
        elif isinstance(spec, FanOutSpec) and spec.over.node in specs:
            over = shapes.at(spec.over)[0]
            types = json_types(over) if isinstance(over, Mapping) else None
            if types is not None and "array" not in types:
                problems.append((node, f"over {spec.over!s} is {' or '.join(sorted(types))}, not a list"))
        elif isinstance(spec, BranchSpec) and spec.on.node in specs:
            _check_case_keys(spec, shapes, problems)
    for ref in output_refs:
        if ref.path and ref.node in specs:
            why = shapes.at(ref)[1]
            if why:
                problems.append((ref.node, f"program output {ref!s} cannot exist: {why}"))


def _check_tool_args(spec: ToolSpec, tool: ToolDef, specs: Mapping[str, NodeSpec], shapes: Shapes,
                     problems: Problems) -> ToolSpec:
    node = spec.id
    if isinstance(spec.args, Ref):
        source = specs.get(spec.args.node)
        parallel = isinstance(source, LLMSpec) and isinstance(source.output, ToolCall) and source.output.parallel
        if parallel and not spec.args.path:
            problems.append((node, f"args take {spec.args!s}, a ToolCall with parallel calls (a list of calls): "
                                   f"take one of them, args={spec.args!s}['calls'][i]"))
            return spec
        one_call = spec.args.path[:1] == ("calls",) and len(spec.args.path) == 2 and isinstance(spec.args.path[1], int) \
            if parallel else not spec.args.path
        if isinstance(source, LLMSpec) and isinstance(source.output, ToolCall) and one_call:
            if tool.name not in source.output.tools:
                problems.append((node, f"args take {spec.args!s}, a ToolCall for {list(source.output.tools)}, "
                                       f"which never calls '{tool.name}'"))
            return replace(spec, args_from_call=True)
        schema = shapes.at(spec.args)[0]
        types = json_types(schema) if isinstance(schema, Mapping) else None
        if types is not None and "object" not in types:
            problems.append((node, f"args {spec.args!s} is {' or '.join(sorted(types))}, not an argument object"))
        return spec
    params = tool.parameters
    props = params.get("properties") if isinstance(params.get("properties"), Mapping) else None
    if props is not None and params.get("additionalProperties") is not True:
        for name in spec.args:
            if name not in props:
                problems.append((node, f"args.{name}: tool '{tool.name}' has no parameter '{name}' "
                                       f"(parameters: {', '.join(props) or 'none'})"))
    for name in params.get("required", []):
        if name not in spec.args:
            problems.append((node, f"args: missing required parameter '{name}' of tool '{tool.name}'"))
    for name, value in spec.args.items():
        want = props.get(name) if props is not None else None
        if not isinstance(want, Mapping):
            continue
        problem = _arg_problem(value, want, shapes)
        if problem:
            problems.append((node, f"args.{name}: {problem} (tool '{tool.name}' expects {dict(want)})"))
    return spec


def _arg_problem(value: Any, want: Mapping[str, Any], shapes: Shapes) -> str | None:
    want_types = json_types(want)
    if isinstance(value, Ref):
        have = shapes.at(value)[0]
        have_types = json_types(have) if isinstance(have, Mapping) else None
        if want_types and have_types and _disjoint(have_types, want_types):
            return f"{value!s} is {' or '.join(sorted(have_types))}"
        return None
    if isinstance(value, Template):
        return None if not want_types or "string" in want_types else "a Template gives a string"
    if _has_refs(value):
        return None
    problem = value_problem(want, value)
    return f"literal {value!r} does not match {problem}" if problem else None


def _has_refs(value: Any) -> bool:
    if isinstance(value, (Ref, Template)):
        return True
    if isinstance(value, Mapping):
        return any(_has_refs(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_refs(v) for v in value)
    return False


def _check_case_keys(spec: BranchSpec, shapes: Shapes, problems: Problems) -> None:
    """Equality keys against what `on` can be (its enum, else its JSON types); a predicate can
    only be judged by running it. Without a default, the cases must cover every value `on` can
    take, when those are known (an enum, a boolean) and no predicate is among them."""
    schema = shapes.at(spec.on)[0]
    if not isinstance(schema, Mapping):
        return
    enum = schema.get("enum")
    types = json_types(schema)
    values = enum if isinstance(enum, list) else [True, False] if types == {"boolean"} else None
    left = _uncovered(spec, values)
    before = len(problems)
    for case in spec.cases:
        if not case.is_equality:
            continue
        if isinstance(enum, list):
            if not any(case.matches(v) for v in enum):
                close = difflib.get_close_matches(str(case.key), [v for v in left if isinstance(v, str)], n=1)
                hint = f"; did you mean {json.dumps(close[0])}, which no case takes?" if close else ""
                problems.append((spec.id, f"case {case.label} can never match: {spec.on!s} is one of {enum}{hint}"))
        elif types is not None and _disjoint({json_type(case.key)}, types):
            problems.append((spec.id, f"case {case.label} can never match: {spec.on!s} is "
                                      f"{' or '.join(sorted(types))}, never equal to {case.key!r}"))
    if left and len(problems) == before:  # else the key that can never match is most likely the value left
        taken = [v for v in values if v not in left]
        shown = " or ".join(json.dumps(v) for v in left)
        problems.append((spec.id, f"no case takes {spec.on!s} = {shown} (the cases take "
                                  f"{', '.join(json.dumps(v) for v in taken) or 'none'} of {json.dumps(values)}) and "
                                  f"there is no default, so a run where it is {shown} would fail here: add a case for "
                                  f"{'it' if len(left) == 1 else 'each'}, or give default= (a body, or a value such "
                                  f"as default=\"not handled\") for the values no case takes"))


def _uncovered(spec: BranchSpec, values: list[Any] | None) -> list[Any]:
    """The values of `on` no case takes, when they can be known: all its values are (an enum, a
    boolean), there is no default, and no case is a predicate (only running it could tell)."""
    if values is None or any(c.is_default or c.predicate is not None for c in spec.cases):
        return []
    return [v for v in values if not any(c.matches(v) for c in spec.cases)]
