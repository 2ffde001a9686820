"""Mermaid and DOT text of a program graph, static or expanded: templates dashed, node states
coloured, control edges (branch decision -> case) dotted."""
from __future__ import annotations

import re
from typing import Any, Mapping

import networkx as nx

from agentrt.dag.specs import Case, Constant, predicate_name

_MERMAID_SHAPES = {"input": ("([", "])"), "llm": ("[", "]"), "tool": ("[[", "]]"), "wait_for": ("(", ")"),
                   "item": (">", "]"), "fan_out": ("[/", "/]"), "branch": ("{", "}"), "agent_loop": ("{{", "}}")}
_DOT_SHAPES = {"input": "ellipse", "llm": "box", "tool": "component", "wait_for": "house", "item": "cds",
               "fan_out": "trapezium", "branch": "diamond", "agent_loop": "hexagon"}
_STATE_COLOURS = {"done": "#d4edda", "running": "#fff3cd", "failed": "#f8d7da"}


def describe(attrs: Mapping[str, Any]) -> str:
    """One line saying what a node does, e.g. "llm -> json", "tool get_weather"."""
    spec, kind = attrs["spec"], attrs["kind"]
    if kind == "input":
        return f"input: {spec.type}"
    if kind == "llm":
        step = f" (step {spec.id.rsplit('#', 1)[1].split('.')[0]})" if spec.loop else ""
        return f"llm -> {spec.output.describe()}{step}"
    if kind == "wait_for":
        return "waits for input" + (f": {_clip(spec.prompt.text)}" if spec.prompt is not None else "")
    if kind == "tool":
        return f"tool {spec.tool}" + (" (fallback)" if spec.has_fallback else "")
    if kind == "item":
        return f"item of {spec.over!s}" + (f" [{spec.index}]" if spec.index is not None else "")
    if kind == "fan_out":
        return f"fan-out over {spec.over!s}" + (f" x{attrs['width']}" if "width" in attrs else "")
    if kind == "branch":
        return f"branch on {spec.on!s}" + (f" -> {attrs['case']}" if "case" in attrs else "")
    choice = f", tool_choice {spec.tool_choice}" if spec.tool_choice != "auto" else ""
    choice += ", parallel calls" if spec.parallel_calls else ""
    ended = f" -> {attrs['ended']} at step {attrs['llm_steps']}" if "ended" in attrs else ""
    return f"agent loop, max {spec.max_steps} steps{choice}: {', '.join(spec.tools)}{ended}"


def _clip(text: str, chars: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= chars else line[: chars - 1] + "…"


def _ordered(graph: nx.DiGraph) -> list[str]:
    return sorted(graph, key=lambda n: graph.nodes[n]["order"])


def _ordered_edges(graph: nx.DiGraph) -> list[tuple[str, str]]:
    return sorted(graph.edges, key=lambda e: (graph.nodes[e[1]]["order"], graph.nodes[e[0]]["order"]))


def _mermaid_ids(nodes: list[str]) -> dict[str, str]:
    ids: dict[str, str] = {}
    used: set[str] = set()
    for node in nodes:
        base = "n_" + re.sub(r"\W", "_", node)  # the prefix keeps ids off Mermaid keywords such as "end"
        mid, k = base, 1
        while mid in used:
            k += 1
            mid = f"{base}_{k}"
        used.add(mid)
        ids[node] = mid
    return ids


def _mermaid_text(text: str) -> str:
    return text.replace("&", "#amp;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")


def to_mermaid(graph: nx.DiGraph) -> str:
    """A Mermaid flowchart: one node per graph node labelled "<id><br/><what it does>"."""
    nodes = _ordered(graph)
    ids = _mermaid_ids(nodes)
    lines = ["flowchart TD"]
    for node in nodes:
        attrs = graph.nodes[node]
        left, right = _MERMAID_SHAPES[attrs["kind"]]
        label = _mermaid_text(node) + "<br/>" + _mermaid_text(describe(attrs))
        lines.append(f'    {ids[node]}{left}"{label}"{right}')
    for u, v in _ordered_edges(graph):
        arrow = "-.->" if graph.edges[u, v].get("control") else "-->"
        lines.append(f"    {ids[u]} {arrow} {ids[v]}")
    lines.append("    classDef template stroke-dasharray: 5 5")
    for state, colour in _STATE_COLOURS.items():
        lines.append(f"    classDef {state} fill:{colour}")
    for cls in ("template", *_STATE_COLOURS):
        members = [ids[n] for n in nodes if cls in _classes(graph.nodes[n])]
        if members:
            lines.append(f"    class {','.join(members)} {cls}")
    return "\n".join(lines) + "\n"


def _classes(attrs: Mapping[str, Any]) -> list[str]:
    found = ["template"] if attrs.get("template") else []
    if attrs.get("state") in _STATE_COLOURS:
        found.append(attrs["state"])
    return found


def _dot_text(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: nx.DiGraph) -> str:
    """Graphviz DOT text: quoted node ids, labels "<id>\\n<what it does>", one line per edge."""
    lines = [f"digraph {_dot_text(graph.graph.get('name', 'program'))} {{", "    rankdir=TB;",
             '    node [fontname="Helvetica", fontsize=11];']
    for node in _ordered(graph):
        attrs = graph.nodes[node]
        style = [s for s in ("dashed" if attrs.get("template") else "",
                             "filled" if attrs.get("state") in _STATE_COLOURS else "") if s]
        extra = f', style="{",".join(style)}"' if style else ""
        if attrs.get("state") in _STATE_COLOURS:
            extra += f', fillcolor="{_STATE_COLOURS[attrs["state"]]}"'
        label = _dot_text(node + "\n" + describe(attrs))
        lines.append(f"    {_dot_text(node)} [label={label}, shape={_DOT_SHAPES[attrs['kind']]}{extra}];")
    for u, v in _ordered_edges(graph):
        style = " [style=dotted]" if graph.edges[u, v].get("control") else ""
        lines.append(f"    {_dot_text(u)} -> {_dot_text(v)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_json(graph: nx.DiGraph) -> dict[str, Any]:
    """The graph as JSON (what a server or a web page draws): nodes in declaration order with
    kind and a one-line description (plus the tool of a tool node; the question, as its template,
    and the JSON schema of a wait_for node; template for a fan-out body not yet expanded, state on
    a run's graph; a branch's cases, in the order they are tried), and edges (control: a branch
    decision -> case)."""
    return {"nodes": [node_json(graph, n) for n in _ordered(graph)],
            "edges": [edge_json(graph, u, v) for u, v in _ordered_edges(graph)]}


def node_json(graph: nx.DiGraph, node: str) -> dict[str, Any]:
    """One node of to_json."""
    attrs = graph.nodes[node]
    entry: dict[str, Any] = {"id": node, "kind": attrs["kind"], "label": describe(attrs)}
    if attrs["kind"] == "tool":
        entry["tool"] = attrs["spec"].tool
    if attrs["kind"] == "wait_for":
        spec = attrs["spec"]
        entry.update(schema=dict(spec.schema), prompt=spec.prompt.text if spec.prompt is not None else None)
    if attrs["kind"] == "branch":
        entry["cases"] = [_case_json(c) for c in attrs["spec"].cases]
    if attrs.get("template"):
        entry["template"] = True
    if "state" in attrs:
        entry["state"] = attrs["state"]
    return entry


def edge_json(graph: nx.DiGraph, u: str, v: str) -> dict[str, Any]:
    """One edge of to_json."""
    return {"source": u, "target": v, **({"control": True} if graph.edges[u, v].get("control") else {})}


def graph_delta(graph: nx.DiGraph, nodes: frozenset[str], edges: frozenset[tuple[str, str]]) -> dict[str, Any]:
    """What changed since a graph had these nodes and edges: {nodes, edges} added (in to_json's
    order) and the ids of nodes removed (their edges go with them). Costs the change, not the
    graph, in JSON: a fan-out expanding item by item sends each item once."""
    order = lambda n: graph.nodes[n]["order"]  # noqa: E731
    added = sorted((n for n in graph if n not in nodes), key=order)
    new_edges = sorted((e for e in graph.edges if e not in edges), key=lambda e: (order(e[1]), order(e[0])))
    return {"nodes": [node_json(graph, n) for n in added], "edges": [edge_json(graph, u, v) for u, v in new_edges],
            "removed": sorted(n for n in nodes if n not in graph)}


def _case_json(case: Case) -> dict[str, Any]:
    """How a case matches (equals a key, a predicate by its name, or default) and what it gives:
    its result reference or its constant. A predicate is code: only its name is shown."""
    when = {"default": True} if case.is_default else \
        {"predicate": predicate_name(case.predicate)} if case.predicate is not None else {"equals": case.key}
    gives = {"constant": case.result.value} if isinstance(case.result, Constant) else {"result": str(case.result)}
    return {"label": case.label, **when, **gives}
