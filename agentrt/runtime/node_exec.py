"""Running one node: an LLM node on the backend, a tool node on the tool registry.

Both return an Outcome and never raise for the node's own failures (a bad prompt reference, an
engine error, output that is not JSON, a tool that raised or timed out); cancellation propagates.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrt.dag import render_prompt, tool_arguments
from agentrt.dag.outputs import ToolCall
from agentrt.dag.refs import as_text
from agentrt.dag.specs import LLMSpec, ToolSpec
from agentrt.errors import AgentRTError, ProgramRunError
from agentrt.runtime.backend import LLMRequest, LLMStepEvent, NodeIdentity
from agentrt.runtime.node_state import NodeState, Outcome
from agentrt.runtime.policy import NodeContext
from agentrt.runtime.trace import new_id
from agentrt.runtime.values import OutputParseError, node_value

if TYPE_CHECKING:
    from agentrt.runtime.runtime import ProgramState, Runtime


PREVIEW_CHARS = 300


def preview(value: Any) -> str:
    """A value as it would appear in a prompt, cut to PREVIEW_CHARS (for trace attributes)."""
    text = as_text(value)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def next_is_tool(ps: ProgramState, node: str, spec: LLMSpec) -> bool:
    """Whether a tool call follows this LLM call (so its KV could be held across the tool)."""
    graph = ps.run.graph
    return isinstance(spec.output, ToolCall) or any(graph.nodes[s]["kind"] == "tool" for s in graph.successors(node))


def spec_attributes(spec: dict[str, Any]) -> dict[str, Any]:
    """α of one LLM call, split into grammar-forced and free drafts, and tokens per target pass."""
    total = (spec or {}).get("total") or {}
    drafted, accepted, forced = int(total.get("drafted", 0)), int(total.get("accepted", 0)), int(total.get("forced", 0))
    passes, emitted = int(total.get("target_passes", 0)), int(total.get("emitted", 0))
    free_drafted, free_accepted = drafted - forced, accepted - forced
    return {
        "agentrt.spec.drafted": drafted, "agentrt.spec.accepted": accepted, "agentrt.spec.forced": forced,
        "agentrt.spec.target_passes": passes, "agentrt.spec.emitted": emitted,
        "agentrt.spec.alpha": accepted / drafted if drafted else None,
        "agentrt.spec.alpha_free": free_accepted / free_drafted if free_drafted > 0 else None,
        # the engine counts forced drafts among the accepted ones: their α is 1 by construction
        "agentrt.spec.alpha_forced": 1.0 if forced else None,
        "agentrt.spec.tokens_per_pass": emitted / passes if passes else None,
        "agentrt.spec.by_drafter": sorted((spec or {}).get("by_drafter", {})),
    }


async def run_llm(rt: Runtime, ps: ProgramState, ns: NodeState) -> Outcome:
    spec: LLMSpec = ps.run.spec(ns.node)
    trace = rt.trace
    try:
        messages = render_prompt(spec, ps.run.values)
        response_format = spec.output.to_response_format()
    except (ProgramRunError, ValueError) as e:
        return Outcome.failed(str(e), "invalid_prompt")
    follows_tool = next_is_tool(ps, ns.node, spec)
    ctx = NodeContext(ps.run_id, ns.node, ps.run.critical_path_length(ns.node), follows_tool)
    priority = rt.policy.priority(ps.stats, ctx)
    max_tokens = spec.max_tokens if rt.max_tokens is None else min(spec.max_tokens, rt.max_tokens)
    request = LLMRequest(tuple(messages), response_format, max_tokens, spec.temperature,
                         NodeIdentity(ps.run_id, ps.program.name, ns.node), priority,
                         {"next_is_tool": follows_tool, "critical_path": ctx.critical_path})
    ns.attributes.update({
        "gen_ai.operation.name": "chat", "gen_ai.system": "agentrt", "gen_ai.request.model": rt.backend.model_name,
        "gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": spec.temperature,
        "gen_ai.output.type": "text" if response_format["type"] == "text" else "json",
        "agentrt.output_spec": spec.output.describe(), "agentrt.priority": priority,
        "agentrt.next_is_tool": follows_tool,
    })

    def on_step(ev: LLMStepEvent) -> None:
        ns.on_llm_step(ev, trace.at(ev.start))
        if not ev.preempted:
            ps.stats.llm_tokens += ev.num_new + ev.k
            ps.stats.llm_service_s += ev.duration_s / max(1, ev.batch_size)

    def on_start(handle: Any) -> None:
        ns.handle = handle
        ns.attributes["agentrt.engine.request_id"] = handle

    ns.log.enter("queued", trace.now())
    ps.stats.llm_calls += 1
    ps.stats.llm_in_flight += 1
    try:
        response = await rt.backend.complete(request, on_step=on_step, on_start=on_start)
    except AgentRTError as e:
        return Outcome.failed(f"the engine rejected the request: {e}", "invalid_request")
    except Exception as e:  # noqa: BLE001 - a broken backend fails this node, not the process
        return Outcome.failed(f"the LLM backend raised {type(e).__name__}: {e}", type(e).__name__)
    finally:
        ps.stats.llm_in_flight -= 1
    ns.attributes.update({
        "gen_ai.usage.input_tokens": response.usage.input_tokens,
        "gen_ai.usage.output_tokens": response.usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": response.usage.cached_input_tokens,
        "gen_ai.response.finish_reasons": [response.finish_reason],
        **spec_attributes(dict(response.spec)),
    })
    if response.error is not None or response.finish_reason == "error":
        return Outcome.failed(f"the engine failed: {response.error or 'unknown error'}", "engine_error")
    if response.finish_reason == "abort":  # not by us: cancelling the node task never gets here
        return Outcome.failed("the engine aborted the request", "aborted")
    try:
        value = node_value(response_format, response)
    except OutputParseError as e:
        hint = " (generation hit max_tokens)" if response.finish_reason == "length" else ""
        return Outcome.failed(f"{e}{hint}", "invalid_output")
    if isinstance(value, dict) and value.get("name") is not None and response_format["type"] == "tool_call":
        ns.attributes["agentrt.tool_call"] = value["name"]
    ns.attributes["agentrt.value"] = preview(value)
    return Outcome(True, value)


async def run_tool(rt: Runtime, ps: ProgramState, ns: NodeState) -> Outcome:
    spec: ToolSpec = ps.run.spec(ns.node)
    trace = rt.trace
    call_id = new_id()
    ns.attributes.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": spec.tool,
                          "gen_ai.tool.call.id": call_id})
    dispatched = trace.now()
    ns.log.enter("queued", dispatched)
    queued_at = len(ns.log.transitions) - 1
    try:
        args = tool_arguments(spec, ps.run.values)
    except ProgramRunError as e:
        return Outcome.failed(str(e), "invalid_arguments")
    ns.attributes["gen_ai.tool.call.arguments"] = preview(args)
    ns.log.enter("tool_running", dispatched)
    ps.stats.tool_calls += 1
    ps.stats.tools_in_flight += 1
    try:
        result = await rt.tools.call(spec.tool, args, call_id=call_id)
    finally:
        ps.stats.tools_in_flight -= 1
    ps.stats.tool_s += result.duration_s
    transitions: list[tuple[str, float]] = [("queued", dispatched)]
    for i, a in enumerate(result.attempts):
        last = i + 1 == len(result.attempts)
        if i:
            transitions.append(("tool_backoff", trace.at_wall(result.attempts[i - 1].finished)))
        phase = "tool_running" if a.ok else "tool_failed" if last else "tool_retried"
        transitions.append((phase, trace.at_wall(a.started)))
    ns.log.replace_from(queued_at, transitions)
    ns.attributes["agentrt.tool.attempts"] = len(result.attempts)
    if result.ok:
        ns.attributes["gen_ai.tool.call.result"] = preview(result.value)
        return Outcome(True, result.value)
    err = result.error
    ns.attributes["error.type"] = err.kind
    return Outcome.failed(err.message, err.kind)
