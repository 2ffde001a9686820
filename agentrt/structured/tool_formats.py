"""Tool-call formats of model families: how a family writes its calls, how the tools reach its
prompt, and the grammar that holds its output to that syntax.

A model calls tools best in the syntax it was trained on:

    house    {"name": T, "arguments": {...}}; parallel: a JSON list of them    (SmolLM2: the default)
    qwen     <tool_call>\\n{"name": T, "arguments": {...}}\\n</tool_call>, one block per call
             (Qwen2.5, Qwen3, Hermes-style templates); tools in <tools> by the chat template
    llama3   {"name": T, "parameters": {...}} after the assistant header; parallel: "; " between
             calls (Llama 3.1-3.3, JSON tool calling); tools rendered by the chat template
    gemma3   {"name": T, "parameters": {...}}; parallel: a JSON list (Gemma 3 has no tool tokens
             and no tools in its template: Google's documented JSON prompt goes in the system turn)
    mistral  [TOOL_CALLS][{"name": T, "arguments": {...}}, ...] (always a list)

The format is chosen from the chat template (the text it expects calls in) and the architecture
(detect_tool_format); EngineConfig.tool_format may force one. Calls are written with json.dumps'
default separators, as the templates' `tojson` writes the calls of earlier turns, so a call the
model made tokenizes alike when the conversation comes back. Parsing the output back (tolerant
of text before calls and of malformed JSON) lives in structured.tool_parse.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from agentrt.errors import RequestError

SEPARATORS = (", ", ": ")


def _dumps(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=None if indent else SEPARATORS)


def _literal(text: str) -> str:
    """An EBNF string literal (xgrammar takes JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's call syntax. The calls of one turn are written as
    `list_open + separator.join(call_prefix + {"name": T, <arguments_key>: {...}} + call_suffix) + list_close`,
    with list_open/list_close only for parallel calls unless always_list."""

    name: str
    arguments_key: str = "arguments"
    call_prefix: str = ""
    call_suffix: str = ""
    separator: str = ", "  # between the calls of one turn
    list_open: str = ""
    list_close: str = ""
    always_list: bool = False
    # markers that may open the calls after some text (a model writing unconstrained does that);
    # without one, calls are recognized only where the output starts with them
    markers: tuple[str, ...] = ()
    template_tools: bool = True  # the family's chat template renders the tools itself
    tool_results_as_user: bool = False  # the template has no tool role: results go in user turns
    single_call_turns: bool = False  # the template renders one call per assistant turn
    # what a text answer may start with although it starts like a call (Qwen3 thinks first:
    # "<think>" would otherwise be refused as the start of a <tool_call> where text is allowed)
    text_openers: tuple[str, ...] = ()

    def _listed(self, parallel: bool) -> bool:
        return self.always_list or parallel

    def calls_text(self, calls: list[dict[str, Any]], parallel: bool) -> str:
        """Calls ({"name", "arguments"}) as this format writes them (what the grammar allows)."""
        if not calls or (len(calls) > 1 and not parallel):
            raise ValueError(f"{self.name}: {len(calls)} calls in a turn that writes {'some' if parallel else 'one'}")
        body = self.separator.join(
            self.call_prefix + _dumps({"name": c["name"], self.arguments_key: c["arguments"]}) + self.call_suffix
            for c in calls)
        return (self.list_open + body + self.list_close) if self._listed(parallel) else body

    def first_chars(self, parallel: bool) -> str:
        """The characters a call turn can start with: a text answer must start otherwise."""
        starts = {(self.list_open if self._listed(p) else "") + self.call_prefix + "{" for p in {parallel, False}}
        return "".join(sorted({s[0] for s in starts}))

    def starts_call(self, text: str, parallel: bool) -> bool:
        """Whether an output (so far) starts like a call turn rather than a text answer."""
        stripped = text.lstrip()
        return stripped[:1] in tuple(self.first_chars(parallel)) and not stripped.startswith(self.text_openers)

    def grammar_ebnf(self, call_ebnf: str, parallel: bool) -> tuple[str, str]:
        """(EBNF, root rule name) of a call turn, from the EBNF of one call object (its root rule
        `root`, as xgrammar writes a JSON schema's grammar)."""
        one = " ".join([_literal(self.call_prefix)] * bool(self.call_prefix) + ["root"]
                       + [_literal(self.call_suffix)] * bool(self.call_suffix))
        rules = [f"agentrt_call ::= ({one})"]
        calls = f"agentrt_call ({_literal(self.separator)} agentrt_call)*" if parallel else "agentrt_call"
        if self._listed(parallel):
            calls = f"{_literal(self.list_open)} {calls} {_literal(self.list_close)}"
        rules.append(f"agentrt_calls ::= ({calls})")
        return call_ebnf + "\n" + "\n".join(rules) + "\n", "agentrt_calls"

    def instructions(self, tools: tuple, parallel: bool, offers_text: bool) -> str:
        """The prompt text that describes the tools and this syntax, for a chat template that does
        not render tools (Gemma 3's; or any, when the format is forced): each family's own words."""
        functions = [t["function"] for t in tools]
        if self.name == "qwen":
            listed = "\n".join(_dumps(t) for t in tools)
            text = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                    f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
                    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        elif self.name == "llama3":
            listed = "\n\n".join(_dumps(t, indent=4) for t in tools)
            text = ("Given the following functions, please respond with a JSON for a function call with its proper "
                    "arguments that best answers the given prompt.\n\nRespond in the format "
                    '{"name": function name, "parameters": dictionary of argument name and its value}.'
                    f"Do not use variables.\n\n{listed}")
            if parallel:
                text += "\n\nTo call several functions at once, separate the calls with '; '."
        elif self.name == "mistral":
            text = (f"[AVAILABLE_TOOLS]{_dumps(list(tools))}[/AVAILABLE_TOOLS]\nTo call tools, reply with "
                    '[TOOL_CALLS][{"name": <tool name>, "arguments": <arguments>}, ...].')
        else:  # gemma3: Google's documented JSON function-calling prompt
            text = ("You have access to functions. If you decide to invoke any of the function(s), you MUST put it "
                    'in the format of\n{"name": function name, "parameters": dictionary of argument name and its '
                    "value}\n\nYou SHOULD NOT include any other text in the response if you call a function\n"
                    + _dumps(functions, indent=2))
            if parallel:
                text += "\nTo call several functions at once, put the calls in a JSON list."
        if offers_text:
            text += "\nIf no tool is needed, reply in plain text instead."
        return text

    def history(self, messages: list[dict], template_renders_calls: bool) -> list[dict]:
        """The conversation as this family's chat template can render it: arguments of earlier
        calls as objects (templates apply `tojson` to them), calls written out as text where the
        template does not render `tool_calls`, one call per turn where it renders only one (Llama
        3), tool results as user turns where it has no tool role (Gemma 3), and call ids of the
        9 alphanumerics Mistral's template requires."""
        out: list[dict] = []
        for i, m in enumerate(messages):
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            if calls:
                calls = [self._plain_call(i, c) for c in calls]
                if not template_renders_calls:
                    plain = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
                    text = self.calls_text(plain, parallel=len(plain) > 1)
                    content = m.get("content") or ""
                    out.append({k: v for k, v in m.items() if k != "tool_calls"}
                               | {"content": f"{content}\n{text}" if content else text})
                elif self.single_call_turns and len(calls) > 1:
                    out += [dict(m, content=m.get("content") if j == 0 else "", tool_calls=[c])
                            for j, c in enumerate(calls)]
                else:
                    out.append(dict(m, tool_calls=calls))
            elif m.get("role") == "tool" and self.tool_results_as_user:
                block = f"```tool_output\n{m.get('content', '')}\n```"
                if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                    out[-1] = dict(out[-1], content=f"{out[-1]['content']}\n{block}")
                else:
                    out.append({"role": "user", "content": block, "_tool_results": True})
            elif m.get("role") == "user" and self.tool_results_as_user and out and out[-1].get("_tool_results"):
                # the turn after the results is one user turn with them (roles must alternate)
                out[-1] = {**m, "content": f"{out[-1]['content']}\n\n{m.get('content', '')}"}
            elif m.get("role") == "tool" and self.name == "mistral" and m.get("tool_call_id"):
                out.append(dict(m, tool_call_id=mistral_call_id(m["tool_call_id"])))
            else:
                out.append(m)
        return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]

    def _plain_call(self, i: int, call: dict) -> dict:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"messages[{i}].tool_calls: each call needs a function with a name, got {call!r}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise RequestError(f"messages[{i}].tool_calls: arguments of '{fn['name']}' are not JSON") from None
        out = dict(call, function=dict(fn, arguments=args))
        if self.name == "mistral" and isinstance(call.get("id"), str):
            out["id"] = mistral_call_id(call["id"])
        return out


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's template takes it (9 alphanumerics): kept when it is one, else
    derived from it (the same id always maps alike, so a call and its result still match)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha1(call_id.encode()).hexdigest()[:9]


HOUSE = ToolCallFormat("house", list_open="[", list_close="]", template_tools=True)
QWEN = ToolCallFormat("qwen", call_prefix="<tool_call>\n", call_suffix="\n</tool_call>", separator="\n",
                      markers=("<tool_call>",), text_openers=("<think>",))
LLAMA3 = ToolCallFormat("llama3", arguments_key="parameters", separator="; ", markers=("<|python_tag|>",),
                        single_call_turns=True)
GEMMA3 = ToolCallFormat("gemma3", arguments_key="parameters", list_open="[", list_close="]",
                        markers=("```tool_code", "```json"), template_tools=False, tool_results_as_user=True)
MISTRAL = ToolCallFormat("mistral", list_open="[TOOL_CALLS][", list_close="]", always_list=True,
                         markers=("[TOOL_CALLS]",))
FORMATS = {f.name: f for f in (HOUSE, QWEN, LLAMA3, GEMMA3, MISTRAL)}


def tool_format(name: str) -> ToolCallFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise RequestError(f"unknown tool-call format {name!r} (auto, {', '.join(FORMATS)})") from None


def detect_tool_format(chat_template: str | None, architecture: str | None = None) -> ToolCallFormat:
    """The format a model writes its calls in, from what its chat template renders calls as (the
    strongest evidence: it is what the model was trained on), else from its architecture. Chat
    templates that say nothing about tools (SmolLM2's ChatML) get the house format."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return QWEN
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<|start_header_id|>" in t and ("tools" in t or "<|python_tag|>" in t):
        return LLAMA3
    if "<start_of_turn>" in t or architecture == "gemma3":
        return GEMMA3
    if not t and architecture in ("qwen2", "qwen3"):
        return QWEN
    return HOUSE
