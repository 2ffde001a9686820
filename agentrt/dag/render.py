"""Pure evaluation of compiled node specs against computed outputs: chat messages for an LLM
node, the argument dict for a tool node. Errors name the node being prepared."""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from agentrt.dag.refs import Ref, Template, as_text, resolve, type_name
from agentrt.dag.specs import LLMSpec, ToolSpec, map_args
from agentrt.errors import ProgramRunError


def render_prompt(spec: LLMSpec, values: Mapping[str, Any], spec_of: Callable[[str], LLMSpec] | None = None,
                  sent: Mapping[str, Sequence[Mapping[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """OpenAI-style chat messages for an LLM node: system (if any), the user prompt, and for an
    agent-loop step the earlier tool calls and their results. A call that continues another
    starts with that call's messages, as `sent` recorded them (what the backend sent, format
    instructions included) or else rendered from spec_of(id), and its reply.

    >>> from agentrt.dag import Program
    >>> p = Program("demo", inputs={"city": str})
    >>> p.output(p.llm("tip", prompt="One tip for {city}", system="Be brief."))
    >>> render_prompt(p.compile().spec("tip"), {"city": "Oslo"})
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'One tip for Oslo'}]
    """
    try:
        if spec.continues:
            messages = _conversation(spec, values, spec_of, sent)
        else:
            messages = [{"role": "system", "content": spec.system.render(values)}] if spec.system else []
        messages.append({"role": "user", "content": spec.prompt.render(values)})
        messages += _history_messages(spec.history, values)
    except ProgramRunError as e:
        raise ProgramRunError(spec.id, f"cannot render the prompt: {e}") from e
    return messages


def _history_messages(history: Sequence[tuple[str, ...]], values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An agent-loop step's earlier tool calls and their results, as chat messages: per step, the
    assistant turn with its calls, then one tool message per call, in the order they were made."""
    messages = []
    for step, (llm_id, *tool_ids) in enumerate(history, 1):
        value = resolve(Ref(llm_id), values)
        calls = value["calls"] if "calls" in value else [value]  # a parallel step's value lists its calls
        ids = [f"call_{step}"] if len(tool_ids) == 1 and "calls" not in value else \
            [f"call_{step}_{i}" for i in range(1, len(tool_ids) + 1)]
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
            for call_id, call in zip(ids, calls)]})
        for call_id, call, tool_id in zip(ids, calls, tool_ids):
            messages.append({"role": "tool", "tool_call_id": call_id, "name": call["name"],
                             "content": as_text(resolve(Ref(tool_id), values))})
    return messages


def render_prompt_prefix(spec: LLMSpec, values: Mapping[str, Any], marker: str,
                         spec_of: Callable[[str], LLMSpec] | None = None,
                         sent: Mapping[str, Sequence[Mapping[str, Any]]] | None = None) -> list[dict[str, Any]] | None:
    """An LLM node's messages as far as `values` determine them, for a call that waits on inputs:
    render_prompt's messages up to the first value that is missing, the message it falls in cut
    there and ended with `marker` (where the unknown text would start). None: every value is
    known (render_prompt applies), or nothing before the first missing one is.

    >>> from agentrt.dag import Program
    >>> p = Program("demo", inputs={"city": str}, tools=[{"name": "weather", "parameters": {"type": "object"}}])
    >>> w = p.tool("w", "weather", args={})
    >>> p.output(p.llm("tip", prompt="Weather in {city}: {w}. One tip.", system="Be brief."))
    >>> render_prompt_prefix(p.compile().spec("tip"), {"city": "Oslo"}, "<?>")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Weather in Oslo: <?>'}]
    """
    try:
        if spec.continues:
            if spec.continues not in values:
                return None
            messages = _conversation(spec, values, spec_of, sent)
        elif spec.system:
            text, whole = spec.system.render_known(values)
            messages = [{"role": "system", "content": text if whole else text + marker}]
            if not whole:
                return messages
        else:
            messages = []
        text, whole = spec.prompt.render_known(values)
        messages.append({"role": "user", "content": text if whole else text + marker})
        if not whole:
            return messages
        known = 0
        while known < len(spec.history) and all(n in values for n in spec.history[known]):
            known += 1
        if known == len(spec.history):
            return None
        messages += _history_messages(spec.history[:known], values)
        messages.append({"role": "assistant", "content": marker})
        return messages
    except ProgramRunError:
        return None


def _conversation(spec: LLMSpec, values: Mapping[str, Any], spec_of: Callable[[str], LLMSpec] | None,
                  sent: Mapping[str, Sequence[Mapping[str, Any]]] | None) -> list[dict[str, Any]]:
    """The continued call's messages and its reply, as the model wrote it (JSON with the
    separators a JSON output is generated with, so the tokens match the cached ones)."""
    if sent is not None and spec.continues in sent:
        messages = [dict(m) for m in sent[spec.continues]]
    elif spec_of is not None:
        messages = render_prompt(spec_of(spec.continues), values, spec_of, sent)
    else:
        raise ProgramRunError(spec.id, f"continues {spec.continues}: rendering needs the program's node specs")
    messages.append({"role": "assistant", "content": as_text(resolve(Ref(spec.continues), values))})
    return messages


def tool_arguments(spec: ToolSpec, values: Mapping[str, Any]) -> dict[str, Any]:
    """The argument dict for a tool node: Refs resolved, Templates rendered, literals kept.

    >>> from agentrt.dag import Program
    >>> p = Program("demo", inputs={"city": str}, tools=[{"name": "get_weather", "parameters": {
    ...     "type": "object", "properties": {"city": {"type": "string"}, "units": {"type": "string"}}}}])
    >>> p.output(p.tool("weather", "get_weather", args={"city": p.input("city"), "units": "metric"}))
    >>> tool_arguments(p.compile().spec("weather"), {"city": "Oslo"})
    {'city': 'Oslo', 'units': 'metric'}
    """
    try:
        if spec.args_from_call:
            call = resolve(spec.args, values)
            if call.get("name") != spec.tool:
                got = "answered in text" if call.get("name") is None else f"called '{call['name']}'"
                raise ProgramRunError(spec.id, f"{spec.args!s} {got}, but this node runs '{spec.tool}'")
            return dict(call["arguments"])
        if isinstance(spec.args, Ref):
            args = resolve(spec.args, values)
            if not isinstance(args, dict):
                raise ProgramRunError(spec.id, f"args {spec.args!s} is {type_name(args)}, not an argument object")
            return dict(args)
        return map_args(spec.args, lambda v: v.render(values) if isinstance(v, Template) else resolve(v, values))
    except ProgramRunError as e:
        if e.node == spec.id:
            raise
        raise ProgramRunError(spec.id, f"cannot build the arguments: {e}") from e
