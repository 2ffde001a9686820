"""Structured outputs: OpenAI-style response formats -> JSON schema, the prompt text that
describes them, and parsing/validating what the model produced.

Response formats (plain dicts, as agentrt.dag emits them):
    {"type": "text"}
    {"type": "json_object"}                                         any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    {"type": "tool_call", "tools": [openai tool dicts], "allow_text": bool}
    {"type": "tool_call", "tools": [...], "tool_choice": "none"}     tools described, text answer
    {"type": "tool_call", "tools": [...], "tool_choice": "required"} a call, never text
    {"type": "tool_call", "tools": [...], "tool_choice": {"type": "function", "function": {"name": T}}}
                                                                    a call of tool T, never text
    {"type": "tool_call", "tools": [...], "parallel": True}          a list of one or more calls
A tool call is emitted as {"name": "<tool>", "arguments": {...}}; with "parallel", as a JSON list
of them (OpenAI's parallel_tool_calls: several calls in one turn). JSON is written with
json.dumps' default separators (", " and ": "): the grammar emits exactly that format and the
prompt shows schemas and tools in it too, so values copied from the prompt tokenize alike.
A tool_choice (OpenAI's) narrows what the grammar allows, never what the prompt describes: all
the tools, and that text may answer, as for allow_text. So the steps of an agent loop, whichever
they allow, share their prompt's tokens (and KV). Without one, allow_text False describes a turn
that can only call.

`syntax` is the model family's tool-call format (structured.tool_formats): None is the house format
above; another wraps and names the same call object its own way (Qwen's <tool_call> blocks,
Llama 3's "parameters", ...), and its output is read back by structured.tool_parse, text around the
calls becoming content.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from agentrt.errors import RequestError
from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, json_depth, parse_json
from agentrt.structured.schema_finite import resolve, unfinishable_part
from agentrt.structured.tool_formats import ToolCallFormat
from agentrt.structured.tool_parse import parse_tool_calls

SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class OutputFormat:
    kind: str  # "text" | "json" | "tool_call"
    schema: dict | None = None  # the JSON schema the grammar enforces (None: any JSON / text)
    tools: tuple = ()  # openai tool dicts (tool_call)
    allow_text: bool = False
    # "none" (OpenAI's tool_choice): the prompt describes the tools as a tool_call turn does, but
    # the answer is text, which the grammar keeps from starting like a call (a small model shown
    # calls otherwise writes one as its answer). The last step of an agent loop answers so: its
    # prompt then starts with exactly the tokens of the steps before it, whose KV is cached.
    # "required": the prompt is that same one, the answer a call of a tool `schema` allows (all
    # the tools, or the one a named tool_choice picked): an agent loop's step that must call.
    tool_choice: str = "auto"
    parallel: bool = False  # tool_call: a list of calls
    syntax: ToolCallFormat | None = None  # tool_call: the family's call format (None: the house format)

    @property
    def json_start(self) -> str:
        """The character a constrained output starts with (text answers start otherwise)."""
        if self.syntax is not None:
            return self.syntax.first_chars(self.parallel)[0]
        return "[" if self.parallel else "{"

    def is_text_answer(self, text: str) -> bool:
        """Whether a tool_call output that allows text is the text answer, not a call."""
        if self.kind != "tool_call" or not self.allow_text:
            return False
        if self.syntax is not None:
            return not self.syntax.starts_call(text, self.parallel)
        return not text.lstrip().startswith(self.json_start)

    @property
    def offers_text(self) -> bool:
        """Whether the prompt says that text may answer: when the grammar allows it, and under any
        tool_choice, which narrows the grammar only (see the module docstring)."""
        return self.allow_text or self.tool_choice != "auto"

    @property
    def described(self) -> bool:
        """The prompt gets instructions (and, with a tools chat template, the tools)."""
        return self.kind != "text"

    @property
    def constrained(self) -> bool:
        """A grammar enforces the output (with tool_choice "none": text that does not start like a call)."""
        return self.kind != "text"

    def cache_key(self) -> str:
        key = [self.kind, self.schema, self.allow_text, self.parallel, self.tool_choice]
        if self.syntax is not None and self.kind == "tool_call":
            key.append(self.syntax.name)
        return json.dumps(key, sort_keys=True)


def _tool_function(t: Any) -> dict:
    if hasattr(t, "openai_schema"):
        t = t.openai_schema()
    if not isinstance(t, dict):
        raise RequestError(f"response_format.tools: expected OpenAI tool dicts, got {type(t).__name__}")
    fn = t.get("function", t)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"response_format.tools: a tool without a name: {t!r}")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    _check_schema(params, f"tool {fn['name']!r} parameters")
    return {"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}}


def _check_schema(schema: Any, what: str) -> None:
    if not isinstance(schema, dict):
        raise RequestError(f"{what}: a JSON schema must be an object, got {type(schema).__name__}")
    if json_depth(schema) > MAX_JSON_DEPTH:  # the validators recurse per level
        raise RequestError(f"{what}: the schema is {JsonDepthError(MAX_JSON_DEPTH)}")
    try:
        _validator(json.dumps(schema, sort_keys=True))
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise RequestError(f"{what}: invalid JSON schema at {path}: {e.message}") from None
    for path, ref in _refs(schema, ""):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise RequestError(f"{what}: $ref {ref!r} at {path or '(root)'} is not a local reference ('#/...'): "
                               "schemas must be self-contained, nothing is fetched")
        if not _resolves(schema, ref):
            raise RequestError(f"{what}: $ref {ref!r} at {path or '(root)'} names nothing in the schema")
    part = unfinishable_part(schema)
    if part is not None:
        raise RequestError(f"{what}: no finite JSON value satisfies {part}: nothing can be written there (an empty "
                           "enum, a false schema, a required property that is not allowed, or an object that always "
                           "requires another of its kind: make such recursion optional)")


def _refs(node: Any, path: str):
    """(JSON-pointer-ish path, value) of every "$ref" in a schema."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield path, value
            else:
                yield from _refs(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{path}/{i}")


def _resolves(schema: dict, ref: str) -> bool:
    """Whether a local reference ('#', '#/$defs/x') names a part of the schema."""
    try:
        resolve(schema, ref)
    except (KeyError, IndexError, ValueError, TypeError):
        return False
    return True


@functools.lru_cache(maxsize=512)
def _validator(schema_json: str) -> Any:
    """A checked validator per schema (by its canonical JSON): checking a schema against its
    meta-schema takes ~35 ms for a 10-tool call schema, validating a value with a built validator
    ~0.1 ms, and agents send the same schemas on every call. Invalid schemas raise SchemaError
    (and are not cached)."""
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def tool_call_schema(tools: tuple, parallel: bool = False, arguments_key: str = "arguments") -> dict:
    """One call of one of `tools`; with parallel, a list of one or more calls. `arguments_key`:
    what the family calls the arguments member (Llama 3 and Gemma 3: "parameters")."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, arguments_key: t["function"]["parameters"]},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    one = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def parse_response_format(rf: dict | None) -> OutputFormat:
    if rf is None:
        return OutputFormat("text")
    if not isinstance(rf, dict) or "type" not in rf:
        raise RequestError(f"response_format: expected a dict with a 'type', got {rf!r}")
    kind = rf["type"]
    if kind == "text":
        return OutputFormat("text")
    if kind == "json_object":
        return OutputFormat("json", {"type": "object"})
    if kind == "json_schema":
        spec = rf.get("json_schema", rf)
        if not isinstance(spec, dict):
            raise RequestError(f"response_format json_schema: expected an object with a 'schema', got "
                               f"{type(spec).__name__}")
        schema = spec.get("schema")
        name = spec.get("name")
        _check_schema(schema, f"response_format json_schema {name!r}" if name else "response_format json_schema")
        return OutputFormat("json", schema)
    if kind == "tool_call":
        tools = tuple(_tool_function(t) for t in rf.get("tools") or ())
        if not tools:
            raise RequestError("response_format tool_call: 'tools' is empty")
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise RequestError(f"response_format tool_call: duplicate tool names {names}")
        choice, callable_tools = _tool_choice(rf.get("tool_choice", "auto"), tools)
        parallel = bool(rf.get("parallel", False))
        allow_text = choice == "none" or (choice == "auto" and bool(rf.get("allow_text", False)))
        return OutputFormat("tool_call", tool_call_schema(callable_tools, parallel), tools, allow_text, choice, parallel)
    raise RequestError(f"response_format: unknown type {kind!r} (text, json_object, json_schema, tool_call)")


def with_syntax(fmt: OutputFormat, syntax: ToolCallFormat | None) -> OutputFormat:
    """The format with a model family's call syntax: its schema then describes one call object
    with the family's member names (the grammar puts the family's wrapper around it)."""
    if fmt.kind != "tool_call" or syntax is None or syntax.name == "house" or fmt.syntax is not None:
        return fmt
    one = fmt.schema["items"] if fmt.parallel else fmt.schema
    key = syntax.arguments_key
    renamed = [dict(v, properties={"name": v["properties"]["name"], key: v["properties"]["arguments"]},
                    required=["name", key]) for v in one.get("anyOf", [one])]
    return dataclasses.replace(fmt, schema=renamed[0] if len(renamed) == 1 else {"anyOf": renamed}, syntax=syntax)


def _tool_choice(choice: Any, tools: tuple) -> tuple[str, tuple]:
    """(the tool_choice as OutputFormat keeps it, the tools a call may name). A named choice
    ({"type": "function", "function": {"name": T}}) becomes "required" with T alone callable;
    every tool stays described."""
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return choice, tools
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError("response_format tool_call: tool_choice must be 'auto', 'none', 'required' or "
                           f"{{'type': 'function', 'function': {{'name': <tool>}}}}, got {choice!r}")
    named = tuple(t for t in tools if t["function"]["name"] == name)
    if not named:
        names = ", ".join(t["function"]["name"] for t in tools)
        raise RequestError(f"response_format tool_call: tool_choice names '{name}', which is not among the tools ({names})")
    return "required", named


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


def instructions(fmt: OutputFormat) -> str | None:
    """What the system message says about the format (None for text)."""
    if fmt.kind == "json":
        return "Reply with only a JSON object that matches this JSON schema:\n" + dumps(fmt.schema)
    if fmt.kind == "tool_call":
        lines = ["You can call these tools:"]
        lines += [dumps(t["function"]) for t in fmt.tools]
        if fmt.parallel:
            lines.append('To call tools, reply with only a JSON list of calls, one for each call needed: '
                         '[{"name": <tool name>, "arguments": <arguments>}].')
        else:
            lines.append('To call a tool, reply with only a JSON object: {"name": <tool name>, "arguments": <arguments>}.')
        if fmt.offers_text:
            lines.append("If no tool is needed, reply in plain text instead.")
        return "\n".join(lines)
    return None


def with_instructions(messages: list[dict], fmt: OutputFormat, template_has_tools: bool,
                      template_renders_calls: bool = False) -> tuple[list[dict], list[dict] | None]:
    """Messages (and the `tools` argument for the chat template) that describe the format.
    A chat template with a tools section gets the tools through it; otherwise the tools go
    into the system message as JSON. Once the conversation has a reply in it, the instructions
    join the last user turn instead: the earlier turns stay as they were sent, so their KV is
    reused (see LLMSpec.continues). With a family's syntax, earlier calls and tool results are
    first put the way its template renders them (ToolCallFormat.history), and a template
    without tools gets the family's own description of them."""
    syntax = fmt.syntax if fmt.kind == "tool_call" else None
    if syntax is not None:
        messages = syntax.history(messages, template_renders_calls)
        if syntax.template_tools and template_has_tools:
            return messages, list(fmt.tools)
        text = syntax.instructions(fmt.tools, fmt.parallel, fmt.offers_text)
    elif fmt.kind == "tool_call" and template_has_tools:
        return messages, list(fmt.tools)
    else:
        text = instructions(fmt)
    if text is None:
        return messages, None
    if messages[-1:] and messages[-1].get("role") == "user" and any(m.get("role") == "assistant" for m in messages):
        last = dict(messages[-1], content=f"{messages[-1].get('content', '')}\n\n{text}".lstrip())
        return list(messages[:-1]) + [last], None
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content', '')}\n\n{text}".lstrip())
        return [first] + list(messages[1:]), None
    return [{"role": "system", "content": text}] + list(messages), None


def parse_output(fmt: OutputFormat, text: str) -> Any:
    """The parsed value: JSON for json, {"name", "arguments"} for a tool call (None when the
    model chose to answer in text). Raises ValueError with the reason when invalid."""
    if not fmt.constrained:
        return None
    if fmt.kind == "tool_call" and fmt.syntax is not None:
        return _family_calls(fmt, text)
    stripped = text.strip()
    if fmt.is_text_answer(stripped):
        return None
    value = parse_json(stripped)
    if fmt.schema is not None:
        e = jsonschema.exceptions.best_match(_validator(json.dumps(fmt.schema, sort_keys=True)).iter_errors(value))
        if e is not None:  # the error jsonschema.validate would raise
            where = "/".join(str(p) for p in e.absolute_path) or "(root)"
            raise ValueError(f"schema violation at {where}: {e.message}")
    return value


def _family_calls(fmt: OutputFormat, text: str) -> Any:
    """The calls of a family-format output ({"name", "arguments"}; a list of them with parallel),
    None for a text answer. Calls that do not read as calls of the tools, or that break their
    schema, are text (structured.tool_parse); only a turn that had to call and did not is an error."""
    if fmt.tool_choice == "none":
        return None
    key = fmt.syntax.arguments_key
    names = [v["properties"]["name"]["const"] for v in fmt.schema.get("anyOf", [fmt.schema])]
    validator = _validator(json.dumps(fmt.schema, sort_keys=True))
    calls = [c for c in parse_tool_calls(fmt.syntax, text, names).calls
             if validator.is_valid({"name": c["name"], key: c["arguments"]})]
    if not calls:
        if not fmt.allow_text:
            raise ValueError(f"no valid call of {', '.join(names)} in the output")
        return None
    return calls if fmt.parallel else calls[0]
