"""References to node outputs, prompt templates, and their evaluation against computed values.

A `Ref` names a node's output and optionally a part of it (dict keys, list indices). Builder
methods return Refs; templates name the same things with `{node.key[0]}` placeholders.
"""
from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from agentrt.errors import ProgramRunError

PathKey = str | int
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[([^\[\]]+)\]")


@dataclass(frozen=True)
class Ref:
    """The output of node `node`, or the part of it that `path` picks (dict keys, list indices).

    Builder methods return a Ref; index it to reach inside a structured output:

    >>> plan = Ref("plan")
    >>> plan["cities"][0]
    Ref('plan.cities[0]')
    >>> resolve(plan["cities"][0], {"plan": {"cities": ["Lyon", "Oslo"]}})
    'Lyon'
    """

    node: str
    path: tuple[PathKey, ...] = ()

    def __getitem__(self, key: PathKey) -> Ref:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"{self!s}: index a reference with a str key or an int index, not {key!r}")
        return Ref(self.node, self.path + (key,))

    def __iter__(self):
        # __getitem__ would otherwise make a Ref look iterable (and loop forever).
        raise TypeError(f"{self!s} is a reference to a node output, not a sequence; index it instead")

    def __format__(self, spec: str) -> str:
        # An f-string would bake the ref's name into the prompt as text: templates are the one way.
        raise TypeError(f"{self!s} used in an f-string or format(); write a template placeholder "
                        f"'{{{self!s}}}' in a plain string instead")

    def __str__(self) -> str:
        return self.node + path_text(self.path)

    def __repr__(self) -> str:
        return f"Ref({str(self)!r})"

    def renamed(self, rename: Callable[[str], str]) -> Ref:
        return Ref(rename(self.node), self.path)


def path_text(path: tuple[PathKey, ...]) -> str:
    return "".join(f".{k}" if isinstance(k, str) and _IDENT.fullmatch(k) else f"[{k}]" for k in path)


def parse_placeholder(field: str) -> Ref:
    """`plan.city[0]` -> Ref('plan', ('city', 0)); the node part is a name, resolved by compile()."""
    head = _IDENT.match(field)
    if head is None:
        raise ValueError(f"placeholder {{{field}}} must start with a node or input name")
    path: list[PathKey] = []
    pos = head.end()
    while pos < len(field):
        m = _SEGMENT.match(field, pos)
        if m is None:
            raise ValueError(f"placeholder {{{field}}}: cannot read '{field[pos:]}' (use .key or [index])")
        key = m.group(1) if m.group(1) is not None else m.group(2)
        path.append(int(key) if key.isdigit() else key)
        pos = m.end()
    return Ref(head.group(0), tuple(path))


def placeholders(text: str) -> list[Ref]:
    """The placeholders of a template, in order, as name-based Refs. Raises ValueError on bad syntax."""
    refs = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise ValueError(f"template syntax: {e} (write {{{{ and }}}} for literal braces)") from None
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if conversion or spec:
            raise ValueError(f"placeholder {{{field}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}}: conversions and format specs are not supported")
        if field == "" or field.isdigit():
            raise ValueError("positional placeholders like {} or {0} are not supported; name a node: {plan}")
        refs.append(parse_placeholder(field))
    return refs


@dataclass(frozen=True)
class Template:
    """Text with `{node}` / `{node.key[0]}` placeholders (str.format syntax, `{{` for a brace).

    Prompts are templates; wrap a tool argument in Template(...) to build a string from outputs.
    `refs` holds one resolved Ref per placeholder; compile() fills it in.

    >>> t = Template("Weather in {plan.city}: {weather}", refs=(Ref("plan", ("city",)), Ref("weather")))
    >>> t.render({"plan": {"city": "Oslo"}, "weather": {"temp_c": 3}})
    'Weather in Oslo: {"temp_c": 3}'
    """

    text: str
    refs: tuple[Ref, ...] | None = None

    def placeholders(self) -> list[Ref]:
        return placeholders(self.text)

    def render(self, values: Mapping[str, Any]) -> str:
        return self._render(values, stop_at_missing=False)[0]

    def render_known(self, values: Mapping[str, Any]) -> tuple[str, bool]:
        """The text up to the first placeholder whose node has no value yet, and whether the whole
        template rendered (a call's prompt start is known before all its inputs are).

        >>> Template("In {city}: {weather}", refs=(Ref("city"), Ref("weather"))).render_known({"city": "Oslo"})
        ('In Oslo: ', False)
        """
        return self._render(values, stop_at_missing=True)

    def _render(self, values: Mapping[str, Any], stop_at_missing: bool) -> tuple[str, bool]:
        if self.refs is None:
            raise ValueError(f"template {self.text!r} is not compiled: its placeholders are not resolved")
        out, refs = [], iter(self.refs)
        for literal, field, _, _ in string.Formatter().parse(self.text):
            out.append(literal)
            if field is not None:
                ref = next(refs)
                if stop_at_missing and ref.node not in values:
                    return "".join(out), False
                out.append(as_text(resolve(ref, values)))
        return "".join(out), True

    def renamed(self, rename: Callable[[str], str]) -> Template:
        if self.refs is None:
            return self
        return Template(self.text, tuple(r.renamed(rename) for r in self.refs))


def as_text(value: Any) -> str:
    """How a value appears in a prompt: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def resolve(ref: Ref, values: Mapping[str, Any]) -> Any:
    """The value `ref` points to, given computed node outputs keyed by node id.

    Raises ProgramRunError naming the referenced node when the value is missing or has no such part.

    >>> resolve(Ref("search", (1, "title")), {"search": [{"title": "a"}, {"title": "b"}]})
    'b'
    """
    if ref.node not in values:
        raise ProgramRunError(ref.node, f"has no value yet (needed for {ref!s})")
    value = values[ref.node]
    for depth, key in enumerate(ref.path):
        here = ref.node + path_text(ref.path[:depth])
        if isinstance(key, int):
            if not isinstance(value, list):
                raise ProgramRunError(ref.node, f"{here} is {type_name(value)}, not a list: cannot take [{key}]")
            if not -len(value) <= key < len(value):
                raise ProgramRunError(ref.node, f"{here} has {len(value)} items: no index [{key}]")
        elif not isinstance(value, dict):
            raise ProgramRunError(ref.node, f"{here} is {type_name(value)}, not an object: no key '{key}'")
        elif key not in value:
            raise ProgramRunError(ref.node, f"{here} has no key '{key}' (keys: {', '.join(map(str, value)) or 'none'})")
        value = value[key]
    return value


def type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)
