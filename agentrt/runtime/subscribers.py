"""The subscribers of run and node events (node_events.py), one per concern, and the one place
they are registered (`node_subscribers`):

- TraceRecorder: what a node was sent and produced, onto its span's attributes (within the
  runtime's TraceContent), and a tool call's attempt log;
- StoreRecorder: the run store's rows (the run, each node's start and outcome, tool attempts),
  registered only for a durable store (a NullRunStore keeps nothing: nothing to hash or write);
- LiveFeed: the RunEvents live subscribers get (events.py: `Runtime.subscribe_events`).

A server adds its own after these (server/state.py: `server_subscribers`, the runtime never
importing the server): its run metrics (server/metrics.py: `RunMetrics`) and the OpenTelemetry
export of each ended run's spans (otel.py: `OtelExport`). The server's engine metrics follow
engine steps and LLM responses, which are not node events.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable, MutableMapping

from agentrt.dag.specs import EXEC_KINDS
from agentrt.runtime.events import RunEvent, RunEventListener
from agentrt.runtime.node_events import (Dispatching, GraphChanged, InputGiven, InputWanted, LLMResponded,
                                         NodeDispatched, NodeFinished, NodeOutcome, NodePhase, NodeStarted, NodeStep,
                                         NodeTokens, NodeValue, RunFinished, RunStarted, RunSubmitted, Subscriber,
                                         ToolAttempted, ToolProgressed, ToolReturned)
from agentrt.runtime.store_api import RunStore, StoredRun, args_hash
from agentrt.runtime.trace import Trace
from agentrt.runtime.trace_content import TraceContent
from agentrt.spec.report import SpecReport

Attributes = Callable[[str, str], MutableMapping[str, Any]]  # (run id, node) -> the node span's attributes


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


class TraceRecorder(Dispatching):
    """Node content onto the node's span attributes, cut or redacted as `content` says."""

    VALUE_ATTR = {"tool": "gen_ai.tool.call.result"}  # other kinds: agentrt.value

    def __init__(self, content: TraceContent, attributes: Attributes) -> None:
        self.content, self.attributes = content, attributes

    def responded(self, ev: LLMResponded) -> None:
        """Usage, α, and what the model was sent and wrote."""
        attrs, put, response, prompt = self.attributes(ev.run_id, ev.node), self.content.put, ev.response, \
            ev.response.prompt
        put(attrs, "agentrt.prompt.messages", [dict(m) for m in (prompt.messages if prompt else ev.request.messages)])
        if prompt is not None:
            if prompt.tools is not None:
                put(attrs, "agentrt.prompt.tools", [dict(t) for t in prompt.tools])
            if prompt.text is not None:
                put(attrs, "agentrt.prompt.text", prompt.text)
            attrs["agentrt.prompt.parts"] = [dict(p) for p in prompt.parts]
        put(attrs, "agentrt.output.text", response.text)
        attrs.update({
            "gen_ai.usage.input_tokens": response.usage.input_tokens,
            "gen_ai.usage.output_tokens": response.usage.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": response.usage.cached_input_tokens,
            "gen_ai.response.finish_reasons": [response.finish_reason],
            **spec_attributes(response.spec),
        })

    def dispatched(self, ev: NodeDispatched) -> None:
        if ev.args is not None:
            self.content.put(self.attributes(ev.run_id, ev.node), "gen_ai.tool.call.arguments", ev.args)

    def input_wanted(self, ev: InputWanted) -> None:
        if ev.prompt is not None:
            self.content.put(self.attributes(ev.run_id, ev.node), "agentrt.input.prompt", ev.prompt)

    def value(self, ev: NodeValue) -> None:
        self.content.put(self.attributes(ev.run_id, ev.node), self.VALUE_ATTR.get(ev.kind, "agentrt.value"), ev.value)

    def returned(self, ev: ToolReturned) -> None:
        """Every attempt of the tool call: how it ended, how long it took, the wait after it, and
        for the last failed one why it was not tried again."""
        attrs = self.attributes(ev.run_id, ev.node)
        attrs["agentrt.tool.attempts"] = len(ev.result.attempts)
        attrs["agentrt.tool.attempt_log"] = [
            {"attempt": a.index, "ok": a.ok, "error_kind": a.error_kind, "error": self.content.error(a.error),
             "duration_s": round(a.duration_s, 6), "backoff_s": a.backoff_s, "not_retried": a.not_retried,
             "executor": a.executor, "worker": a.worker} for a in ev.result.attempts]

    on = {LLMResponded: responded, NodeDispatched: dispatched, InputWanted: input_wanted, NodeValue: value,
          ToolReturned: returned}


class StoreRecorder(Dispatching):
    """The run store's writes: a run as it is submitted and ends, each node as its work starts and
    ends (a replayed node's outcome is recorded already), each tool attempt."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._args: dict[tuple[str, str], str] = {}  # (run id, node) -> its tool call's args hash

    def submitted(self, ev: RunSubmitted) -> None:
        store = self.store
        if store.get_run(ev.run_id) is None:
            digest = ev.program_hash or hashlib.sha256(json.dumps(ev.program.to_json(), sort_keys=True,
                                                                  default=repr).encode()).hexdigest()
            store.create_run(StoredRun(ev.run_id, ev.program.name, digest, dict(ev.inputs), status="running",
                                       started_at=time.time(), priority=ev.priority,
                                       metadata=dict(ev.metadata or {}), origin="cli"))
        else:  # made by the caller (a served run), or a resumed run
            store.update_run(ev.run_id, status="running", **({} if ev.resumed else {"started_at": time.time()}))

    def dispatched(self, ev: NodeDispatched) -> None:
        digest = None
        if ev.args is not None:
            digest = self._args[ev.run_id, ev.node] = args_hash(ev.args)
        self.store.node_started(ev.run_id, ev.node, ev.kind, **({"seed": ev.seed} if ev.kind == "llm" else {}),
                                **({"args_hash": digest} if ev.kind == "tool" else {}))

    def attempted(self, ev: ToolAttempted) -> None:
        a = ev.attempt
        self.store.tool_attempt(ev.run_id, ev.node, a.index, "finished" if a.ok else "failed",
                                args_hash=self._args.get((ev.run_id, ev.node)), started=a.started,
                                finished=a.finished, error_kind=a.error_kind, error=ev.error,
                                backoff_s=a.backoff_s, not_retried=a.not_retried)

    def outcome(self, ev: NodeOutcome) -> None:
        self._args.pop((ev.run_id, ev.node), None)
        if not ev.replayed:
            o = ev.outcome
            self.store.node_finished(ev.run_id, ev.node, ev.kind, o.ok, o.value, o.error, o.error_type, o.sent)

    def finished(self, ev: RunFinished) -> None:
        if ev.interrupted:  # not finished: nothing after its last recorded write counts
            return
        self.store.update_run(ev.run_id, status=ev.status, ended_at=time.time(), output=ev.output,
                              error=None if ev.error is None else {"node": ev.failed_node, "message": ev.error})

    on = {RunSubmitted: submitted, NodeDispatched: dispatched, ToolAttempted: attempted, NodeOutcome: outcome,
          RunFinished: finished}


class LiveFeed(Dispatching):
    """The RunEvents of events.py for the runtime's live listeners; nothing is built while nobody
    listens. Of each run's graph, listeners get what changed since they last heard of it; a
    listener that comes later gets the whole graph as added."""

    def __init__(self, clock: Trace) -> None:
        self.clock = clock
        self.listeners: list[RunEventListener] = []
        # run id -> the graph's nodes and edges when listeners last heard of it, and the states of
        # its nodes other than LLM, tool and wait_for ones
        self.graphs: dict[str, tuple[frozenset[str], frozenset[tuple[str, str]], dict[str, Any]]] = {}

    @property
    def watched(self) -> bool:
        return bool(self.listeners)

    def listen(self, fn: RunEventListener) -> Callable[[], None]:
        self.listeners.append(fn)

        def unsubscribe() -> None:
            if fn in self.listeners:
                self.listeners.remove(fn)

        return unsubscribe

    def emit(self, run_id: str, type: str, **data: Any) -> None:
        if not self.listeners:
            return
        event = RunEvent(run_id, type, self.clock.now(), data)
        for fn in list(self.listeners):
            fn(event)

    def __call__(self, event: Any) -> None:
        if self.listeners:
            super().__call__(event)
        elif isinstance(event, GraphChanged):  # nobody heard of the graph
            self.graphs.pop(event.run_id, None)
        if isinstance(event, RunFinished):
            self.graphs.pop(event.run_id, None)

    @staticmethod
    def _states(graph: Any) -> dict[str, Any]:
        return {n: a.get("state") for n, a in graph.nodes(data=True) if a["kind"] not in EXEC_KINDS}

    def run_started(self, ev: RunStarted) -> None:
        graph = ev.run.graph
        self.graphs[ev.run_id] = frozenset(graph), frozenset(graph.edges), self._states(graph)
        self.emit(ev.run_id, "run_started", program=ev.program, inputs=ev.inputs, graph=ev.run.to_json())

    def graph(self, ev: GraphChanged) -> None:
        """Nodes and edges added (a fan-out or loop step expanded), removed (a branch case not
        taken), and the new states of the graph's other nodes (branches deciding, fan-outs
        joining); LLM, tool and wait_for nodes tell their own states in their events."""
        graph = ev.run.graph
        nodes, edges, seen_states = self.graphs.get(ev.run_id, (frozenset(), frozenset(), {}))
        now, states = (frozenset(graph), frozenset(graph.edges)), self._states(graph)
        changed = {n: s for n, s in states.items() if n in nodes and seen_states.get(n) != s}
        if now != (nodes, edges) or changed:
            delta = ev.run.graph_delta(nodes, edges)
            self.graphs[ev.run_id] = *now, states
            self.emit(ev.run_id, "graph", **delta, states=changed)

    def started(self, ev: NodeStarted) -> None:
        self.emit(ev.run_id, "node_started", node=ev.node, kind=ev.kind,
                  **({"tool": ev.tool} if ev.kind == "tool" else {}), **({"early": True} if ev.early else {}),
                  **({"replayed": True} if ev.replayed else {}))

    def phase(self, ev: NodePhase) -> None:
        self.emit(ev.run_id, "node_phase", node=ev.node, phase=ev.phase)

    def step(self, ev: NodeStep) -> None:
        s = ev.step
        if not s.preempted:
            self.emit(ev.run_id, "step", node=ev.node, step=s.step, start=round(self.clock.at(s.start), 6),
                      duration_s=round(s.duration_s, 6), batch_size=s.batch_size, num_new=s.num_new, k=s.k,
                      accepted=s.accepted)

    def tokens(self, ev: NodeTokens) -> None:
        self.emit(ev.run_id, "token", node=ev.node, text=ev.text)

    def attempted(self, ev: ToolAttempted) -> None:
        a = ev.attempt
        if not a.ok and a.not_retried is None:
            self.emit(ev.run_id, "node_retried", node=ev.node, attempt=a.index, error_kind=a.error_kind,
                      error=ev.error, duration_s=round(a.duration_s, 6), backoff_s=a.backoff_s)

    def progressed(self, ev: ToolProgressed) -> None:
        self.emit(ev.run_id, "tool_progress", node=ev.node, progress=ev.progress, total=ev.total, message=ev.message)

    def input_wanted(self, ev: InputWanted) -> None:
        self.emit(ev.run_id, "input_wanted", node=ev.node, schema=ev.schema, prompt=ev.prompt)

    def input_given(self, ev: InputGiven) -> None:
        self.emit(ev.run_id, "input_given", node=ev.node, by=ev.by, via=ev.via, at=ev.at)

    def finished(self, ev: NodeFinished) -> None:
        replayed = {"replayed": True} if ev.replayed else {}
        if ev.status == "ok":
            self.emit(ev.run_id, "node_finished", node=ev.node, kind=ev.kind, status="ok", value=ev.value, **replayed)
        else:
            self.emit(ev.run_id, "node_finished", node=ev.node, kind=ev.kind, status=ev.status, error=ev.error,
                      **replayed)

    def run_finished(self, ev: RunFinished) -> None:
        if ev.interrupted:  # it has not finished: its resume goes on with its events
            return
        self.emit(ev.run_id, "run_finished", status=ev.status, output=ev.output, error=ev.error,
                  failed_node=ev.failed_node)

    on = {NodeStarted: started, NodePhase: phase, NodeStep: step, NodeTokens: tokens, ToolAttempted: attempted,
          ToolProgressed: progressed, InputWanted: input_wanted, InputGiven: input_given, NodeFinished: finished,
          RunFinished: run_finished, RunStarted: run_started, GraphChanged: graph}


def node_subscribers(store: RunStore, content: TraceContent, attributes: Attributes,
                     live: LiveFeed) -> list[Subscriber]:
    """Every subscriber of a runtime's events, in the order they hear each event: the trace's
    content first (a node's arguments are on its span even if the store then fails), the store
    (a durable one: a NullRunStore keeps nothing), then the live feed (a live event is only sent
    once what it says is recorded)."""
    return [TraceRecorder(content, attributes), *([StoreRecorder(store)] if store.durable else []), live]
