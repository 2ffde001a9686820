"""Asking a person at the terminal for the value a wait_for node waits for, one field at a time.

`agentrt run` on a terminal asks each property of an object schema in turn (a single question
for any other schema): yes/no for a boolean, text with its length limits, a numbered choice for
an enum, a number with its bounds. A default is shown and taken on an empty answer; an optional
field is skipped on an empty answer. Each answer is checked against its field's schema (and the
whole value against the whole schema at the end) and asked again when it does not fit. A field
this cannot ask simply (a nested object or array, a union of types, a reference) is typed as
JSON. Piped input (not a terminal) is read as one JSON value per line instead: read_json_line.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, Callable, Mapping, TextIO

import jsonschema
from rich.console import Console
from rich.text import Text

from agentrt.errors import InputValueError, RunConfigError
from agentrt.jsonutil import JsonDepthError, parse_json

LineReader = Callable[[str], str]  # prompt -> the line typed (no newline); EOFError when input ends
YES, NO = ("y", "yes", "true", "1"), ("n", "no", "false", "0")
EMPTY_STRING = '""'  # typed for a text field: the empty string (an empty answer means "no answer")


def console_reader(console: Console, stream: TextIO | None = None) -> LineReader:
    """Lines typed at the console (line editing through input()), or read from `stream`."""

    def read(prompt: str) -> str:
        if stream is None:
            return console.input(Text(prompt, style="bold"))
        console.print(Text(prompt, style="bold"), end="")
        line = stream.readline()
        if not line:
            raise EOFError
        console.print(Text(line.rstrip("\r\n")))  # as a terminal echoes it
        return line.rstrip("\r\n")

    return read


class BadAnswer(ValueError):
    """An answer that does not fit its field; the message says what would."""


@dataclass(frozen=True)
class Field:
    """One question: the field's name (None: the whole value), its schema, whether it must be
    answered."""

    name: str | None
    schema: Mapping[str, Any]
    required: bool = True

    @property
    def kind(self) -> str:
        """const | enum | boolean | string | integer | number | json."""
        s = self.schema
        if "const" in s:
            return "const"
        if isinstance(s.get("enum"), list) and s["enum"]:
            return "enum"
        types = self.types
        if len(types) == 1 and types[0] in ("boolean", "string", "integer", "number"):
            return types[0]
        return "json"

    @property
    def types(self) -> list[str]:
        t = self.schema.get("type")
        listed = t if isinstance(t, list) else [t] if isinstance(t, str) else []
        return [x for x in listed if x != "null"] if len(listed) == 2 and "null" in listed else listed

    @property
    def has_default(self) -> bool:
        return "default" in self.schema

    def hint(self) -> str:
        """What to type, e.g. "yes/no", "text, at most 300 characters", "a number from 0 to 1000"."""
        s, kind = self.schema, self.kind
        if kind == "boolean":
            parts = ["yes/no"]
        elif kind == "string":
            parts = ["text" + _length_words(s.get("minLength"), s.get("maxLength"), "character")]
            if "pattern" in s:
                parts.append(f"matching {s['pattern']}")
        elif kind in ("integer", "number"):
            parts = [("a whole number" if kind == "integer" else "a number") + _bound_words(s)]
        elif kind == "enum":
            parts = ["a number from the list, or the value itself"]
        else:
            what = "/".join(self.types) or "any value"
            parts = [f"JSON: {what}"]
        if self.has_default:
            parts.append(f"Enter for {_shown(s['default'])}")
        elif not self.required:
            parts.append("optional: Enter to skip")
        return ", ".join(parts)

    def parse(self, text: str) -> Any:
        """The typed text as this field's value; BadAnswer says why not."""
        kind, raw = self.kind, text.strip()
        if kind == "boolean":
            if raw.lower() in YES:
                return True
            if raw.lower() in NO:
                return False
            raise BadAnswer("answer yes or no")
        if kind == "string":
            return "" if raw == EMPTY_STRING else text
        if kind == "integer":
            try:
                return int(raw)
            except ValueError:
                raise BadAnswer(f"{raw!r} is not a whole number") from None
        if kind == "number":
            return _number(raw)
        if kind == "enum":
            return self._choice(raw)
        try:
            return parse_json(raw)
        except JsonDepthError as e:
            raise BadAnswer(f"the value is {e}") from None
        except ValueError as e:
            raise BadAnswer(f"not JSON ({e})") from None

    def _choice(self, raw: str) -> Any:
        options = self.schema["enum"]
        if raw.isdigit() and 1 <= int(raw) <= len(options):
            return options[int(raw) - 1]
        for option in options:
            if raw == (option if isinstance(option, str) else json.dumps(option)):
                return option
        raise BadAnswer(f"pick a number from 1 to {len(options)}")

    def check(self, value: Any) -> None:
        """BadAnswer when the value does not meet the field's own schema. A field schema that
        refers elsewhere ($ref) cannot be checked alone: the whole value is, at the end."""
        if '"$ref"' in json.dumps(self.schema):
            return
        problem = schema_problem(self.schema, value)
        if problem:
            raise BadAnswer(problem)


def schema_problem(schema: Mapping[str, Any], value: Any) -> str | None:
    """The first way `value` fails `schema` ("at note: 'xxx…' is too long"), or None."""
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if not errors:
        return None
    where = "/".join(str(p) for p in errors[0].absolute_path)
    return (f"at {where}: " if where else "") + errors[0].message


def ask_value(schema: Mapping[str, Any], read: LineReader, console: Console, *, node: str,
              question: str | None = None) -> Any:
    """Ask for a value meeting `schema`, field by field for an object with properties; the
    answer is whole and valid. EOFError when the input ends first."""
    console.print(Text.assemble((node, "bold"), ": ", question or "a value is wanted"))
    while True:
        fields = object_fields(schema)
        if fields is None:
            value = ask_field(Field(None, schema), read, console)
        else:
            value = {}
            for field in fields:
                answer = ask_field(field, read, console)
                if answer is not _SKIPPED:
                    value[field.name] = answer
        problem = schema_problem(schema, value)
        if problem is None:
            return value
        console.print(Text(f"the value as a whole does not fit: {problem}; once more", style="red"))


def object_fields(schema: Mapping[str, Any]) -> list[Field] | None:
    """The fields of an object schema with properties, in the schema's order; None for any
    other schema (asked as one value)."""
    props = schema.get("properties")
    if Field(None, schema).types != ["object"] or not isinstance(props, Mapping) or not props:
        return None
    required = set(schema.get("required") or ())
    return [Field(name, sub if isinstance(sub, Mapping) else {}, name in required) for name, sub in props.items()]


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"


_SKIPPED: Any = _Skipped()


def ask_field(field: Field, read: LineReader, console: Console) -> Any:
    """One field's answer (or _SKIPPED: an optional field left empty), asked until it fits."""
    s = field.schema
    label = field.name or "value"
    if field.kind == "const":
        console.print(Text(f"  {label}: {_shown(s['const'])} (fixed by the schema)", style="dim"))
        return s["const"]
    about = s.get("description") or s.get("title")
    if about:
        console.print(Text(f"  {label}: {about}", style="dim"))
    if field.kind == "enum":
        for i, option in enumerate(s["enum"], 1):
            console.print(Text(f"    {i}) {_shown(option)}"))
    while True:
        text = read(f"  {label} ({field.hint()}): ")
        if not text.strip():
            if field.has_default:
                return s["default"]
            if not field.required:
                return _SKIPPED
            console.print(Text(f"  {label} is required", style="red"))
            continue
        try:
            value = field.parse(text)
            field.check(value)
            return value
        except BadAnswer as e:
            console.print(Text(f"  {label}: {e}", style="red"))


def read_json_line(stream: TextIO) -> Any:
    """The next JSON value of piped input, one per line (blank lines skipped); EOFError when the
    input ends, ValueError for a line that is not JSON."""
    while True:
        line = stream.readline()
        if not line:
            raise EOFError
        if line.strip():
            return parse_json(line)  # ValueError (JsonDepthError past the JSON depth limit)


def _number(raw: str) -> int | float:
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        raise BadAnswer(f"{raw!r} is not a number") from None
    if not math.isfinite(value):
        raise BadAnswer(f"{raw!r} is not a finite number")
    return value


def _length_words(low: Any, high: Any, unit: str) -> str:
    if low and high is not None:
        return f", {low} to {high} {unit}s"
    if high is not None:
        return f", at most {high} {unit}{'s' if high != 1 else ''}"
    if low:
        return f", at least {low} {unit}{'s' if low != 1 else ''}"
    return ""


def _bound_words(s: Mapping[str, Any]) -> str:
    low, high = s.get("minimum"), s.get("maximum")
    parts = [f"from {_shown(low)} to {_shown(high)}"] if low is not None and high is not None else \
        [f"{sign} {_shown(s[key])}" for key, sign in (("minimum", "≥"), ("maximum", "≤")) if s.get(key) is not None]
    parts += [f"{sign} {_shown(s[key])}" for key, sign in (("exclusiveMinimum", ">"), ("exclusiveMaximum", "<"))
              if s.get(key) is not None]
    if s.get("multipleOf") is not None:
        parts.append(f"a multiple of {_shown(s['multipleOf'])}")
    return " " + ", ".join(parts) if parts else ""


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value if isinstance(value, str) else json.dumps(value)


def answer_inputs(runtime: Any, answers: Mapping[str, Any], console: Console, *, stdin: TextIO | None = None,
                  paused: Callable[[], AbstractAsyncContextManager[Any]] | None = None) -> Callable[[], None]:
    """Give wait_for nodes their values as they ask (`agentrt run`): from --answer; else, on a
    terminal, asked field by field (ask_value, with the live display `paused`); else read from
    piped stdin, one JSON value per line. When the input ends first, the run is stopped, saying
    how to give the value. Returns the unsubscribe function."""
    stdin = stdin or sys.stdin
    typed = None if stdin is sys.stdin else stdin  # the real terminal is read with input(): line editing
    asking = asyncio.Lock()  # one question at a time: two waiting nodes would share the terminal

    def on_event(ev: Any) -> None:
        if ev.type != "input_wanted":
            return
        node = ev.data["node"]
        if node in answers:
            try:
                runtime.provide_input(ev.run_id, node, answers[node], via="--answer")
                return
            except InputValueError as e:  # the schema says no: asked instead
                console.print(Text(f"--answer {node}: {e}", style="red"))
        asyncio.get_running_loop().create_task(ask(ev.run_id, node, ev.data))

    async def ask(run_id: str, node: str, data: Mapping[str, Any]) -> None:
        async with asking:
            try:
                if stdin.isatty():
                    async with (paused or nullcontext)():
                        await asked_at_terminal(run_id, node, data, console_reader(console, typed))
                else:
                    await read_from_pipe(run_id, node, data)
            except EOFError:
                console.print(Text(f"node {node} waits for input (schema {json.dumps(data['schema'])}) and the input "
                                   f"ended; give it with --answer {node}=JSON, or serve the program (agentrt serve)",
                                   style="red"))
                runtime.interrupt(run_id)

    async def asked_at_terminal(run_id: str, node: str, data: Mapping[str, Any], read: LineReader) -> None:
        while True:
            value = await asyncio.to_thread(ask_value, data["schema"], read, console, node=node,
                                            question=data.get("prompt"))
            if given(run_id, node, value, "terminal"):
                return

    async def read_from_pipe(run_id: str, node: str, data: Mapping[str, Any]) -> None:
        console.print(Text.assemble((node, "bold"), f": {data.get('prompt') or 'a value is wanted'} (reading one JSON "
                                    f"value per line from stdin for {json.dumps(data['schema'])})"))
        while True:
            try:
                value = await asyncio.to_thread(read_json_line, stdin)
            except ValueError as e:
                console.print(Text(f"{node}: not JSON ({e})", style="red"))
                continue
            if given(run_id, node, value, "stdin"):
                return

    def given(run_id: str, node: str, value: Any, via: str) -> bool:
        """Whether the asking is over: the value was taken, or the node no longer waits."""
        try:
            runtime.provide_input(run_id, node, value, via=via)
        except InputValueError as e:  # the schema says no: the run keeps waiting, asked again
            console.print(Text(str(e), style="red"))
            return False
        except RunConfigError as e:  # the run ended (cancelled) while the person typed
            console.print(Text(str(e), style="red"))
        return True

    return runtime.subscribe_events(on_event)
