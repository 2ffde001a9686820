"""A run's live state inside the runtime (RunState), the handle a caller holds (RunHandle) and
how a run ended (RunResult)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from agentrt.dag import CompiledProgram, ProgramRun
from agentrt.runtime.node_exec import InputWait
from agentrt.runtime.node_state import NodeState, Outcome
from agentrt.runtime.policy import ProgramStats
from agentrt.runtime.store import RecordedNodes, StoreUnavailable

if TYPE_CHECKING:
    from agentrt.runtime.prefill_ahead import AheadRequest


@dataclass(frozen=True)
class RunResult:
    """status: "done" (output holds the program's output), "failed" (error says why, and
    failed_node which node) or "cancelled". values: the output of every finished node (inputs,
    calls, fan-ins) by node id. Times are on the trace clock."""

    run_id: str
    program: str
    status: str
    output: Any
    error: str | None
    failed_node: str | None
    start: float
    end: float
    node_errors: Mapping[str, str] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def ok(self) -> bool:
        return self.status == "done"


@dataclass
class RunState:
    run_id: str
    trace_id: str
    program: CompiledProgram
    run: ProgramRun
    stats: ProgramStats
    start: float
    nodes: dict[str, NodeState] = field(default_factory=dict)
    inflight: dict[asyncio.Task, str] = field(default_factory=dict)
    # node tasks as they end: the drive loop waits on this, not on a snapshot of `inflight`, so a
    # node started while it waits (a tool started early on streamed output) is heard of at once
    ended: asyncio.Queue = field(default_factory=asyncio.Queue)
    status: str = "running"
    result: RunResult | None = None
    task: asyncio.Task | None = None
    priority: float = 0.0  # added to every priority the policy gives the run's LLM calls
    holds: list[tuple[str, Any]] = field(default_factory=list)  # (node, backend pin) awaiting the next call
    ahead: dict[str, AheadRequest] = field(default_factory=dict)  # LLM node -> its prefill-ahead
    sent: dict[str, Any] = field(default_factory=dict)  # LLM node -> the messages it sent (LLMSpec.continues)
    recorded: RecordedNodes | None = None  # a resumed run: what the store recorded of it
    waiting: dict[str, InputWait] = field(default_factory=dict)  # wait_for nodes waiting for their value
    interrupted: bool = False  # stopped by Runtime.interrupt or by its store going away: it stays resumable


class RunHandle:
    """A submitted program run: await it (or `await handle.wait()`) for its RunResult."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    @property
    def run_id(self) -> str:
        return self.state.run_id

    def done(self) -> bool:
        return self.state.result is not None

    @property
    def interrupted(self) -> bool:
        """Stopped without ending in the store (Runtime.interrupt, or a store write that failed
        because the store was unavailable): a resume goes on from what the store recorded."""
        return self.state.interrupted

    def cancel(self) -> None:
        """Cancel the run: its nodes in flight are cancelled (engine requests aborted)."""
        if self.state.task is not None:
            self.state.task.cancel()

    async def wait(self) -> RunResult:
        """The run's result; cancelling the wait does not cancel the run (use cancel())."""
        assert self.state.task is not None
        return await asyncio.shield(self.state.task)

    def __await__(self):
        return self.wait().__await__()


def task_outcome(task: asyncio.Task) -> Outcome:
    """A finished node task's outcome; a bug in the runtime's own node code fails the node."""
    try:
        return task.result()
    except StoreUnavailable:  # not the node's outcome: the run stops, to be resumed (Runtime._drive)
        raise
    except Exception as e:  # noqa: BLE001 - nothing a node does may take the runtime down
        return Outcome.failed(f"internal error running the node: {type(e).__name__}: {e}", "internal_error")


def loop_attributes(run: ProgramRun, node: str) -> dict[str, Any]:
    """Span attributes of an agent-loop step (a loop has no span of its own): agentrt.loop, its
    loop; and on the LLM step that ended the loop, how it did (agentrt.loop.ended: "answered",
    "answered_at_max_steps" or "exceeded_max_steps") after how many steps (agentrt.loop.llm_steps,
    agentrt.loop.tool_steps)."""
    loop = getattr(run.spec(node), "loop", None) if node in run.graph else None
    if loop is None or loop not in run.graph:
        return {}
    attrs = run.graph.nodes[loop]
    out: dict[str, Any] = {"agentrt.loop": loop}
    if "ended" in attrs and node == run.spec(loop).step_id(attrs["llm_steps"], "llm"):
        out.update({"agentrt.loop.ended": attrs["ended"], "agentrt.loop.llm_steps": attrs["llm_steps"],
                    "agentrt.loop.tool_steps": attrs["tool_steps"]})
    return out


def program_record(rs: RunState, end: float, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace's program record of a run, as it stands at `end` (a finished run's, or a snapshot's)."""
    return {"type": "program", "run_id": rs.run_id, "trace_id": rs.trace_id, "program": rs.program.name,
            "start": round(rs.start, 6), "end": round(end, 6), "status": status, "error": error,
            "service": rs.stats.to_record(), "nodes": len(rs.nodes), "graph": rs.run.to_json()}
