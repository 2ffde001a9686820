"""What happens to a run and its nodes, as typed events, and the environment node executors run in.

The executors (node_exec.py, prefill_ahead.py) and the runtime's driver say what happened by
emitting these frozen events on a NodeEvents emitter; they write nothing else. The run store, the
trace's content and the live feed each subscribe to them (subscribers.py, registered in one place:
`node_subscribers`); a server adds its metrics and OpenTelemetry export after them
(server/state.py: `server_subscribers`). Subscribers are called in the order they were registered, on the runtime's
event loop; an exception one raises (the store unavailable) reaches the emitter of the event, as
if the write were inline.

    RunSubmitted   a run is submitted (the store records it, or marks a recorded one running)
    RunStarted     its driver starts (the run's graph as it stands)
    GraphChanged   its graph may have changed (a fan-out or loop step expanded, a branch decided)
    NodeStarted    the driver started a node's task (kind, tool, early, replayed)
    NodeDispatched the node's work begins: an LLM call is sent (seed), a tool is called (args), a
                   wait_for node asks (the store records the start: a resume knows it was in flight)
    NodePhase      the node entered a phase (queued, prefill, decode, tool_running, input_wait, ...)
    NodeStep       an engine step an LLM node took part in
    NodeTokens     output text of an LLM node as it is generated
    LLMResponded   an LLM call's response (what it was sent and wrote, usage, α)
    ToolAttempted  one attempt of a tool call ended (error: as the trace keeps it)
    ToolProgressed a running tool reported progress
    ToolReturned   a tool call ended, after all its attempts
    InputWanted    a wait_for node waits for its value
    InputGiven     a wait_for node got its value
    NodeValue      the value a node produced
    NodeOutcome    how a node's work ended, as the driver reports it to the program run
    NodeFinished   a node finished (ok, error, cancelled): how long its span lasted, the tool it called
    RunFinished    a run ended; an interrupted one has not finished (it goes on when resumed)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from agentrt.dag import CompiledProgram, ProgramRun
    from agentrt.runtime.backend import LLMBackend, LLMRequest, LLMResponse, LLMStepEvent
    from agentrt.runtime.node_state import Outcome
    from agentrt.runtime.policy import KVHoldPolicy, SchedulingPolicy
    from agentrt.runtime.run_state import RunState
    from agentrt.runtime.trace import Trace
    from agentrt.runtime.trace_content import TraceContent
    from agentrt.tools import ToolRegistry


@dataclass(frozen=True)
class RunSubmitted:
    run_id: str
    program: CompiledProgram
    inputs: Mapping[str, Any]
    priority: float
    resumed: bool
    program_hash: str | None = None
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True)
class RunStarted:
    run_id: str
    program: str
    inputs: Mapping[str, Any]
    run: ProgramRun  # the live run, read when the event is heard


@dataclass(frozen=True)
class GraphChanged:
    run_id: str
    run: ProgramRun


@dataclass(frozen=True)
class NodeStarted:
    run_id: str
    node: str
    kind: str
    tool: str | None = None
    early: bool = False
    replayed: bool = False


@dataclass(frozen=True)
class NodeDispatched:
    run_id: str
    node: str
    kind: str
    seed: int | None = None  # a sampled LLM call's seed, kept so that a resume draws the same tokens
    args: Mapping[str, Any] | None = None  # a tool call's arguments


@dataclass(frozen=True)
class NodePhase:
    run_id: str
    node: str
    phase: str


@dataclass(frozen=True)
class NodeStep:
    run_id: str
    node: str
    step: LLMStepEvent


@dataclass(frozen=True)
class NodeTokens:
    run_id: str
    node: str
    text: str


@dataclass(frozen=True)
class LLMResponded:
    run_id: str
    node: str
    request: LLMRequest
    response: LLMResponse


@dataclass(frozen=True)
class ToolAttempted:
    run_id: str
    node: str
    attempt: Any  # tools.ToolAttempt
    error: str | None
    args: Mapping[str, Any]


@dataclass(frozen=True)
class ToolProgressed:
    run_id: str
    node: str
    progress: float | None
    total: float | None
    message: str | None


@dataclass(frozen=True)
class ToolReturned:
    run_id: str
    node: str
    result: Any  # tools.ToolResult


@dataclass(frozen=True)
class InputWanted:
    run_id: str
    node: str
    schema: Mapping[str, Any]
    prompt: str | None


@dataclass(frozen=True)
class InputGiven:
    run_id: str
    node: str
    by: str | None
    via: str
    at: float


@dataclass(frozen=True)
class NodeValue:
    run_id: str
    node: str
    kind: str
    value: Any


@dataclass(frozen=True)
class NodeOutcome:
    run_id: str
    node: str
    kind: str
    outcome: Outcome
    replayed: bool = False


@dataclass(frozen=True)
class NodeFinished:
    run_id: str
    node: str
    kind: str
    status: str
    value: Any = None
    error: str | None = None
    replayed: bool = False
    tool: str | None = None  # the tool a tool node called (none for one replayed or never dispatched)
    duration_s: float | None = None  # its span's length, from when it began waiting until it ended


@dataclass(frozen=True)
class RunFinished:
    run_id: str
    status: str
    output: Any
    error: str | None
    failed_node: str | None
    interrupted: bool = False


Subscriber = Callable[[Any], None]


class NodeEvents:
    """The emitter: each event goes to every subscriber, in order. `watched` says whether someone
    follows runs live (text deltas and engine steps are only worth asking for then)."""

    def __init__(self, subscribers: Iterable[Subscriber] = (), watched: Callable[[], bool] = lambda: False) -> None:
        self.subscribers = list(subscribers)
        self._watched = watched

    @property
    def watched(self) -> bool:
        return self._watched()

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Add a subscriber after the runtime's own; returns the unsubscribe function."""
        self.subscribers.append(fn)
        return lambda: self.subscribers.remove(fn) if fn in self.subscribers else None

    def emit(self, event: Any) -> None:
        for fn in list(self.subscribers):
            fn(event)


class Dispatching:
    """A subscriber that handles some event types (`on` maps each to a method) and ignores the rest."""

    on: Mapping[type, Callable[[Any, Any], None]] = {}

    def __call__(self, event: Any) -> None:
        handler = self.on.get(type(event))
        if handler is not None:
            handler(self, event)


@dataclass(frozen=True)
class NodeEnv:
    """What a node executor may use: the backend and tools it runs on, the scheduling and KV hold
    policies, the clock (the trace's), the emitter it tells what happened on, the content policy
    (which error text leaves a node), and the runtime's options. start_streamed(rs, node) starts
    what a node's streamed output made ready while it still generates."""

    backend: LLMBackend
    tools: ToolRegistry
    policy: SchedulingPolicy
    kv_hold: KVHoldPolicy | None
    clock: Trace
    events: NodeEvents
    content: TraceContent
    start_streamed: Callable[[RunState, str], None]
    max_tokens: int | None = None
    stream_outputs: bool = True
    prefill_ahead: bool = True
    records_seeds: bool = False  # a store records sampled calls' seeds (NodeDispatched.seed)
