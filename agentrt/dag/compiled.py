"""CompiledProgram: a validated, frozen program graph plus what a scheduler asks of it."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Collection, Mapping

import networkx as nx

from agentrt.dag import analysis, export
from agentrt.dag.refs import Ref
from agentrt.dag.specs import InputSpec, NodeSpec
from agentrt.dag.tooldefs import ToolDef
from agentrt.errors import ProgramRunError

if TYPE_CHECKING:
    from agentrt.dag.run import ProgramRun


def gates_of(node: str) -> tuple[str, ...]:
    """The branch cases enclosing a node, outermost first: "a?x.b?y.c" -> ("a?x.", "a?x.b?y.")."""
    gates, prefix = [], ""
    for part in node.split(".")[:-1]:
        prefix += part + "."
        if "?" in part:
            gates.append(prefix)
    return tuple(gates)


def node_attrs(spec: NodeSpec, order: tuple[int, ...]) -> dict[str, Any]:
    """Graph node attributes. kind, spec; order: declaration order (sort key); template: inside an
    unexpanded fan-out body; gates: enclosing branch cases not yet decided."""
    return {"kind": spec.kind, "spec": spec, "order": order, "template": "[*]" in spec.id,
            "gates": gates_of(spec.id)}


@dataclass(frozen=True)
class CompiledProgram:
    """A validated program. `graph` is a frozen networkx DiGraph: nodes carry kind, spec, order,
    template, gates; an edge u -> v means v reads u's output, or (edge attribute control=True) that
    branch case node v waits for the decision on u's value. Fan-out bodies appear once, as
    template nodes "<fan-out>[*].<id>"; branch cases as "<branch>?<key>.<id>"; an agent loop as one
    node (its steps appear when a run takes them).

    >>> from agentrt.dag import Program
    >>> p = Program("hello", inputs={"name": str})
    >>> p.output(p.llm("greet", prompt="Greet {name}"))
    >>> c = p.compile()
    >>> c.topological_order, c.remaining_calls(done={"name"}).llm, c.critical_path_length()
    (('name', 'greet'), 1, 1.0)
    >>> print(c.to_mermaid().splitlines()[3])
        n_name --> n_greet
    """

    name: str
    graph: nx.DiGraph = field(repr=False)
    tools: Mapping[str, ToolDef] = field(repr=False)
    output: Ref | Mapping[str, Ref]
    inputs: Mapping[str, str] = field(init=False)
    topological_order: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        graph = nx.freeze(self.graph)
        object.__setattr__(self, "graph", graph)
        object.__setattr__(self, "tools", MappingProxyType(dict(self.tools)))
        object.__setattr__(self, "inputs", MappingProxyType(
            {n: a["spec"].type for n, a in graph.nodes(data=True) if isinstance(a["spec"], InputSpec)}))
        object.__setattr__(self, "topological_order", tuple(
            nx.lexicographical_topological_sort(graph, key=lambda n: graph.nodes[n]["order"])))

    def spec(self, node: str) -> NodeSpec:
        if node not in self.graph:
            raise ProgramRunError(node, f"no such node in program '{self.name}'")
        return self.graph.nodes[node]["spec"]

    def output_nodes(self) -> list[str]:
        refs = [self.output] if isinstance(self.output, Ref) else list(self.output.values())
        return [r.node for r in refs]

    def remaining_calls(self, done: Collection[str] = (), *, fan_out_width: int = 1) -> analysis.CallCount:
        """LLM and tool calls not in `done`: a fan-out body counts `fan_out_width` times (its width
        is known only at run time), a branch its largest case, an agent loop max_steps LLM calls
        and max_steps - 1 tool calls (upper bounds)."""
        done = set(done)
        return analysis.remaining_calls(self.graph, done.__contains__, fan_out_width)

    def critical_path_length(self, from_node: str | None = None, weights: Mapping[str, float] | None = None) -> float:
        """Longest weighted path from `from_node` (included) to the end, or the longest overall.
        weights: {node id or kind ("llm", "tool"): cost}; default 1 per call (loops: max steps)."""
        return analysis.critical_path_length(self.graph, lambda n: False, from_node, weights)

    def to_mermaid(self) -> str:
        return export.to_mermaid(self.graph)

    def to_dot(self) -> str:
        return export.to_dot(self.graph)

    def to_json(self) -> dict[str, Any]:
        """{"nodes": [{id, kind, label, ...}], "edges": [{source, target}]} (see export.to_json)."""
        return export.to_json(self.graph)

    def input_schema(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The program's inputs as a JSON schema object; inputs with a default are optional."""
        defaults = defaults or {}
        props = {n: {"type": t, **({"default": defaults[n]} if n in defaults else {})} for n, t in self.inputs.items()}
        return {"type": "object", "properties": props, "required": [n for n in self.inputs if n not in defaults],
                "additionalProperties": False}

    def start(self, inputs: Mapping[str, Any]) -> ProgramRun:
        """A new run of this program with these input values (see ProgramRun)."""
        from agentrt.dag.run import ProgramRun
        return ProgramRun(self, inputs)
