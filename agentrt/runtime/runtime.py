"""The runtime: runs many program runs concurrently against one LLM backend and one tool registry.

Each program run has a driver task. It starts every ready node as its own task (LLM nodes go to
the backend, tool nodes to the registry: async tools on the loop, sync ones on threads), and as
nodes end it reports them to the ProgramRun, which says what became ready. A node that fails
takes its fallback where the program declared one; otherwise the run ends with a ProgramRunError
naming the node and its other nodes in flight are cancelled. Nothing a node does raises out of
the runtime.

    rt = Runtime(EngineBackend(engine), tools=[get_weather, ...])
    result = await rt.run(program, {"request": "..."})      # RunResult
    rt.trace.write("runs/trip.jsonl")
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

import jsonschema

from agentrt.dag import CompiledProgram, Program
from agentrt.dag.specs import EXEC_KINDS
from agentrt.errors import InputValueError, ProgramRunError, RunConfigError
from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, json_depth
from agentrt.runtime.backend import LLMBackend, LLMRequest, LLMResponse, LLMStepEvent
from agentrt.runtime.events import RunEventListener
from agentrt.runtime.node_events import (GraphChanged, NodeEnv, NodeEvents, NodeFinished, NodeOutcome, NodeStarted,
                                         RunFinished, RunStarted, RunSubmitted)
from agentrt.runtime.node_exec import (InputAnswer, InputWait, charge, mark_early_calls, run_input, run_llm,
                                        run_recorded, run_tool)
from agentrt.runtime.node_state import NodeState, Outcome
from agentrt.runtime.prefill_ahead import cancel_prefill_ahead, start_prefill_ahead
from agentrt.runtime.policy import (KVHoldPolicy, LASPolicy, NodeContext, ProgramStats, SchedulingPolicy,
                                    policy_from_name)
from agentrt.runtime.run_state import (RunHandle, RunResult, RunState, loop_attributes, program_record,
                                       task_outcome)
from agentrt.runtime.store import NullRunStore, RecordedNodes, RunStore, StoreUnavailable
from agentrt.runtime.subscribers import LiveFeed, node_subscribers
from agentrt.runtime.trace import Trace, new_id
from agentrt.runtime.trace_content import REDACTED_ATTR, TraceContent
from agentrt.tools import Tool, ToolRegistry
from agentrt.tools.errors import UnknownToolError


def _registry(tools: ToolRegistry | Iterable[Tool | Any]) -> ToolRegistry:
    return tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)


class Runtime:
    """backend: where LLM nodes run. tools: a ToolRegistry or the Tool objects to register.
    policy: engine priorities, a SchedulingPolicy or its name ("las", the default, or "fcfs").
    kv_hold: when an LLM call ends in a tool call, pin its KV in the engine for the tools'
    expected latency (a KVHoldPolicy; True: the default one; False/None: never). Backends
    without `pin` ignore it. trace: where spans go (a new Trace by default). max_tokens: a cap
    on every LLM node's max_tokens. stream_outputs: while an LLM node still generates JSON, start
    the idempotent tools that read only members of it that are final already, and the fan-out
    branches over its items (see ProgramRun.stream). store: where runs are recorded durably
    (store.py): node outcomes as they end, tool attempts, the run's status; a run submitted with
    `resume=store.recorded(run_id)` takes recorded outcomes instead of running those nodes again.
    A store write that fails because the store is unavailable stops the run as `interrupt` does
    (its handle says `interrupted`): nothing after its last recorded write counts, and a resume
    goes on from there once the store is back.
    trace_content: what of each node's prompt, output, arguments and result the trace keeps
    (TraceContent: all of it up to a size by default, or only sizes with redact=True).
    prefill_ahead: while a program waits on a tool, let the engine compute the known start of the
    next call's prompt when it has nothing else to run (prefill_ahead.py; backends without it
    ignore it)."""

    def __init__(self, backend: LLMBackend, tools: ToolRegistry | Iterable[Tool | Any] = (), *,
                 policy: SchedulingPolicy | str | None = None, kv_hold: KVHoldPolicy | bool | None = True,
                 trace: Trace | None = None, max_tokens: int | None = None, stream_outputs: bool = True,
                 store: RunStore | None = None, trace_content: TraceContent | None = None,
                 prefill_ahead: bool = True) -> None:
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RunConfigError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self.backend = backend
        self.tools = _registry(tools)
        self.policy: SchedulingPolicy = policy_from_name(policy) if isinstance(policy, str) else policy or LASPolicy()
        self.kv_hold: KVHoldPolicy | None = KVHoldPolicy() if kv_hold is True else kv_hold or None
        self.trace = trace or Trace(meta={"model": backend.model_name, "policy": getattr(self.policy, "name", None)})
        self.max_tokens = max_tokens
        self.stream_outputs = stream_outputs
        self.store: RunStore = store if store is not None else NullRunStore()  # runs in memory only
        self.trace_content = trace_content or TraceContent()
        self.prefill_ahead = prefill_ahead
        self.runs: dict[str, RunState] = {}  # program runs in this runtime, by run id
        self.calls: dict[str, ProgramStats] = {}  # single LLM calls in flight (complete()), by call id
        self._unsubscribe = None
        # what happens in runs goes out as node events (node_events.py) to their subscribers
        self.live = LiveFeed(self.trace)
        subscribers = node_subscribers(self.store, self.trace_content,
                                       lambda run_id, node: self.runs[run_id].nodes[node].attributes, self.live)
        self.events = NodeEvents(subscribers, lambda: self.live.watched)
        self.env = NodeEnv(backend, self.tools, self.policy, self.kv_hold, self.trace, self.events,
                           self.trace_content, self.start_streamed, max_tokens, stream_outputs, prefill_ahead,
                           records_seeds=self.store.durable)  # a kept seed replays a sampled call

    # -- live events --
    def subscribe_events(self, fn: RunEventListener) -> Callable[[], None]:
        """Call fn(RunEvent) as runs go (see events.py); returns the unsubscribe function."""
        return self.live.listen(fn)

    @property
    def watched(self) -> bool:
        """Whether anyone listens to run events (token events are only built then)."""
        return self.live.watched

    # -- submitting --
    def submit(self, program: Program | CompiledProgram, inputs: Mapping[str, Any], *,
               run_id: str | None = None, priority: float = 0.0, resume: RecordedNodes | None = None,
               program_hash: str | None = None, metadata: Mapping[str, str] | None = None) -> RunHandle:
        """Start a run (needs a running event loop). Bad inputs raise ProgramRunError; a tool the
        program declares but the registry lacks raises RunConfigError, both before anything runs.
        priority: added to every engine priority the policy gives the run (smaller runs sooner).
        With a store: the run is recorded (a row the caller made for run_id is reused);
        program_hash identifies the program's source (default: a hash of its compiled form);
        resume continues a stored run from what it recorded."""
        compiled = program.compile() if isinstance(program, Program) else program
        if not isinstance(compiled, CompiledProgram):
            raise RunConfigError(f"expected a Program or CompiledProgram, got {type(program).__name__}")
        missing = [t for t in compiled.tools if t not in self.tools]
        if missing:
            have = ", ".join(self.tools.names()) or "none"
            raise RunConfigError(f"program '{compiled.name}' declares tool(s) {', '.join(missing)} with no "
                                 f"implementation in the runtime's tools (registered: {have})")
        run_id = run_id or f"{compiled.name}-{new_id(3)}"
        if run_id in self.runs:
            raise RunConfigError(f"run id '{run_id}' is already used in this runtime")
        run = compiled.start(inputs)
        now = self.trace.now()
        rs = RunState(run_id, new_id(16), compiled, run, ProgramStats(run_id, compiled.name, now), now,
                          priority=float(priority), recorded=resume)
        rs.stats.critical_path = run.critical_path_length()
        self.events.emit(RunSubmitted(run_id, compiled, dict(inputs), rs.priority, resume is not None, program_hash,
                                      metadata))
        self.runs[run_id] = rs
        self._subscribe_lane()
        rs.task = asyncio.get_running_loop().create_task(self._drive(rs, dict(inputs)), name=f"agentrt:{run_id}")
        return RunHandle(rs)

    def waiting_for(self, run_id: str) -> dict[str, InputWait]:
        """The wait_for nodes of a run that wait for their value now, by node id."""
        rs = self.runs.get(run_id)
        return dict(rs.waiting) if rs is not None else {}

    def provide_input(self, run_id: str, node: str, value: Any, *, by: str | None = None, via: str = "python") -> None:
        """Give a waiting wait_for node its value; the run goes on. `by`: who answered (a person
        or system, as the caller names them; kept in the trace), `via`: how the answer came (the
        server says "http", `agentrt run` "terminal" or "--answer"). Raises RunConfigError when
        the run is not waiting at that node, InputValueError when the value does not meet its
        schema (the run keeps waiting)."""
        rs = self.runs.get(run_id)
        wait = rs.waiting.get(node) if rs is not None else None
        if wait is None:
            waiting = ", ".join(sorted(rs.waiting)) if rs is not None and rs.waiting else "none"
            raise RunConfigError(f"run '{run_id}' is not waiting for input at node '{node}' "
                                 f"(nodes waiting for input: {waiting})")
        if json_depth(value) > MAX_JSON_DEPTH:  # the validator recurses per level
            raise InputValueError(f"input for node '{node}' is {JsonDepthError(MAX_JSON_DEPTH)}")
        errors = sorted(jsonschema.Draft202012Validator(wait.schema).iter_errors(value), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path)
            raise InputValueError(f"input for node '{node}'{' at ' + where if where else ''}: {errors[0].message}")
        if not wait.future.done():
            wait.future.set_result(InputAnswer(value, by, via, time.time()))

    def interrupt(self, run_id: str) -> None:
        """Stop a run without ending it in the store (a server shutting down): its nodes in flight
        are cancelled, and a later resume picks it up where the store says it was."""
        rs = self.runs.get(run_id)
        if rs is not None and rs.task is not None and not rs.task.done():
            rs.interrupted = True
            rs.task.cancel()

    async def run(self, program: Program | CompiledProgram, inputs: Mapping[str, Any], *,
                  run_id: str | None = None, resume: RecordedNodes | None = None,
                  program_hash: str | None = None, metadata: Mapping[str, str] | None = None) -> RunResult:
        """Submit and wait; cancelling the caller cancels the run."""
        handle = self.submit(program, inputs, run_id=run_id, resume=resume, program_hash=program_hash,
                             metadata=metadata)
        try:
            return await handle.wait()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def complete(self, request: LLMRequest, *, on_text: Callable[[str], None] | None = None,
                       on_step: Callable[[LLMStepEvent], None] | None = None,
                       on_logprobs: Callable[[list[dict[str, Any]]], None] | None = None) -> LLMResponse:
        """One LLM call outside any program (a served chat completion). To the scheduling policy it
        is a one-node program: its priority comes from the policy, and it is re-prioritized as it
        is served, so chat requests and program runs share the engine on the policy's terms.
        request.node.run_id names the call; request.priority is ignored. on_logprobs goes to
        backends that report token logprobs as they stream (EngineBackend)."""
        call_id = request.node.run_id
        if call_id in self.calls or call_id in self.runs:
            raise RunConfigError(f"call id '{call_id}' is already used in this runtime")
        stats = ProgramStats(call_id, request.node.program, self.trace.now(), critical_path=1.0, llm_calls=1)
        ctx = NodeContext(call_id, request.node.node, 1.0, False)
        priority = self.policy.priority(stats, ctx)
        dynamic = getattr(self.policy, "dynamic", False)
        handle: Any = None

        def started(h: Any) -> None:
            nonlocal handle
            handle = h

        def stepped(ev: LLMStepEvent) -> None:
            nonlocal priority
            charge(stats, request.node.node, ev)
            if dynamic and handle is not None:
                new = self.policy.priority(stats, ctx)
                if new != priority:
                    priority = new
                    self.backend.set_priority(handle, new)
            if on_step is not None:
                on_step(ev)

        self.calls[call_id] = stats
        stats.llm_in_flight = 1
        try:
            extra = {"on_logprobs": on_logprobs} if on_logprobs is not None else {}
            return await self.backend.complete(replace(request, priority=priority), on_step=stepped,
                                               on_start=started, on_text=on_text, **extra)
        finally:
            del self.calls[call_id]
            if self.trace.last_engine_step is not None:  # a server serving only chats keeps no lane for them
                self.trace.forget([], steps_before=self._oldest_in_flight())

    def release(self, run_id: str) -> list[dict[str, Any]]:
        """A finished run's trace records (Trace.run_records), after which the runtime forgets the
        run and the engine steps no run in flight still needs: a long-lived runtime (a server)
        keeps only what is going on."""
        rs = self.runs.get(run_id)
        if rs is None or rs.result is None:
            raise RunConfigError(f"run '{run_id}' is not a finished run of this runtime")
        records = self.trace.run_records(run_id)
        del self.runs[run_id]
        self.trace.forget([run_id], steps_before=self._oldest_in_flight())
        return records

    def _oldest_in_flight(self) -> float:
        """When the oldest run or call still here started (trace clock): engine steps that ended
        before it are in no trace still to be written."""
        return min([p.start for p in self.runs.values()] + [s.started for s in self.calls.values()],
                   default=self.trace.now())

    def run_snapshot(self, run_id: str) -> list[dict[str, Any]]:
        """A run's trace as it stands (what `agentrt inspect` reads): a finished run's whole trace;
        for one still going, the spans of the nodes that finished and a program record whose
        status is "running" or "waiting" and whose end is now. The nodes still running or
        waiting are not in it: the caller shows them from the live state."""
        rs = self.runs.get(run_id)
        if rs is None:
            raise RunConfigError(f"run '{run_id}' is not a run of this runtime")
        if rs.result is not None:
            return self.trace.run_records(run_id)
        spans = [span.to_record() for ns in list(rs.nodes.values()) if ns.finished
                 for span in ns.spans(rs.run_id, rs.trace_id)]
        program = {**program_record(rs, self.trace.now(), "waiting" if rs.waiting else "running"), "output": None}
        return self.trace.records_of(spans + [program])

    async def aclose(self) -> None:
        """Cancel runs still going, stop listening to the engine, close the trace."""
        tasks = [rs.task for rs in self.runs.values() if rs.task is not None and not rs.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self.trace.close()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def _subscribe_lane(self) -> None:
        if self._unsubscribe is None:
            self._unsubscribe = self.backend.subscribe_steps(self.trace.add_engine_step)

    # -- driving one run --
    async def _drive(self, rs: RunState, inputs: dict[str, Any]) -> RunResult:
        failed_node = error = None
        self.events.emit(RunStarted(rs.run_id, rs.program.name, inputs, rs.run))
        try:
            self._sync_nodes(rs)
            self._start_ready(rs, rs.run.ready(), cause=None)
            while rs.inflight and rs.run.status == "running":
                done = [await rs.ended.get()]
                while not rs.ended.empty():
                    done.append(rs.ended.get_nowait())
                for task in sorted((t for t in done if t in rs.inflight), key=lambda t: rs.inflight[t]):
                    node = rs.inflight.pop(task)
                    self._report(rs, node, task_outcome(task))
                    self._start_ready(rs, rs.run.ready(), cause=node)
                self._reprioritize()
            if rs.run.status == "running":  # nothing in flight, nothing ready: cannot happen in a valid DAG
                raise ProgramRunError(rs.program.name, "stalled: no node is ready or running")
            status = rs.run.status
        except ProgramRunError as e:
            status, failed_node, error = "failed", e.node, str(e)
        except asyncio.CancelledError:
            status, error = "cancelled", "the run was cancelled"
        except StoreUnavailable as e:  # what it did since its last write is not recorded: stop, resumable
            rs.interrupted = True
            status, error = "cancelled", f"stopped: {e}"
        finally:
            await self._cancel_inflight(rs)
        return self._finish(rs, status, failed_node, error, inputs)

    def _report(self, rs: RunState, node: str, outcome: Outcome) -> None:
        """Tell the ProgramRun how a node ended. Raises ProgramRunError when that ends the run
        (an output the node's spec rejects fails the node itself)."""
        ns = rs.nodes[node]
        now = self.trace.now()
        mark_early_calls(rs, node, now)
        self.events.emit(NodeOutcome(rs.run_id, node, ns.kind, outcome, bool(ns.attributes.get("agentrt.replayed"))))
        try:
            if outcome.ok:
                rs.run.complete(node, outcome.value)
            else:
                rs.run.fail(node, outcome.error or "failed")
        except ProgramRunError as e:
            ok = outcome.ok and e.node != node
            ns.finish("ok" if ok else "error", now, None if ok else outcome.error or e.reason)
            self._emit_finished(rs, ns, outcome.value if ok else None)
            raise
        finally:
            rs.stats.critical_path = rs.run.critical_path_length() if rs.run.status == "running" else 0.0
            ns.attributes.update(loop_attributes(rs.run, node))
        ns.finish("ok" if outcome.ok else "error", now, outcome.error)
        self._emit_finished(rs, ns, outcome.value)
        self._sync_nodes(rs)

    def _emit_finished(self, rs: RunState, ns: NodeState, value: Any) -> None:
        self.events.emit(NodeFinished(rs.run_id, ns.node, ns.kind, ns.status, value if ns.status == "ok" else None,
                                      ns.error, bool(ns.attributes.get("agentrt.replayed")),
                                      ns.attributes.get("gen_ai.tool.name"), ns.duration_s))

    def start_streamed(self, rs: RunState, llm_node: str) -> None:
        """Start what llm_node's streamed output made ready (tools reading its final members,
        fan-out branches over its items) while it is still generating."""
        self._sync_nodes(rs)
        self._start_ready(rs, rs.run.ready(), cause=llm_node)

    def _idempotent(self, rs: RunState, node: str) -> bool:
        try:
            return self.tools.get(rs.run.spec(node).tool).idempotent
        except UnknownToolError:  # it fails, naming the tool, when it runs after its input ends
            return False

    def _start_ready(self, rs: RunState, nodes: list[str], cause: str | None) -> None:
        for node in nodes:
            ns = rs.nodes[node]
            if rs.run.is_early(node):
                # ready on streamed members only (its LLM input still generates): only an
                # idempotent tool starts, since that LLM call may still fail
                if not self._idempotent(rs, node):
                    continue
                ns.attributes["agentrt.started_early"] = True
            rs.run.begin(node)
            cancel_prefill_ahead(rs, node)
            ns.status, ns.waited_on = "running", cause
            replayed = rs.recorded is not None and node in rs.recorded.outcomes
            tool = rs.run.spec(node).tool if ns.kind == "tool" else None
            self.events.emit(NodeStarted(rs.run_id, node, ns.kind, tool, bool(ns.attributes.get("agentrt.started_early")),
                                         replayed))
            if replayed:
                runner = run_recorded
            elif ns.kind == "llm":
                runner = run_llm
            else:
                runner = run_input if ns.kind == "wait_for" else run_tool
            task = asyncio.get_running_loop().create_task(runner(self.env, rs, ns),
                                                          name=f"agentrt:{rs.run_id}:{node}")
            rs.inflight[task] = node
            task.add_done_callback(rs.ended.put_nowait)
        start_prefill_ahead(self.env, rs)

    def _sync_nodes(self, rs: RunState) -> None:
        """Track the run's LLM, tool and wait_for nodes: new ones (fan-out branches, loop steps)
        start waiting now; those of a branch case not taken leave."""
        graph, now = rs.run.graph, self.trace.now()
        for node, attrs in graph.nodes(data=True):
            if attrs["kind"] in EXEC_KINDS and not attrs["template"] and node not in rs.nodes:
                spec = attrs["spec"]
                name = f"chat {self.backend.model_name}" if attrs["kind"] == "llm" else \
                    "await_input" if attrs["kind"] == "wait_for" else f"execute_tool {spec.tool}"
                rs.nodes[node] = NodeState(node, attrs["kind"], name, now)
        for node in [n for n in rs.nodes if n not in graph]:
            del rs.nodes[node]
        self.events.emit(GraphChanged(rs.run_id, rs.run))

    async def _cancel_inflight(self, rs: RunState) -> None:
        """Cancel the run's nodes in flight and wait for them; nodes that had ended but were not
        reported (the run failed first) keep their own outcome."""
        cancel_prefill_ahead(rs)
        now = self.trace.now()
        for task, node in rs.inflight.items():
            if task.done() and not task.cancelled():
                outcome = task_outcome(task)
                rs.nodes[node].finish("ok" if outcome.ok else "error", now, outcome.error)
            else:
                task.cancel()
        pending = [t for t in rs.inflight if not t.done()]
        while pending:
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError:  # cancelled again while cleaning up: finish cleaning up
                pass
            pending = [t for t in pending if not t.done()]
        rs.inflight.clear()

    def _finish(self, rs: RunState, status: str, failed_node: str | None, error: str | None,
                inputs: dict[str, Any]) -> RunResult:
        end = self.trace.now()
        for ns in rs.nodes.values():
            if not ns.finished:
                was_running = ns.status == "running"
                ns.finish("cancelled", end, "cancelled: the run " + ("failed" if status == "failed" else "was cancelled"))
                if was_running:
                    self._emit_finished(rs, ns, None)
            for span in ns.spans(rs.run_id, rs.trace_id):
                self.trace.add_span(span)
        output = rs.run.result if status == "done" else None
        node_errors = {n: ns.error for n, ns in rs.nodes.items() if ns.status == "error" and ns.error}
        rs.status = status
        rs.result = RunResult(rs.run_id, rs.program.name, status, output, error, failed_node, rs.start, end, node_errors,
                              dict(rs.run.values))
        record = program_record(rs, end, status, None if error is None else {"node": failed_node, "message": error})
        if self.trace_content.redact:  # the values whole otherwise: a server serves runs from them
            record.update(inputs={}, output=None, **{REDACTED_ATTR: ["inputs", "output"]})
        else:
            record.update(inputs=inputs, output=output)
        self.trace.add(record)
        self.events.emit(RunFinished(rs.run_id, status, output, error, failed_node, rs.interrupted))
        return rs.result

    def _reprioritize(self) -> None:
        running = [rs.stats for rs in self.runs.values() if rs.status == "running"]
        for run_id, priority in self.policy.reprioritize(running).items():
            rs = self.runs.get(run_id)
            if rs is None:
                continue
            for node in rs.inflight.values():
                ns = rs.nodes[node]
                if ns.kind == "llm" and ns.handle is not None:
                    self.backend.set_priority(ns.handle, priority + rs.priority)
