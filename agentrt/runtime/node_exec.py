"""Running one node: an LLM node on the backend, a tool node on the tool registry, a wait_for
node by waiting for its value (Runtime.provide_input).

Each returns an Outcome and never raises for the node's own failures (a bad prompt reference, an
engine error, output that is not JSON, a tool that raised or timed out); cancellation propagates.
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
from agentrt.runtime.node_state import NodeState, Outcome
from agentrt.runtime.policy import NodeContext, ProgramStats
from agentrt.runtime.store import args_hash
from agentrt.runtime.trace import new_id
from agentrt.runtime.values import OutputParseError, node_value
from agentrt.spec.report import SpecReport

if TYPE_CHECKING:
    from agentrt.runtime.program_state import ProgramState
    from agentrt.runtime.runtime import Runtime


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
def next_is_tool(ps: ProgramState, node: str, spec: LLMSpec) -> bool:
    """Whether a tool call follows this LLM call (so its KV could be held across the tool)."""
    graph = ps.run.graph
    return isinstance(spec.output, ToolCall) or any(graph.nodes[s]["kind"] == "tool" for s in graph.successors(node))


def is_continued(ps: ProgramState, node: str) -> bool:
    """Whether a later LLM call continues this call's conversation (LLMSpec.continues), so the
    messages it sent must be kept for that call to replay."""
    graph = ps.run.graph
    return any(getattr(graph.nodes[s]["spec"], "continues", None) == node for s in graph.successors(node))


def path_service(ps: ProgramState, node: str) -> tuple[float, int]:
    """LLM service (engine seconds, tokens) along the heaviest path of nodes leading into `node`
    (itself excluded); each maximised on its own."""
    graph, own_s, own_t = ps.run.graph, ps.stats.node_service_s, ps.stats.node_tokens
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


def spec_attributes(spec: SpecReport) -> dict[str, Any]:
    """The trace attributes of one LLM call's speculation: counts, α (split into grammar-forced
    and free drafts) and tokens per target pass, as the engine's report computes them."""
    t = spec.total
    return {
        "agentrt.spec.drafted": t.drafted, "agentrt.spec.accepted": t.accepted, "agentrt.spec.forced": t.forced,
        "agentrt.spec.target_passes": t.target_passes, "agentrt.spec.emitted": t.emitted,
        "agentrt.spec.alpha": t.alpha, "agentrt.spec.alpha_free": t.alpha_free,
        "agentrt.spec.alpha_forced": t.alpha_forced, "agentrt.spec.tokens_per_pass": t.tokens_per_pass,
        "agentrt.spec.by_drafter": sorted(spec.by_drafter),
    }


class LLMCall:
    """One LLM node's call on the backend: the request (priority from the policy, hints for the
    scheduler) and what follows it while it runs: each engine step moves the node's phases, is
    charged to the program and may re-prioritize the call; each piece of text becomes a run event
    and, for JSON outputs, final top-level members streamed to the nodes that wait on them."""

    def __init__(self, rt: Runtime, ps: ProgramState, ns: NodeState, spec: LLMSpec, response_format: dict[str, Any]):
        self.rt, self.ps, self.ns = rt, ps, ns
        self.follows_tool = next_is_tool(ps, ns.node, spec)
        self.ctx = NodeContext(ps.run_id, ns.node, ps.run.critical_path_length(ns.node), self.follows_tool,
                               *path_service(ps, ns.node))
        self.priority = rt.policy.priority(ps.stats, self.ctx) + ps.priority
        self.dynamic = getattr(rt.policy, "dynamic", False)
        self.members = JsonMembers() if response_format["type"] == "json_schema" and rt.stream_outputs else None
        # a call turn: each call's tool may start once its arguments close (stream_call)
        self.parallel = bool(response_format.get("parallel"))
        self.calls = StreamedCalls() if response_format["type"] == "tool_call" and rt.stream_outputs \
            and response_format.get("tool_choice") != "none" else None

    def request(self, spec: LLMSpec, messages: list[dict[str, Any]], response_format: dict[str, Any]) -> LLMRequest:
        rt, ps, ns = self.rt, self.ps, self.ns
        max_tokens = spec.max_tokens if rt.max_tokens is None else min(spec.max_tokens, rt.max_tokens)
        ns.attributes.update({
            "gen_ai.operation.name": "chat", "gen_ai.system": "agentrt", "gen_ai.request.model": rt.backend.model_name,
            "gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": spec.temperature,
            "gen_ai.output.type": "text" if response_format["type"] == "text" else "json",
            "agentrt.output_spec": spec.output.describe(), "agentrt.priority": self.priority,
            "agentrt.next_is_tool": self.follows_tool,
        })
        return LLMRequest(tuple(messages), response_format, max_tokens, spec.temperature,
                          NodeIdentity(ps.run_id, ps.program.name, ns.node), self.priority,
                          {"next_is_tool": self.follows_tool, "critical_path": self.ctx.critical_path,
                           # the call whose KV this one extends (remote engines route it to that KV)
                           **({"continues": spec.continues} if spec.continues else {})},
                          sampling=dict(spec.sampling))

    async def send(self, request: LLMRequest) -> LLMResponse:
        rt, ps, ns = self.rt, self.ps, self.ns
        ns.log.enter("queued", rt.trace.now())
        rt.emit(ps.run_id, "node_phase", node=ns.node, phase="queued")
        ps.stats.llm_calls += 1
        ps.stats.llm_in_flight += 1
        try:
            return await rt.backend.complete(request, on_step=self.on_step, on_start=self.on_start,
                                             on_text=self.on_text if self.members is not None or self.calls is not None
                                             or rt.watched else None)
        finally:
            ps.stats.llm_in_flight -= 1

    def on_start(self, handle: Any) -> None:
        self.ns.handle = handle
        self.ns.attributes["agentrt.engine.request_id"] = handle

    def on_step(self, ev: LLMStepEvent) -> None:
        rt, ps, ns = self.rt, self.ps, self.ns
        phase = ns.log.phase
        ns.on_llm_step(ev, rt.trace.at(ev.start))
        if rt.watched:
            if ns.log.phase != phase:
                rt.emit(ps.run_id, "node_phase", node=ns.node, phase=ns.log.phase)
            if not ev.preempted:
                rt.emit(ps.run_id, "step", node=ns.node, step=ev.step, start=round(rt.trace.at(ev.start), 6),
                        duration_s=round(ev.duration_s, 6), batch_size=ev.batch_size, num_new=ev.num_new,
                        k=ev.k, accepted=ev.accepted)
        charge(ps.stats, ns.node, ev)
        if self.dynamic and ns.handle is not None:
            new = rt.policy.priority(ps.stats, self.ctx) + ps.priority
            if new != self.priority:
                self.priority = new
                rt.backend.set_priority(ns.handle, new)
                ns.attributes["agentrt.priority.last"] = new

    def on_text(self, delta: str) -> None:
        self.rt.emit(self.ps.run_id, "token", node=self.ns.node, text=delta)
        if self.calls is not None:
            self.on_call_text(delta)
        if self.members is None:
            return
        final = self.members.feed(delta)
        if final and self.ps.run.status == "running":
            self.ps.run.stream(self.ns.node, final)
            self.rt.start_streamed(self.ps, self.ns.node)

    def on_call_text(self, delta: str) -> None:
        """A ToolCall node writes one call, or with parallel calls a list of them: once a call's
        arguments object closes, that call is known (ProgramRun.stream_call) and the tool taking
        it starts if idempotent, while the model writes the next calls."""
        attrs = self.ns.attributes
        for index, call in self.calls.feed(delta):
            if not self.parallel and (index != 0 or self.calls.kind != "object"):
                continue
            if self.ps.run.status == "running" and self.ps.run.stream_call(self.ns.node, call, index):
                closed = self.calls.closed_at[index]
                attrs.setdefault("agentrt.call_streamed_at_chars", closed)  # the first call's
                if self.parallel:
                    attrs.setdefault("agentrt.calls_streamed_at_chars", []).append(closed)
                self.rt.start_streamed(self.ps, self.ns.node)


def mark_early_calls(ps: ProgramState, llm_node: str, end: float) -> None:
    """The LLM node ended at `end`: each tool it started early (on a call or members it had
    streamed) gets how long before that end it started (agentrt.started_before_caller_end_s)."""
    if ps.nodes[llm_node].kind != "llm":
        return
    for ns in ps.nodes.values():
        if ns.waited_on == llm_node and ns.attributes.get("agentrt.started_early"):
            started = next((t for phase, t in ns.log.transitions if phase != "waiting"), end)
            ns.attributes["agentrt.started_before_caller_end_s"] = round(max(0.0, end - started), 6)


def record_response(rt: Runtime, ps: ProgramState, ns: NodeState, request: LLMRequest, response: LLMResponse) -> None:
    """Usage, α, and what the model was sent and wrote (within the runtime's TraceContent)."""
    content, prompt = rt.trace_content, response.prompt
    content.put(ns.attributes, "agentrt.prompt.messages", [dict(m) for m in (prompt.messages if prompt else request.messages)])
    if prompt is not None:
        if prompt.tools is not None:
            content.put(ns.attributes, "agentrt.prompt.tools", [dict(t) for t in prompt.tools])
        if prompt.text is not None:
            content.put(ns.attributes, "agentrt.prompt.text", prompt.text)
        ns.attributes["agentrt.prompt.parts"] = [dict(p) for p in prompt.parts]
    content.put(ns.attributes, "agentrt.output.text", response.text)
    ns.attributes.update({
        "gen_ai.usage.input_tokens": response.usage.input_tokens,
        "gen_ai.usage.output_tokens": response.usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": response.usage.cached_input_tokens,
        "gen_ai.response.finish_reasons": [response.finish_reason],
        **spec_attributes(response.spec),
    })
    ps.stats.cached_tokens += response.usage.cached_input_tokens


def response_outcome(rt: Runtime, ns: NodeState, response_format: dict[str, Any], response: LLMResponse) -> Outcome:
    """The node's value from the response, or why it failed."""
    if response.error is not None or response.finish_reason == "error":
        error = rt.trace_content.error(response.error) or "unknown error"
        return Outcome.failed(f"the engine failed: {error}", "engine_error")
    if response.finish_reason == "abort":  # not by us: cancelling the node task never gets here
        return Outcome.failed("the engine aborted the request", "aborted")
    try:
        value = node_value(response_format, response)
    except OutputParseError as e:
        hint = " (generation hit max_tokens)" if response.finish_reason == "length" else ""
        shown = str(e).split(":")[0] + ": [redacted]" if rt.trace_content.redact else str(e)
        return Outcome.failed(f"{shown}{hint}", "invalid_output")
    if isinstance(value, dict) and value.get("name") is not None and response_format["type"] == "tool_call":
        ns.attributes["agentrt.tool_call"] = value["name"]
    elif isinstance(value, dict) and value.get("calls"):
        ns.attributes["agentrt.tool_calls"] = [c.get("name") for c in value["calls"] if isinstance(c, dict)]
    rt.trace_content.put(ns.attributes, "agentrt.value", value)
    return Outcome(True, value)


async def run_recorded(rt: Runtime, ps: ProgramState, ns: NodeState) -> Outcome:
    """A resumed run's node whose outcome the store recorded: that outcome, without running it."""
    rec = ps.recorded.outcomes[ns.node]
    ns.attributes["agentrt.replayed"] = True
    if rec.sent is not None:
        ps.sent[ns.node] = rec.sent
    rt.emit(ps.run_id, "node_phase", node=ns.node, phase="replayed")
    return Outcome(True, rec.value) if rec.ok else Outcome.failed(rec.error or "failed", rec.error_type or "error")


def sampling_seed(rt: Runtime, ps: ProgramState, ns: NodeState, spec: LLMSpec) -> int | None:
    """With a store, a sampled LLM node draws with a seed it records, so that a resume that
    generates it again draws the same tokens; the seed it recorded when it was interrupted."""
    if rt.store is None or spec.temperature == 0:
        return None
    if ps.recorded is not None and ns.node in ps.recorded.seeds:
        return ps.recorded.seeds[ns.node]
    seed = dict(spec.sampling).get("seed")
    return int(seed) if seed is not None else random.getrandbits(62)


async def run_llm(rt: Runtime, ps: ProgramState, ns: NodeState) -> Outcome:
    """render the prompt -> send the call -> record usage and α -> keep what a later call replays
    and settle KV holds -> the value -> hold KV across the tool that follows."""
    spec: LLMSpec = ps.run.spec(ns.node)
    try:
        messages = render_prompt(spec, ps.run.values, ps.run.spec, ps.sent)
        response_format = spec.output.to_response_format()
    except (ProgramRunError, ValueError) as e:
        return Outcome.failed(str(e), "invalid_prompt")
    seed = sampling_seed(rt, ps, ns, spec)
    if rt.store is not None:
        rt.store.node_started(ps.run_id, ns.node, "llm", seed=seed)
    call = LLMCall(rt, ps, ns, spec, response_format)
    try:
        request = call.request(spec, messages, response_format)
        if seed is not None:
            request = replace(request, sampling={**request.sampling, "seed": seed})
        response = await call.send(request)
    except AgentRTError as e:
        return Outcome.failed(f"the engine rejected the request: {e}", "invalid_request")
    except Exception as e:  # noqa: BLE001 - a broken backend fails this node, not the process
        return Outcome.failed(f"the LLM backend raised {type(e).__name__}: {e}", type(e).__name__)
    record_response(rt, ps, ns, request, response)
    if is_continued(ps, ns.node):
        ps.sent[ns.node] = response.sent_messages or messages
    settle_holds(rt, ps, ns, response)
    outcome = response_outcome(rt, ns, response_format, response)
    outcome.sent = ps.sent.get(ns.node)
    if outcome.ok and call.follows_tool:
        hold_kv(rt, ps, ns, spec, outcome.value, response)
    return outcome


async def run_input(rt: Runtime, ps: ProgramState, ns: NodeState) -> Outcome:
    """A wait_for node: wait (nothing running) until Runtime.provide_input gives its value. Its
    span keeps the question, the schema, the value and who gave it, when and how."""
    spec: WaitForSpec = ps.run.spec(ns.node)
    try:
        prompt = spec.prompt.render(ps.run.values) if spec.prompt is not None else None
    except ProgramRunError as e:
        return Outcome.failed(f"cannot render the prompt: {e}", "invalid_prompt")
    schema = dict(spec.schema)
    ns.attributes["agentrt.input.schema"] = schema
    if prompt is not None:
        rt.trace_content.put(ns.attributes, "agentrt.input.prompt", prompt)
    future = asyncio.get_running_loop().create_future()
    ps.waiting[ns.node] = InputWait(schema, prompt, future)
    ns.log.enter("input_wait", rt.trace.now())
    ns.attributes["agentrt.input.asked_at"] = time.time()
    if rt.store is not None:
        rt.store.node_started(ps.run_id, ns.node, ns.kind)
    rt.emit(ps.run_id, "node_phase", node=ns.node, phase="input_wait")
    rt.emit(ps.run_id, "input_wanted", node=ns.node, schema=schema, prompt=prompt)
    try:
        answer: InputAnswer = await future
    finally:
        ps.waiting.pop(ns.node, None)
    ns.attributes.update({"agentrt.input.answered_at": answer.at, "agentrt.input.via": answer.via,
                          **({"agentrt.input.answered_by": answer.by} if answer.by is not None else {})})
    rt.trace_content.put(ns.attributes, "agentrt.value", answer.value)
    rt.emit(ps.run_id, "input_given", node=ns.node, by=answer.by, via=answer.via, at=answer.at)
    return Outcome(True, answer.value)


def interrupted_tool(rt: Runtime, ps: ProgramState, ns: NodeState, spec: ToolSpec) -> Outcome | None:
    """A resumed run's tool node that was running when the process stopped: it runs again only
    if the tool is idempotent; otherwise it may or may not have taken effect, and it fails."""
    if ps.recorded is None or ns.node not in ps.recorded.interrupted or rt.tools.get(spec.tool).idempotent:
        return None
    return Outcome.failed(f"tool '{spec.tool}' was running when the run was interrupted (the process stopped); "
                          "it may or may not have run, and it is not declared idempotent, so it is not run again",
                          "interrupted")


def attempt_log(rt: Runtime, attempts: Any) -> list[dict[str, Any]]:
    """Every attempt of a tool call as the trace keeps it: how it ended, how long it took, the
    wait after it, and for the last failed one why it was not tried again."""
    return [{"attempt": a.index, "ok": a.ok, "error_kind": a.error_kind, "error": rt.trace_content.error(a.error),
             "duration_s": round(a.duration_s, 6), "backoff_s": a.backoff_s, "not_retried": a.not_retried,
             "executor": a.executor, "worker": a.worker} for a in attempts]


async def run_tool(rt: Runtime, ps: ProgramState, ns: NodeState) -> Outcome:
    spec: ToolSpec = ps.run.spec(ns.node)
    trace = rt.trace
    if (stopped := interrupted_tool(rt, ps, ns, spec)) is not None:
        return stopped
    call_id = new_id()
    ns.attributes.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": spec.tool,
                          "gen_ai.tool.call.id": call_id})
    dispatched = trace.now()
    ns.log.enter("queued", dispatched)
    queued_at = len(ns.log.transitions) - 1
    try:
        args = tool_arguments(spec, ps.run.known)  # known: a tool started early reads streamed members
    except ProgramRunError as e:
        return Outcome.failed(str(e), "invalid_arguments")
    rt.trace_content.put(ns.attributes, "gen_ai.tool.call.arguments", args)
    digest = args_hash(args) if rt.store is not None else None
    if rt.store is not None:
        rt.store.node_started(ps.run_id, ns.node, "tool", args_hash=digest)
    ns.log.enter("tool_running", dispatched)
    rt.emit(ps.run_id, "node_phase", node=ns.node, phase="tool_running")
    ps.stats.tool_calls += 1
    ps.stats.tools_in_flight += 1

    def on_attempt(attempt: Any) -> None:
        error = rt.trace_content.error(attempt.error)
        if rt.store is not None:
            rt.store.tool_attempt(ps.run_id, ns.node, attempt.index, "finished" if attempt.ok else "failed",
                                  args_hash=digest, started=attempt.started, finished=attempt.finished,
                                  error_kind=attempt.error_kind, error=error, backoff_s=attempt.backoff_s,
                                  not_retried=attempt.not_retried)
        if not attempt.ok and attempt.not_retried is None:
            rt.emit(ps.run_id, "node_retried", node=ns.node, attempt=attempt.index, error_kind=attempt.error_kind,
                    error=error, duration_s=round(attempt.duration_s, 6), backoff_s=attempt.backoff_s)

    def on_progress(p: Any) -> None:  # an event of the running phase's span, the last one on the node
        shown = {"progress": p.progress, "total": p.total, "message": p.message}
        ns.log.event(trace.at_wall(p.time), {f"agentrt.tool.progress{'' if k == 'progress' else '_' + k}": v
                                             for k, v in shown.items() if v is not None})
        ns.attributes["agentrt.tool.progress"] = shown
        rt.emit(ps.run_id, "tool_progress", node=ns.node, **shown)

    try:
        result = await rt.tools.call(spec.tool, args, call_id=call_id, retry=spec.retry,
                                     on_attempt=on_attempt if rt.watched or rt.store is not None else None,
                                     on_progress=on_progress)
    finally:
        ps.stats.tools_in_flight -= 1
    ps.stats.tool_s += result.duration_s
    if rt.kv_hold is not None:
        rt.kv_hold.observe(spec.tool, result.duration_s)
    transitions: list[tuple[str, float]] = [("queued", dispatched)]
    for i, a in enumerate(result.attempts):
        last = i + 1 == len(result.attempts)
        if i:
            transitions.append(("tool_backoff", trace.at_wall(result.attempts[i - 1].finished)))
        phase = "tool_running" if a.ok else "tool_failed" if last else "tool_retried"
        transitions.append((phase, trace.at_wall(a.started)))
        if not a.ok:  # the failed attempt's phase span says why it failed
            ns.phase_notes.append((trace.at_wall(a.started), rt.trace_content.error(a.error), {
                "agentrt.tool.attempt": a.index, "error.type": a.error_kind,
                **({"agentrt.tool.backoff_s": a.backoff_s} if a.backoff_s is not None else {}),
                **({"agentrt.tool.not_retried": a.not_retried} if a.not_retried else {})}))
    ns.log.replace_from(queued_at, transitions)
    ns.attributes["agentrt.tool.attempts"] = len(result.attempts)
    ns.attributes["agentrt.tool.attempt_log"] = attempt_log(rt, result.attempts)
    if result.ok:
        rt.trace_content.put(ns.attributes, "gen_ai.tool.call.result", result.value)
        return Outcome(True, result.value)
    err = result.error
    ns.attributes["error.type"] = err.kind
    return Outcome.failed(err.message, err.kind)
