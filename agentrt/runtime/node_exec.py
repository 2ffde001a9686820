"""Running one node: an LLM node on the backend, a tool node on the tool registry, a wait_for
node by waiting for its value (Runtime.provide_input).

Each runs in a NodeEnv (node_events.py: the backend, the tools, the policies, the clock, the
event emitter), returns an Outcome and never raises for the node's own failures (a bad prompt
reference, an engine error, output that is not JSON, a tool that raised or timed out);
cancellation propagates. What happens on the way is emitted as node events: the run store, the
trace's content and the live feed are their subscribers (subscribers.py), not written here.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from agentrt.dag import render_prompt, tool_arguments
from agentrt.dag.outputs import ToolCall
from agentrt.dag.partial_json import JsonMembers
from agentrt.dag.streamed_calls import StreamedCalls
from agentrt.dag.specs import LLMSpec, ToolSpec, WaitForSpec
from agentrt.errors import AgentRTError, ProgramRunError
from agentrt.runtime.backend import LLMRequest, LLMResponse, LLMStepEvent, NodeIdentity
from agentrt.runtime.kv_holds import hold_kv, settle_holds
from agentrt.runtime.node_events import (InputGiven, InputWanted, LLMResponded, NodeDispatched, NodeEnv, NodePhase,
                                         NodeStep, NodeTokens, NodeValue, ToolAttempted, ToolProgressed,
                                         ToolReturned)
from agentrt.runtime.node_state import NodeState, Outcome
from agentrt.runtime.policy import NodeContext, ProgramStats
from agentrt.runtime.trace import new_id
from agentrt.runtime.values import OutputParseError, node_value

if TYPE_CHECKING:
    from agentrt.runtime.run_state import RunState


@dataclass
class InputWait:
    """A wait_for node waiting: the schema its value must meet, the prompt, where its
    InputAnswer goes."""

    schema: dict[str, Any]
    prompt: str | None
    future: asyncio.Future


@dataclass(frozen=True)
class InputAnswer:
    """The value a wait_for node was given (valid against its schema), who gave it if they said
    (Runtime.provide_input's `by`), how it came (`via`) and when (unix seconds)."""

    value: Any
    by: str | None
    via: str
    at: float


def next_is_tool(rs: RunState, node: str, spec: LLMSpec) -> bool:
    """Whether a tool call follows this LLM call (so its KV could be held across the tool)."""
    graph = rs.run.graph
    return isinstance(spec.output, ToolCall) or any(graph.nodes[s]["kind"] == "tool" for s in graph.successors(node))


def is_continued(rs: RunState, node: str) -> bool:
    """Whether a later LLM call continues this call's conversation (LLMSpec.continues), so the
    messages it sent must be kept for that call to replay."""
    graph = rs.run.graph
    return any(getattr(graph.nodes[s]["spec"], "continues", None) == node for s in graph.successors(node))


def path_service(rs: RunState, node: str) -> tuple[float, int]:
    """LLM service (engine seconds, tokens) along the heaviest path of nodes leading into `node`
    (itself excluded); each maximised on its own."""
    graph, own_s, own_t = rs.run.graph, rs.stats.node_service_s, rs.stats.node_tokens
    memo: dict[str, tuple[float, int]] = {}

    def upto(n: str) -> tuple[float, int]:  # the heaviest path ending at n, n included
        if n not in memo:
            preds = [upto(p) for p in graph.predecessors(n)]
            memo[n] = (max((s for s, _ in preds), default=0.0) + own_s.get(n, 0.0),
                       max((t for _, t in preds), default=0) + own_t.get(n, 0))
        return memo[n]

    preds = [upto(p) for p in graph.predecessors(node)]
    return max((s for s, _ in preds), default=0.0), max((t for _, t in preds), default=0)


def charge(stats: ProgramStats, node: str, ev: LLMStepEvent) -> None:
    """Add one engine step to the service a program (and its node) attained: the tokens fed for
    it (prompt or context + drafts verified) and an even share of the step's time."""
    if ev.preempted:
        return
    share = ev.duration_s / max(1, ev.batch_size)
    stats.llm_tokens += ev.num_new + ev.k
    stats.llm_service_s += share
    stats.node_tokens[node] = stats.node_tokens.get(node, 0) + ev.num_new + ev.k
    stats.node_service_s[node] = stats.node_service_s.get(node, 0.0) + share


class LLMCall:
    """One LLM node's call on the backend: the request (priority from the policy, hints for the
    scheduler) and what follows it while it runs: each engine step moves the node's phases, is
    charged to the program and may re-prioritize the call; each piece of text becomes a node event
    and, for JSON outputs, final top-level members streamed to the nodes that wait on them."""

    def __init__(self, env: NodeEnv, rs: RunState, ns: NodeState, spec: LLMSpec, response_format: dict[str, Any]):
        self.env, self.rs, self.ns = env, rs, ns
        self.follows_tool = next_is_tool(rs, ns.node, spec)
        self.ctx = NodeContext(rs.run_id, ns.node, rs.run.critical_path_length(ns.node), self.follows_tool,
                               *path_service(rs, ns.node))
        self.priority = env.policy.priority(rs.stats, self.ctx) + rs.priority
        self.dynamic = getattr(env.policy, "dynamic", False)
        self.members = JsonMembers() if response_format["type"] == "json_schema" and env.stream_outputs else None
        # a call turn: each call's tool may start once its arguments close (stream_call)
        self.parallel = bool(response_format.get("parallel"))
        self.calls = StreamedCalls() if response_format["type"] == "tool_call" and env.stream_outputs \
            and response_format.get("tool_choice") != "none" else None

    def request(self, spec: LLMSpec, messages: list[dict[str, Any]], response_format: dict[str, Any]) -> LLMRequest:
        env, rs, ns = self.env, self.rs, self.ns
        max_tokens = spec.max_tokens if env.max_tokens is None else min(spec.max_tokens, env.max_tokens)
        ns.attributes.update({
            "gen_ai.operation.name": "chat", "gen_ai.system": "agentrt", "gen_ai.request.model": env.backend.model_name,
            "gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": spec.temperature,
            "gen_ai.output.type": "text" if response_format["type"] == "text" else "json",
            "agentrt.output_spec": spec.output.describe(), "agentrt.priority": self.priority,
            "agentrt.next_is_tool": self.follows_tool,
        })
        return LLMRequest(tuple(messages), response_format, max_tokens, spec.temperature,
                          NodeIdentity(rs.run_id, rs.program.name, ns.node), self.priority,
                          {"next_is_tool": self.follows_tool, "critical_path": self.ctx.critical_path,
                           # the call whose KV this one extends (remote engines route it to that KV)
                           **({"continues": spec.continues} if spec.continues else {})},
                          sampling=dict(spec.sampling))

    async def send(self, request: LLMRequest) -> LLMResponse:
        env, rs, ns = self.env, self.rs, self.ns
        ns.log.enter("queued", env.clock.now())
        env.events.emit(NodePhase(rs.run_id, ns.node, "queued"))
        rs.stats.llm_calls += 1
        rs.stats.llm_in_flight += 1
        try:
            return await env.backend.complete(request, on_step=self.on_step, on_start=self.on_start,
                                              on_text=self.on_text if self.members is not None
                                              or self.calls is not None or env.events.watched else None)
        finally:
            rs.stats.llm_in_flight -= 1

    def on_start(self, handle: Any) -> None:
        self.ns.handle = handle
        self.ns.attributes["agentrt.engine.request_id"] = handle

    def on_step(self, ev: LLMStepEvent) -> None:
        env, rs, ns = self.env, self.rs, self.ns
        phase = ns.log.phase
        ns.on_llm_step(ev, env.clock.at(ev.start))
        if ns.log.phase != phase:
            env.events.emit(NodePhase(rs.run_id, ns.node, ns.log.phase))
        env.events.emit(NodeStep(rs.run_id, ns.node, ev))
        charge(rs.stats, ns.node, ev)
        if self.dynamic and ns.handle is not None:
            new = env.policy.priority(rs.stats, self.ctx) + rs.priority
            if new != self.priority:
                self.priority = new
                env.backend.set_priority(ns.handle, new)
                ns.attributes["agentrt.priority.last"] = new

    def on_text(self, delta: str) -> None:
        self.env.events.emit(NodeTokens(self.rs.run_id, self.ns.node, delta))
        if self.calls is not None:
            self.on_call_text(delta)
        if self.members is None:
            return
        final = self.members.feed(delta)
        if final and self.rs.run.status == "running":
            self.rs.run.stream(self.ns.node, final)
            self.env.start_streamed(self.rs, self.ns.node)

    def on_call_text(self, delta: str) -> None:
        """A ToolCall node writes one call, or with parallel calls a list of them: once a call's
        arguments object closes, that call is known (ProgramRun.stream_call) and the tool taking
        it starts if idempotent, while the model writes the next calls."""
        attrs = self.ns.attributes
        for index, call in self.calls.feed(delta):
            if not self.parallel and (index != 0 or self.calls.kind != "object"):
                continue
            if self.rs.run.status == "running" and self.rs.run.stream_call(self.ns.node, call, index):
                closed = self.calls.closed_at[index]
                attrs.setdefault("agentrt.call_streamed_at_chars", closed)  # the first call's
                if self.parallel:
                    attrs.setdefault("agentrt.calls_streamed_at_chars", []).append(closed)
                self.env.start_streamed(self.rs, self.ns.node)


def mark_early_calls(rs: RunState, llm_node: str, end: float) -> None:
    """The LLM node ended at `end`: each tool it started early (on a call or members it had
    streamed) gets how long before that end it started (agentrt.started_before_caller_end_s)."""
    if rs.nodes[llm_node].kind != "llm":
        return
    for ns in rs.nodes.values():
        if ns.waited_on == llm_node and ns.attributes.get("agentrt.started_early"):
            started = next((t for phase, t in ns.log.transitions if phase != "waiting"), end)
            ns.attributes["agentrt.started_before_caller_end_s"] = round(max(0.0, end - started), 6)


def response_outcome(env: NodeEnv, rs: RunState, ns: NodeState, response_format: dict[str, Any],
                     response: LLMResponse) -> Outcome:
    """The node's value from the response, or why it failed (its error text within the content
    policy: a redacting one keeps the model's output out of it)."""
    if response.error is not None or response.finish_reason == "error":
        error = env.content.error(response.error) or "unknown error"
        return Outcome.failed(f"the engine failed: {error}", "engine_error")
    if response.finish_reason == "abort":  # not by us: cancelling the node task never gets here
        return Outcome.failed("the engine aborted the request", "aborted")
    try:
        value = node_value(response_format, response)
    except OutputParseError as e:
        hint = " (generation hit max_tokens)" if response.finish_reason == "length" else ""
        shown = str(e).split(":")[0] + ": [redacted]" if env.content.redact else str(e)
        return Outcome.failed(f"{shown}{hint}", "invalid_output")
    if isinstance(value, dict) and value.get("name") is not None and response_format["type"] == "tool_call":
        ns.attributes["agentrt.tool_call"] = value["name"]
    elif isinstance(value, dict) and value.get("calls"):
        ns.attributes["agentrt.tool_calls"] = [c.get("name") for c in value["calls"] if isinstance(c, dict)]
    env.events.emit(NodeValue(rs.run_id, ns.node, ns.kind, value))
    return Outcome(True, value)


async def run_recorded(env: NodeEnv, rs: RunState, ns: NodeState) -> Outcome:
    """A resumed run's node whose outcome the store recorded: that outcome, without running it."""
    rec = rs.recorded.outcomes[ns.node]
    ns.attributes["agentrt.replayed"] = True
    if rec.sent is not None:
        rs.sent[ns.node] = rec.sent
    env.events.emit(NodePhase(rs.run_id, ns.node, "replayed"))
    return Outcome(True, rec.value) if rec.ok else Outcome.failed(rec.error or "failed", rec.error_type or "error")


def sampling_seed(env: NodeEnv, rs: RunState, ns: NodeState, spec: LLMSpec) -> int | None:
    """With a store, a sampled LLM node draws with a seed it records, so that a resume that
    generates it again draws the same tokens; the seed it recorded when it was interrupted."""
    if not env.records_seeds or spec.temperature == 0:
        return None
    if rs.recorded is not None and ns.node in rs.recorded.seeds:
        return rs.recorded.seeds[ns.node]
    seed = dict(spec.sampling).get("seed")
    return int(seed) if seed is not None else random.getrandbits(62)


async def run_llm(env: NodeEnv, rs: RunState, ns: NodeState) -> Outcome:
    """render the prompt -> send the call -> record usage and α -> keep what a later call replays
    and settle KV holds -> the value -> hold KV across the tool that follows."""
    spec: LLMSpec = rs.run.spec(ns.node)
    try:
        messages = render_prompt(spec, rs.run.values, rs.run.spec, rs.sent)
        response_format = spec.output.to_response_format()
    except (ProgramRunError, ValueError) as e:
        return Outcome.failed(str(e), "invalid_prompt")
    seed = sampling_seed(env, rs, ns, spec)
    env.events.emit(NodeDispatched(rs.run_id, ns.node, "llm", seed=seed))
    call = LLMCall(env, rs, ns, spec, response_format)
    try:
        request = call.request(spec, messages, response_format)
        if seed is not None:
            request = replace(request, sampling={**request.sampling, "seed": seed})
        response = await call.send(request)
    except AgentRTError as e:
        return Outcome.failed(f"the engine rejected the request: {e}", "invalid_request")
    except Exception as e:  # noqa: BLE001 - a broken backend fails this node, not the process
        return Outcome.failed(f"the LLM backend raised {type(e).__name__}: {e}", type(e).__name__)
    env.events.emit(LLMResponded(rs.run_id, ns.node, request, response))
    rs.stats.cached_tokens += response.usage.cached_input_tokens
    if is_continued(rs, ns.node):
        rs.sent[ns.node] = response.sent_messages or messages
    settle_holds(env, rs, ns, response)
    outcome = response_outcome(env, rs, ns, response_format, response)
    outcome.sent = rs.sent.get(ns.node)
    if outcome.ok and call.follows_tool:
        hold_kv(env, rs, ns, spec, outcome.value, response)
    return outcome


async def run_input(env: NodeEnv, rs: RunState, ns: NodeState) -> Outcome:
    """A wait_for node: wait (nothing running) until Runtime.provide_input gives its value. Its
    span keeps the question, the schema, the value and who gave it, when and how."""
    spec: WaitForSpec = rs.run.spec(ns.node)
    try:
        prompt = spec.prompt.render(rs.run.values) if spec.prompt is not None else None
    except ProgramRunError as e:
        return Outcome.failed(f"cannot render the prompt: {e}", "invalid_prompt")
    schema = dict(spec.schema)
    ns.attributes["agentrt.input.schema"] = schema
    future = asyncio.get_running_loop().create_future()
    rs.waiting[ns.node] = InputWait(schema, prompt, future)
    ns.log.enter("input_wait", env.clock.now())
    ns.attributes["agentrt.input.asked_at"] = time.time()
    env.events.emit(NodeDispatched(rs.run_id, ns.node, ns.kind))
    env.events.emit(NodePhase(rs.run_id, ns.node, "input_wait"))
    env.events.emit(InputWanted(rs.run_id, ns.node, schema, prompt))
    try:
        answer: InputAnswer = await future
    finally:
        rs.waiting.pop(ns.node, None)
    ns.attributes.update({"agentrt.input.answered_at": answer.at, "agentrt.input.via": answer.via,
                          **({"agentrt.input.answered_by": answer.by} if answer.by is not None else {})})
    env.events.emit(NodeValue(rs.run_id, ns.node, ns.kind, answer.value))
    env.events.emit(InputGiven(rs.run_id, ns.node, answer.by, answer.via, answer.at))
    return Outcome(True, answer.value)


def interrupted_tool(env: NodeEnv, rs: RunState, ns: NodeState, spec: ToolSpec) -> Outcome | None:
    """A resumed run's tool node that was running when the process stopped: it runs again only
    if the tool is idempotent; otherwise it may or may not have taken effect, and it fails."""
    if rs.recorded is None or ns.node not in rs.recorded.interrupted or env.tools.get(spec.tool).idempotent:
        return None
    return Outcome.failed(f"tool '{spec.tool}' was running when the run was interrupted (the process stopped); "
                          "it may or may not have run, and it is not declared idempotent, so it is not run again",
                          "interrupted")


async def run_tool(env: NodeEnv, rs: RunState, ns: NodeState) -> Outcome:
    spec: ToolSpec = rs.run.spec(ns.node)
    clock, events = env.clock, env.events
    if (stopped := interrupted_tool(env, rs, ns, spec)) is not None:
        return stopped
    call_id = new_id()
    ns.attributes.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": spec.tool,
                          "gen_ai.tool.call.id": call_id})
    dispatched = clock.now()
    ns.log.enter("queued", dispatched)
    queued_at = len(ns.log.transitions) - 1
    try:
        args = tool_arguments(spec, rs.run.known)  # known: a tool started early reads streamed members
    except ProgramRunError as e:
        return Outcome.failed(str(e), "invalid_arguments")
    events.emit(NodeDispatched(rs.run_id, ns.node, "tool", args=args))
    ns.log.enter("tool_running", dispatched)
    events.emit(NodePhase(rs.run_id, ns.node, "tool_running"))
    rs.stats.tool_calls += 1
    rs.stats.tools_in_flight += 1

    def on_attempt(attempt: Any) -> None:
        events.emit(ToolAttempted(rs.run_id, ns.node, attempt, env.content.error(attempt.error), args))

    def on_progress(p: Any) -> None:  # an event of the running phase's span, the last one on the node
        shown = {"progress": p.progress, "total": p.total, "message": p.message}
        ns.log.event(clock.at_wall(p.time), {f"agentrt.tool.progress{'' if k == 'progress' else '_' + k}": v
                                             for k, v in shown.items() if v is not None})
        ns.attributes["agentrt.tool.progress"] = shown
        events.emit(ToolProgressed(rs.run_id, ns.node, p.progress, p.total, p.message))

    try:
        result = await env.tools.call(spec.tool, args, call_id=call_id, retry=spec.retry, on_attempt=on_attempt,
                                      on_progress=on_progress)
    finally:
        rs.stats.tools_in_flight -= 1
    rs.stats.tool_s += result.duration_s
    if env.kv_hold is not None:
        env.kv_hold.observe(spec.tool, result.duration_s)
    transitions: list[tuple[str, float]] = [("queued", dispatched)]
    for i, a in enumerate(result.attempts):
        last = i + 1 == len(result.attempts)
        if i:
            transitions.append(("tool_backoff", clock.at_wall(result.attempts[i - 1].finished)))
        phase = "tool_running" if a.ok else "tool_failed" if last else "tool_retried"
        transitions.append((phase, clock.at_wall(a.started)))
        if not a.ok:  # the failed attempt's phase span says why it failed
            ns.phase_notes.append((clock.at_wall(a.started), env.content.error(a.error), {
                "agentrt.tool.attempt": a.index, "error.type": a.error_kind,
                **({"agentrt.tool.backoff_s": a.backoff_s} if a.backoff_s is not None else {}),
                **({"agentrt.tool.not_retried": a.not_retried} if a.not_retried else {})}))
    ns.log.replace_from(queued_at, transitions)
    events.emit(ToolReturned(rs.run_id, ns.node, result))
    if result.ok:
        events.emit(NodeValue(rs.run_id, ns.node, ns.kind, result.value))
        return Outcome(True, result.value)
    err = result.error
    ns.attributes["error.type"] = err.kind
    return Outcome.failed(err.message, err.kind)
