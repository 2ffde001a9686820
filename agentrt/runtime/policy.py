"""Scheduling policies: the engine priority of each LLM request (smaller = sooner).

The runtime keeps, per program run, the service it has attained (engine tokens and a fair share
of engine time, tool time) and the critical path left; a policy reads them when an LLM node is
submitted (`priority`) and after each node ends (`reprioritize`, applied to that program's
requests in flight). FCFS gives everyone priority 0: the engine's arrival order decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence


@dataclass
class ProgramStats:
    """What a program run has received so far. llm_service_s: each engine step's duration split
    evenly over the requests in its batch; llm_tokens: tokens the engine processed for it
    (prompt fed + tokens generated); critical_path: calls left on its longest path."""

    run_id: str
    program: str
    started: float
    llm_tokens: int = 0
    llm_service_s: float = 0.0
    tool_s: float = 0.0
    llm_calls: int = 0
    tool_calls: int = 0
    critical_path: float = 0.0
    llm_in_flight: int = 0
    tools_in_flight: int = 0

    def to_record(self) -> dict[str, float | int]:
        return {"llm_tokens": self.llm_tokens, "llm_service_s": round(self.llm_service_s, 6),
                "tool_s": round(self.tool_s, 6), "llm_calls": self.llm_calls, "tool_calls": self.tool_calls}


@dataclass(frozen=True)
class NodeContext:
    """An LLM node about to be submitted. critical_path: the longest path of calls left from this
    node (itself included). next_is_tool: a tool call follows it (its KV could be held)."""

    run_id: str
    node: str
    critical_path: float
    next_is_tool: bool


class SchedulingPolicy(Protocol):
    def priority(self, program: ProgramStats, node: NodeContext) -> float:
        """The engine priority of a new LLM request of `program`."""
        ...

    def reprioritize(self, programs: Sequence[ProgramStats]) -> Mapping[str, float]:
        """New priorities by run_id for requests already in flight ({}: no change)."""
        ...


class FCFSPolicy:
    """First come, first served: every request at priority 0."""

    name = "fcfs"

    def priority(self, program: ProgramStats, node: NodeContext) -> float:
        return 0.0

    def reprioritize(self, programs: Sequence[ProgramStats]) -> Mapping[str, float]:
        return {}
