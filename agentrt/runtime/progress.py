"""A live view of a program run: how many calls are done, what runs, and what is stalled on what
("synthesis waits on answers[2].search (tool_running 1.2s)")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrt.runtime.run_state import RunState


@dataclass(frozen=True)
class Running:
    node: str
    kind: str
    phase: str
    elapsed_s: float  # in the current phase


@dataclass(frozen=True)
class Stall:
    node: str  # waiting
    blocker: str  # a running node it (transitively) depends on
    blocker_phase: str
    blocker_elapsed_s: float

    def describe(self) -> str:
        return f"{self.node} waits on {self.blocker} ({self.blocker_phase} {self.blocker_elapsed_s:.1f}s)"


@dataclass(frozen=True)
class Progress:
    run_id: str
    program: str
    status: str
    done: int
    total: int  # LLM and tool calls known so far (fan-outs and loops add more as they expand)
    running: tuple[Running, ...]
    stalls: tuple[Stall, ...]


def blockers(rs: RunState, node: str) -> list[str]:
    """The running calls `node` waits on, directly or through unfinished nodes."""
    graph, seen, found = rs.run.graph, {node}, []
    stack = list(graph.predecessors(node))
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        state = graph.nodes[n]["state"]
        if state == "done":
            continue
        ns = rs.nodes.get(n)
        if ns is not None and ns.active:
            found.append(n)
        else:
            stack.extend(graph.predecessors(n))
    return sorted(found)


def progress(rs: RunState, now: float) -> Progress:
    running, stalls = [], []
    for node, ns in rs.nodes.items():
        if ns.active:
            running.append(Running(node, ns.kind, ns.log.phase, now - ns.log.since))
    if rs.status == "running":
        active = {r.node: r for r in running}
        for node, ns in rs.nodes.items():
            if ns.status == "pending":
                for b in blockers(rs, node):
                    r = active[b]
                    stalls.append(Stall(node, b, r.phase, r.elapsed_s))
    done = sum(1 for ns in rs.nodes.values() if ns.finished)
    return Progress(rs.run_id, rs.program.name, rs.status, done, len(rs.nodes),
                    tuple(sorted(running, key=lambda r: r.node)), tuple(stalls))
