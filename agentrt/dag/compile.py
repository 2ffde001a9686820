"""compile(): resolve template names, attach tools, build the networkx graph, and validate it.

Every problem is collected (node, message) and raised together as ProgramValidationError.

Scopes: a node's scope is its id up to the last "." ("" at top level, "research[*]." in a fan-out
body, "route?yes." in a branch case). A node sees its own scope and the enclosing ones; template
names resolve innermost first; a local id may not shadow an enclosing one (except `item`).
"""
from __future__ import annotations

import difflib
from dataclasses import replace
from typing import Any, Mapping

import networkx as nx

from agentrt.dag.compiled import CompiledProgram, node_attrs
from agentrt.dag.outputs import ToolCall
from agentrt.dag.refs import Ref, Template
from agentrt.dag.specs import AgentLoopSpec, BranchSpec, Decl, ItemSpec, LLMSpec, NodeSpec, ToolSpec, WaitForSpec, map_args
from agentrt.dag.tooldefs import ToolDef
from agentrt.dag.typecheck import check_types
from agentrt.errors import ProgramValidationError

Problems = list[tuple[str, str]]
_UNRESOLVED = "?"  # prefix of a placeholder that named nothing (already reported)


def scope_of(node: str) -> str:
    return node.rsplit(".", 1)[0] + "." if "." in node else ""


def enclosing(scope: str) -> list[str]:
    """The scope and its ancestors, innermost first: "a[*].b?x." -> ["a[*].b?x.", "a[*].", ""]."""
    parts = scope.split(".")[:-1]
    return ["".join(p + "." for p in parts[:k]) for k in range(len(parts), -1, -1)]


def owner(scope: str) -> str:
    """The fan-out or branch that owns a body scope: "research[*]." -> "research"."""
    last = scope[:-1]
    return last[:-3] if last.endswith("[*]") else last.rsplit("?", 1)[0]


def compile_program(name: str, decls: Mapping[str, Decl], tools: Mapping[str, ToolDef],
                    output: Ref | dict[str, Ref] | None) -> CompiledProgram:
    problems: Problems = []
    specs: dict[str, NodeSpec] = {}
    for node, decl in decls.items():
        specs[node] = _resolve_names(decl.spec, decls, problems)
    known_refs = not problems
    for node, spec in specs.items():
        specs[node] = _attach_tools(spec, tools, problems)
    _check_shadowing(decls, problems)

    graph = nx.DiGraph(name=name)
    for node, decl in decls.items():
        graph.add_node(node, **node_attrs(specs[node], (decl.order,)))
    for node, spec in specs.items():
        for use in spec.refs():
            if _check_ref(node, use.where, use.ref, use.scope or scope_of(node), specs, problems):
                graph.add_edge(use.ref.node, node)
            else:
                known_refs = False
    _add_control_edges(graph, specs)
    _check_continues(specs, problems)
    _check_cycles(graph, decls, problems)

    before = len(problems)
    output_refs = _check_output(name, output, specs, problems)
    known_refs = known_refs and len(problems) == before
    check_types(specs, tools, output_refs, problems)
    for node, spec in specs.items():  # check_types may mark tool args as coming from a ToolCall
        graph.nodes[node]["spec"] = spec
    if known_refs:  # with a reference unresolved, an edge is missing: reachability would mislead
        _check_reachable(graph, specs, [r.node for r in output_refs], problems)

    if problems:
        order = {n: d.order for n, d in decls.items()}
        problems.sort(key=lambda p: order.get(p[0], len(order)))
        raise ProgramValidationError(problems, program=name, sites={n: d.site for n, d in decls.items()})
    return CompiledProgram(name, graph, dict(tools), output)


def _resolve_names(spec: NodeSpec, decls: Mapping[str, Decl], problems: Problems) -> NodeSpec:
    scopes = enclosing(scope_of(spec.id))

    def resolve(where: str, t: Template) -> Template:
        refs = []
        for ph in t.placeholders():
            found = next((s + ph.node for s in scopes if s + ph.node in decls), None)
            if found is None:
                visible = [n[len(s):] for s in scopes for n in decls if n.startswith(s) and "." not in n[len(s):]]
                close = difflib.get_close_matches(ph.node, visible, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                problems.append((spec.id, f"{where}: unknown reference {{{ph!s}}}: no node or input "
                                          f"'{ph.node}' in scope{hint}"))
                found = _UNRESOLVED + ph.node
            refs.append(Ref(found, ph.path))
        return Template(t.text, tuple(refs))

    if isinstance(spec, (LLMSpec, AgentLoopSpec)):
        return replace(spec, prompt=resolve("prompt", spec.prompt),
                       system=resolve("system", spec.system) if spec.system else None)
    if isinstance(spec, ToolSpec) and not isinstance(spec.args, Ref):
        return replace(spec, args=map_args(spec.args, lambda v: resolve("args", v) if isinstance(v, Template) else v))
    if isinstance(spec, WaitForSpec) and spec.prompt is not None:
        return replace(spec, prompt=resolve("prompt", spec.prompt))
    return spec


def _attach_tools(spec: NodeSpec, tools: Mapping[str, ToolDef], problems: Problems) -> NodeSpec:
    declared = ", ".join(tools) or "none"
    if isinstance(spec, ToolSpec):
        if spec.tool not in tools:
            problems.append((spec.id, f"unknown tool '{spec.tool}' (declared tools: {declared})"))
        return spec
    names = spec.output.tools if isinstance(spec, LLMSpec) and isinstance(spec.output, ToolCall) else \
        spec.tools if isinstance(spec, AgentLoopSpec) else None
    if names is None:
        return spec
    unknown = [t for t in names if t not in tools]
    for t in unknown:
        where = "output ToolCall" if isinstance(spec, LLMSpec) else "tools"
        problems.append((spec.id, f"{where} names unknown tool '{t}' (declared tools: {declared})"))
    if unknown:
        return spec
    definitions = tuple(tools[t] for t in names)
    if isinstance(spec, LLMSpec):
        return replace(spec, output=replace(spec.output, definitions=definitions))
    return replace(spec, definitions=definitions)


def _check_shadowing(decls: Mapping[str, Decl], problems: Problems) -> None:
    for node, decl in decls.items():
        scope = scope_of(node)
        local = node[len(scope):]
        if not scope or isinstance(decl.spec, ItemSpec):
            continue
        for outer in enclosing(scope)[1:]:
            if outer + local in decls:
                problems.append((node, f"local id '{local}' shadows {outer + local} of an enclosing scope; rename one"))
                break


def _check_ref(node: str, where: str, ref: Ref, scope: str, specs: Mapping[str, NodeSpec],
               problems: Problems) -> bool:
    if ref.node.startswith(_UNRESOLVED):
        return False
    if ref.node not in specs:
        problems.append((node, f"{where}: unknown reference {ref!s}: no node or input '{ref.node}' in this program"))
        return False
    target_scope = scope_of(ref.node)
    if not scope.startswith(target_scope):
        body = owner(target_scope)
        problems.append((node, f"{where}: {ref!s} is inside the body of {body}, not visible here; "
                               f"outside the body, reference {body} (its result)"))
        return False
    return True


def _check_continues(specs: Mapping[str, NodeSpec], problems: Problems) -> None:
    """A call can carry on only the conversation of an LLM call that answered in text or JSON: a
    tool call's conversation goes on with the tool's result, which is what agent_loop is for."""
    for node, spec in specs.items():
        earlier = specs.get(spec.continues) if isinstance(spec, LLMSpec) and spec.continues else None
        if earlier is None:
            continue  # no continues=, or an unknown node (_check_ref reported it)
        if not isinstance(earlier, LLMSpec):
            problems.append((node, f"continues {spec.continues}, which is not an LLM call ({earlier.kind})"))
        elif isinstance(earlier.output, ToolCall):
            problems.append((node, f"continues {spec.continues}, which answers with a tool call; to carry on "
                                   "after a tool's result use agent_loop"))


def _add_control_edges(graph: nx.DiGraph, specs: Mapping[str, NodeSpec]) -> None:
    """A case runs only once its branch has decided: an edge (control=True) from the branch's `on`
    node to each case node with no predecessor inside its case, so that order and critical path
    see the wait."""
    for spec in specs.values():
        if not isinstance(spec, BranchSpec) or spec.on.node not in graph:
            continue
        for case in spec.cases:
            for node in [n for n in graph if n.startswith(case.prefix)]:
                if not any(p.startswith(case.prefix) for p in graph.predecessors(node)) \
                        and not graph.has_edge(spec.on.node, node):
                    graph.add_edge(spec.on.node, node, control=True)


def _check_cycles(graph: nx.DiGraph, decls: Mapping[str, Decl], problems: Problems) -> None:
    for component in nx.strongly_connected_components(graph):
        first = min(component, key=lambda n: decls[n].order)
        if len(component) == 1 and not graph.has_edge(first, first):
            continue
        edges = nx.find_cycle(graph.subgraph(component), source=first)
        path = " -> ".join([edges[0][0], *(v for _, v in edges)])
        problems.append((first, f"cycle {path}: only an agent_loop may repeat; the graph must otherwise be acyclic"))


def _check_output(name: str, output: Any, specs: Mapping[str, NodeSpec], problems: Problems) -> list[Ref]:
    if output is None:
        problems.append((name, "no output declared: call p.output(ref) (or p.output({'name': ref, ...}))"))
        return []
    refs = [output] if isinstance(output, Ref) else list(output.values())
    good = []
    for ref in refs:
        if _check_ref(name, "output", ref, "", specs, problems):
            good.append(ref)
    return good


def _check_reachable(graph: nx.DiGraph, specs: Mapping[str, NodeSpec], outputs: list[str],
                     problems: Problems) -> None:
    """A node is reachable when its output flows into a program output; every other node (or
    input) would be computed for nothing, so it is an error. Fan-out items are exempt: a body may
    ignore its item (run N times)."""
    if not outputs:
        return
    needed = set(outputs).union(*(nx.ancestors(graph, o) for o in outputs))
    for node, spec in specs.items():
        if node in needed or isinstance(spec, ItemSpec):
            continue
        what = "input is never used" if spec.kind == "input" else \
            "unreachable: its output feeds no program output (reference it, add it to p.output, or remove it)"
        problems.append((node, what))
