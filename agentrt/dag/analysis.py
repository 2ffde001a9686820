"""What remains of a program: calls left and the critical path, for the scheduler.

Works on the static graph of a CompiledProgram and on the live graph of a ProgramRun alike:
an unexpanded fan-out body counts as `fan_out_width` branches (1 on the critical path, since
branches run in parallel), an undecided branch counts its largest case, and an agent loop counts
the steps it may still take (an upper bound: it may answer sooner).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import networkx as nx

from agentrt.errors import ProgramRunError

DEFAULT_WEIGHTS = {"llm": 1.0, "tool": 1.0}
Done = Callable[[str], bool]


@dataclass(frozen=True)
class CallCount:
    """A number of LLM calls and tool calls."""

    llm: int = 0
    tool: int = 0

    @property
    def total(self) -> int:
        return self.llm + self.tool

    def __add__(self, other: CallCount) -> CallCount:
        return CallCount(self.llm + other.llm, self.tool + other.tool)

    def __mul__(self, k: int) -> CallCount:
        return CallCount(self.llm * k, self.tool * k)

    def most(self, other: CallCount) -> CallCount:
        return CallCount(max(self.llm, other.llm), max(self.tool, other.tool))


def loop_steps_left(attrs: Mapping[str, Any]) -> CallCount:
    """LLM and tool steps an unfinished agent loop may still add beyond those already in the graph."""
    max_steps = attrs["spec"].max_steps
    return CallCount(max_steps - attrs.get("llm_steps", 0), max(0, max_steps - 1 - attrs.get("tool_steps", 0)))


def _calls(node: str, attrs: Mapping[str, Any], fan_out_width: int) -> CallCount:
    kind = attrs["kind"]
    own = CallCount(1, 0) if kind == "llm" else CallCount(0, 1) if kind == "tool" else \
        loop_steps_left(attrs) if kind == "agent_loop" else CallCount()
    return own * fan_out_width ** node.count("[*]")


def remaining_calls(graph: nx.DiGraph, done: Done, fan_out_width: int = 1) -> CallCount:
    nodes = [n for n in graph if not done(n)]
    return _count(graph, nodes, 0, fan_out_width)


def _count(graph: nx.DiGraph, nodes: Iterable[str], depth: int, width: int) -> CallCount:
    total = CallCount()
    branches: dict[str, dict[str, list[str]]] = {}
    for node in nodes:
        gates = graph.nodes[node]["gates"]
        if len(gates) > depth:  # inside an undecided case: counted with its branch below
            gate = gates[depth]
            branches.setdefault(gate[:-1].rsplit("?", 1)[0], {}).setdefault(gate, []).append(node)
        else:
            total += _calls(node, graph.nodes[node], width)
    for cases in branches.values():
        largest = CallCount()
        for case_nodes in cases.values():
            largest = largest.most(_count(graph, case_nodes, depth + 1, width))
        total += largest
    return total


def critical_path_length(graph: nx.DiGraph, done: Done, from_node: str | None = None,
                         weights: Mapping[str, float] | None = None) -> float:
    """Longest weighted path of work left, starting at `from_node` (its own weight included) or
    anywhere. `weights` maps node ids or kinds ("llm", "tool") to costs, an id winning over its
    kind; defaults 1 per LLM or tool call; a loop counts its steps left unless its id is weighted."""
    weights = {**DEFAULT_WEIGHTS, **(weights or {})}
    if from_node is not None and from_node not in graph:
        raise ProgramRunError(from_node, "no such node in the graph")

    def weight(node: str) -> float:
        attrs = graph.nodes[node]
        if done(node):
            return 0.0
        if node in weights:
            return float(weights[node])
        if attrs["kind"] == "agent_loop":
            left = loop_steps_left(attrs)
            return left.llm * weights["llm"] + left.tool * weights["tool"]
        return float(weights.get(attrs["kind"], 0.0))

    longest: dict[str, float] = {}
    for node in reversed(list(nx.topological_sort(graph))):
        longest[node] = weight(node) + max((longest[s] for s in graph.successors(node)), default=0.0)
    if from_node is not None:
        return longest[from_node]
    return max(longest.values(), default=0.0)
