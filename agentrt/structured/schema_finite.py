"""Whether a JSON schema has finite instances everywhere a generation can go.

A schema such as {"$defs": {"n": {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}},
"required": ["child"]}}, "$ref": "#/$defs/n"} admits no finite JSON value: every object requires
another. Constrained decoding can never finish it, and the grammar's forced continuation from
"{" is infinite (xgrammar's jump-forward search then allocates until the process dies). The same
holds for such a part anywhere a generation may enter it (an optional property, one branch of an
anyOf), so every part reachable from the root must be finitely satisfiable.

Satisfiability is the least fixpoint over the schema's local $refs: a reference is satisfiable
once its target is, given what is known so far, starting from "none is". Keywords that only
narrow scalars (bounds, patterns, formats) are taken as satisfiable: the grammar compiler
reports those it cannot build.
"""
from __future__ import annotations

from typing import Any, Iterator

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties")  # $defs are reached through the $refs that use them


def resolve(schema: dict, ref: str) -> Any:
    """The part a local reference ('#', '#/$defs/x') names (the caller checked that it exists)."""
    node: Any = schema
    for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]:
        if isinstance(node, list) and not part.isdigit():
            raise KeyError(part)
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _satisfiable(node: Any, known: dict[str, bool]) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    if "$ref" in node and not known.get(node["$ref"], False):
        return False
    if "const" in node or "enum" in node:
        return bool(node.get("enum", [None]))
    if not all(_satisfiable(s, known) for s in node.get("allOf", [])):
        return False
    for key in ("anyOf", "oneOf"):
        if key in node and not any(_satisfiable(s, known) for s in node[key]):
            return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if types is not None and any(t not in ("object", "array") for t in types):
        return True  # a scalar branch always has a value
    checks = []
    if types is None or "object" in types:
        checks.append(_object_satisfiable(node, known))
    if types is None or "array" in types:
        checks.append(_array_satisfiable(node, known))
    return any(checks) if types is not None else all(checks)


def _object_satisfiable(node: dict, known: dict[str, bool]) -> bool:
    props = node.get("properties", {})
    for name in node.get("required", []):
        if name in props:
            if not _satisfiable(props[name], known):
                return False
        elif node.get("additionalProperties", True) is False:
            return False  # required yet not allowed
    return True


def _array_satisfiable(node: dict, known: dict[str, bool]) -> bool:
    need = node.get("minItems", 0)
    if not need:
        return True
    prefix = node.get("prefixItems", [])
    if not all(_satisfiable(s, known) for s in prefix[:need]):
        return False
    return need <= len(prefix) or _satisfiable(node.get("items", True), known)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _children(node: dict, path: str) -> Iterator[tuple[str, Any]]:
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items():
            yield f"{path}/{key}/{name}", sub
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []):
            yield f"{path}/{key}/{i}", sub
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield f"{path}/{key}", node[key]


def unfinishable_part(schema: dict) -> str | None:
    """The path of a part reachable from the root that no finite JSON value satisfies, or None.
    $refs must be local and resolvable (checked before)."""
    refs = set(_refs(schema))
    known = {r: False for r in refs}
    users: dict[str, set[str]] = {r: set() for r in refs}  # ref -> the refs whose target uses it
    for r in refs:
        for used in _refs(resolve(schema, r)):
            users[used].add(r)
    todo = list(refs)  # least fixpoint by worklist: a ref is looked at again only when one it uses flips
    while todo:
        r = todo.pop()
        if not known[r] and _satisfiable(resolve(schema, r), known):
            known[r] = True
            todo.extend(users[r])
    seen: set[str] = set()
    stack = [("(root)", schema)]
    while stack:
        path, node = stack.pop()
        if not _satisfiable(node, known):
            return path
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            seen.add(ref)
            stack.append((ref, resolve(schema, ref)))
        stack.extend(_children(node, "#" if path == "(root)" else path))
    return None
