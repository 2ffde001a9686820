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
        for step, (llm_id, tool_id) in enumerate(spec.history, 1):
            call, result = resolve(Ref(llm_id), values), resolve(Ref(tool_id), values)
            call_id = f"call_{step}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "name": call["name"],
                             "content": as_text(result)})
    except ProgramRunError as e:
        raise ProgramRunError(spec.id, f"cannot render the prompt: {e}") from e
    return messages


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
