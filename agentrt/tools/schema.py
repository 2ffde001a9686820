"""Typed Python functions -> JSON schemas, and JSON-schema validation with errors that name the field.

The parameter schema is what the model sees (OpenAI tool format), so it is kept small: no
pydantic `title`s, `additionalProperties: false` unless the function takes **kwargs.
"""
from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, create_model
from pydantic.fields import FieldInfo

from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, json_depth, parse_json
from agentrt.tools.errors import PayloadTooLargeError, ToolArgumentsError, ToolDefinitionError

# Keys whose value maps names -> schemas (recurse into values, keep the keys).
_NAMED_SCHEMAS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
# Keys whose value is data, not a schema.
_DATA_KEYS = ("default", "enum", "const", "examples", "required")


@dataclass(frozen=True)
class FunctionSchema:
    """What `@tool` learns from a function's signature."""

    description: str
    parameters: dict[str, Any]
    args_model: type[BaseModel]
    output_schema: dict[str, Any] | None
    output_adapter: TypeAdapter | None
    positional_only: tuple[str, ...]
    var_keyword: bool


def strip_titles(schema: Any) -> Any:
    """Drop pydantic's auto-generated `title`s (they cost prompt tokens), keeping property names."""
    if isinstance(schema, list):
        return [strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: strip_titles(sub) for name, sub in value.items()}
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = strip_titles(value)
    return out


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """Description (text before an `Args:` section) and per-parameter descriptions (Google style)."""
    doc = inspect.getdoc(fn) or ""
    match = re.search(r"^\s*(Args|Arguments|Parameters):[ \t]*$", doc, flags=re.MULTILINE)
    if not match:
        return doc.strip(), {}
    description = doc[: match.start()].strip()
    params: dict[str, str] = {}
    current, indent = None, None
    for line in doc[match.end():].splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section (Returns:, Raises:) starts unindented
        indent = depth if indent is None else indent
        m = re.match(r"^\s+\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if m and depth == indent:
            current = m.group(1)
            params[current] = m.group(2).strip()
        elif current:
            params[current] = (params[current] + " " + line.strip()).strip()
    return description, params


def _field_for(name: str, param: inspect.Parameter, annotation: Any, doc: str | None) -> tuple[Any, Any]:
    default = ... if param.default is inspect.Parameter.empty else param.default
    has_description = typing.get_origin(annotation) is typing.Annotated and any(
        isinstance(m, FieldInfo) and m.description for m in typing.get_args(annotation)[1:]
    )
    if doc and not has_description:
        return annotation, Field(default, description=doc)
    return annotation, default


def function_schema(fn: Callable, *, name: str) -> FunctionSchema:
    """Build the parameter schema (pydantic over the signature), the validating args model and
    the output schema (from the return annotation, if any)."""
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except (TypeError, ValueError, NameError) as e:
        raise ToolDefinitionError(f"tool '{name}': cannot read the signature of {fn!r}: {e}") from e
    description, param_docs = _docstring_parts(fn)
    fields: dict[str, Any] = {}
    positional_only: list[str] = []
    var_keyword = False
    for pname, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ToolDefinitionError(f"tool '{name}': *{pname} is not supported (the model passes named arguments)")
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
            continue
        if pname.startswith("_") or pname in BaseModel.__dict__ or pname.startswith("model_"):
            raise ToolDefinitionError(f"tool '{name}': parameter name {pname!r} is reserved; rename it")
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            positional_only.append(pname)
        fields[pname] = _field_for(pname, param, hints.get(pname, Any), param_docs.get(pname))
    extra = "allow" if var_keyword else "forbid"
    try:
        model = create_model(f"{name}_arguments", __config__=ConfigDict(extra=extra), **fields)
        parameters = strip_titles(model.model_json_schema())
    except Exception as e:  # noqa: BLE001 - pydantic raises several types for unsupported annotations
        raise ToolDefinitionError(f"tool '{name}': cannot build a JSON schema from its signature: {e}") from e
    parameters.setdefault("properties", {})
    output_schema, adapter = None, None
    ret = hints.get("return", Any)
    if ret not in (Any, None, type(None)):
        try:
            adapter = TypeAdapter(ret)
            output_schema = strip_titles(adapter.json_schema(mode="serialization"))
        except Exception as e:  # noqa: BLE001
            raise ToolDefinitionError(f"tool '{name}': cannot build an output schema from return type {ret!r}: {e}") from e
    return FunctionSchema(
        description=description, parameters=parameters, args_model=model, output_schema=output_schema,
        output_adapter=adapter, positional_only=tuple(positional_only), var_keyword=var_keyword,
    )


def check_schema(schema: Any, *, tool: str, what: str) -> jsonschema.protocols.Validator:
    """A validator for `schema`, or ToolDefinitionError if the schema itself is not valid."""
    if not isinstance(schema, dict):
        raise ToolDefinitionError(f"tool '{tool}': {what} must be a JSON schema object, got {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ToolDefinitionError(f"tool '{tool}': {what} is not a valid JSON schema: {e.message}") from e
    return cls(schema)


def _field_path(err: jsonschema.ValidationError) -> str:
    path = ""
    for part in err.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if err.validator == "required":  # the missing property is in the message, not the path
        m = re.match(r"'([^']+)' is a required property", err.message)
        if m:
            path = f"{path}.{m.group(1)}" if path else m.group(1)
    if err.validator == "additionalProperties":
        m = re.search(r"\('([^']+)'", err.message)
        if m:
            path = f"{path}.{m.group(1)}" if path else m.group(1)
    return path


def describe_errors(errors: list[jsonschema.ValidationError], *, noun: str = "argument", limit: int = 5) -> str:
    """`argument 'a.b[0]': <what is wrong>; ...` for the first few errors."""
    errors = sorted(errors, key=lambda e: (list(map(str, e.absolute_path)), e.message))
    parts = []
    for err in errors[:limit]:
        field = _field_path(err)
        parts.append(f"{noun} {field!r}: {err.message}" if field else f"value: {err.message}")
    if len(errors) > limit:
        parts.append(f"... and {len(errors) - limit} more")
    return "; ".join(parts)


def validate_arguments(tool: str, validator: jsonschema.protocols.Validator, args: Any) -> None:
    """Raise ToolArgumentsError naming every bad field (up to a few) if `args` breaks the schema."""
    if not isinstance(args, dict):
        raise ToolArgumentsError(tool, f"tool '{tool}': arguments must be a JSON object, got {type(args).__name__}")
    errors = list(validator.iter_errors(args))
    if errors:
        raise ToolArgumentsError(tool, f"tool '{tool}': invalid arguments: {describe_errors(errors)}")


def parse_arguments(tool: str, args: Any) -> dict[str, Any]:
    """Arguments as the model wrote them (a JSON string) or already parsed."""
    if args is None:
        return {}
    if isinstance(args, (str, bytes)):
        try:
            args = parse_json(args) if args.strip() else {}
        except JsonDepthError as e:
            raise ToolArgumentsError(tool, f"tool '{tool}': arguments {e}") from None
        except ValueError as e:
            raise ToolArgumentsError(tool, f"tool '{tool}': arguments are not valid JSON: {e}") from e
    elif json_depth(args) > MAX_JSON_DEPTH:  # already parsed (a program's call): the size check recurses
        raise ToolArgumentsError(tool, f"tool '{tool}': arguments {JsonDepthError(MAX_JSON_DEPTH)}")
    if not isinstance(args, dict):
        raise ToolArgumentsError(tool, f"tool '{tool}': arguments must be a JSON object, got {type(args).__name__}")
    return args


def check_size(tool: str, what: str, payload: Any, limit: int | None) -> int:
    """JSON-encoded size of `payload`; PayloadTooLargeError if over `limit` bytes."""
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    if limit is not None and size > limit:
        raise PayloadTooLargeError(tool, f"tool '{tool}': {what} ({size} bytes) is over the limit of {limit} bytes")
    return size
