"""ProgramRun: the live graph of one execution. It executes nothing itself: the runtime runs the
LLM and tool nodes that `ready()` lists and reports back with `complete()` / `fail()`; the run
does the plumbing (inputs, fan-in, and through ControlFlow fan-out expansion, branch choice and
agent-loop steps) and the graph shows each expansion as it happens.
"""
from __future__ import annotations

import copy
from collections import ChainMap
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

import networkx as nx

from agentrt.dag import analysis, export
from agentrt.dag.control_flow import ControlFlow
from agentrt.dag.outputs import ToolCall
from agentrt.dag.refs import Ref, resolve, type_name
from agentrt.dag.specs import EXEC_KINDS, Constant, NodeSpec, ToolSpec
from agentrt.errors import ProgramRunError

if TYPE_CHECKING:
    from agentrt.dag.compiled import CompiledProgram

_PY_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


class ProgramRun(ControlFlow):
    """One execution of a compiled program (make it with `program.start(inputs)`).

    The runtime loop: take nodes from `ready()` (LLM calls, tool calls and waits for outside
    input whose inputs are all done),
    optionally `begin(node)`, run them (render_prompt / tool_arguments give what to send), then
    `complete(node, value)` or `fail(node, error)`. Each returns the nodes that became ready.
    `status` is "running", "done" (then `result` holds the output) or "failed" (then `error`, a
    ProgramRunError naming the node, was raised by the call that failed).

    Node states (attribute "state"): pending, running, done, failed.
    An LLM value is the text (Text), the parsed JSON (JsonSchema), or {"name", "arguments"} /
    {"text"} (ToolCall). A tool failure with a declared fallback makes the fallback the value;
    in an agent loop it makes {"error": message} the value, for the model to read.

    >>> from agentrt.dag import Program, render_prompt
    >>> p = Program("demo", inputs={"city": str}, tools=[{"name": "get_weather", "parameters": {
    ...     "type": "object", "properties": {"city": {"type": "string"}}}}])
    >>> w = p.tool("weather", "get_weather", args={"city": p.input("city")}, fallback="no forecast")
    >>> p.output(p.llm("tip", prompt="Packing tip for {city}, given {weather}"))
    >>> run = p.compile().start({"city": "Oslo"})
    >>> run.ready()
    ['weather']
    >>> run.fail("weather", TimeoutError("weather API timed out"))
    ['tip']
    >>> render_prompt(run.spec("tip"), run.values)[0]["content"]
    'Packing tip for Oslo, given no forecast'
    >>> run.complete("tip", "Bring a coat.")
    []
    >>> run.status, run.result
    ('done', 'Bring a coat.')
    """

    def __init__(self, program: CompiledProgram, inputs: Mapping[str, Any]) -> None:
        self.program = program
        self.graph: nx.DiGraph = program.graph.copy()  # a plain (unfrozen) copy with its own attr dicts
        for node in self.graph:
            self.graph.nodes[node]["state"] = "pending"
        self._values: dict[str, Any] = {}
        self._partial: dict[str, dict[str, Any] | list[Any]] = {}  # see stream()
        self.status = "running"
        self.error: ProgramRunError | None = None
        self._result: Any = None
        for name, typ in program.inputs.items():
            if name not in inputs:
                raise ProgramRunError(name, f"missing input of program '{program.name}'")
            if not _PY_TYPES[typ](inputs[name]):
                raise ProgramRunError(name, f"input must be {typ}, got {type_name(inputs[name])}")
        for name in inputs:
            if name not in program.inputs:
                raise ProgramRunError(name, f"not an input of program '{program.name}' "
                                            f"(inputs: {', '.join(program.inputs) or 'none'})")
        for name in program.inputs:
            self._finish(name, inputs[name])
        self._settle()

    # -- what the runtime reads --

    @property
    def values(self) -> Mapping[str, Any]:
        """Outputs of the finished nodes, by node id (read-only)."""
        return MappingProxyType(self._values)

    @property
    def known(self) -> Mapping[str, Any]:
        """values, and for LLM nodes still generating the members of their output that are
        final already (see stream()): what a node started early reads its arguments from."""
        return MappingProxyType(ChainMap(self._values, self._partial))

    @property
    def result(self) -> Any:
        if self.status != "done":
            raise ProgramRunError(self.program.name, f"run is {self.status}: no result")
        return self._result

    def spec(self, node: str) -> NodeSpec:
        return self._attrs(node)["spec"]

    def ready(self) -> list[str]:
        """Pending LLM, tool and wait_for nodes whose inputs are all done, in declaration order."""
        if self.status != "running":
            return []
        return [n for n in self._ordered() if self._is_ready(n)]

    def remaining_calls(self, *, fan_out_width: int = 1) -> analysis.CallCount:
        """LLM and tool calls not done yet, counted as CompiledProgram.remaining_calls does."""
        return analysis.remaining_calls(self.graph, self._is_done, fan_out_width)

    def critical_path_length(self, from_node: str | None = None, weights: Mapping[str, float] | None = None) -> float:
        """Longest weighted path of work left (done nodes weigh 0); see CompiledProgram."""
        return analysis.critical_path_length(self.graph, self._is_done, from_node, weights)

    def to_mermaid(self) -> str:
        return export.to_mermaid(self.graph)

    def to_json(self) -> dict[str, Any]:
        """The live graph as JSON (export.to_json): expansions so far, each node's state."""
        return export.to_json(self.graph)

    def graph_delta(self, nodes: frozenset[str], edges: frozenset[tuple[str, str]]) -> dict[str, Any]:
        """What the graph gained and lost since it had these nodes and edges (export.graph_delta)."""
        return export.graph_delta(self.graph, nodes, edges)

    def to_dot(self) -> str:
        return export.to_dot(self.graph)

    # -- what the runtime reports --

    def begin(self, node: str) -> None:
        """Mark a ready node running (it leaves ready())."""
        self._check_callable(node)
        if not self._is_ready(node):
            raise ProgramRunError(node, f"not ready ({self._why_not_ready(node)})")
        self.graph.nodes[node]["state"] = "running"

    def complete(self, node: str, value: Any) -> list[str]:
        """Record the output of an LLM or tool node, or the value a wait_for node was given;
        returns the nodes that became ready.
        An LLM value that does not fit the node's output spec ends the run with an error."""
        self._check_callable(node)
        spec = self.spec(node)
        if spec.kind == "llm":
            try:
                value = spec.output.check(value)
            except ValueError as e:
                self._die(node, f"output rejected: {e}")
        return self._accept(node, value)

    def fail(self, node: str, error: BaseException | str) -> list[str]:
        """Report that an LLM or tool call failed. A tool with a fallback (or an agent-loop tool
        step) takes its fallback value and the run goes on; otherwise the run fails and the
        ProgramRunError naming the node is raised."""
        self._check_callable(node)
        spec = self.spec(node)
        message = str(error) or type(error).__name__
        if isinstance(spec, ToolSpec) and (spec.errors_to_output or spec.has_fallback):
            self.graph.nodes[node]["error"] = message
            return self._accept(node, {"error": message} if spec.errors_to_output else spec.fallback)
        self._die(node, f"{'wait for input' if spec.kind == 'wait_for' else spec.kind + ' call'} failed: {message}")

    def stream(self, node: str, members: list[tuple[str | int, Any]]) -> None:
        """Record top-level members of a running LLM node's JSON output that are final already
        (the output text only grows): object members (key, value) or list items (index, value),
        in order. A tool node that reads only such members of it becomes ready before the node
        ends, and a fan-out over the node's list (or over a list member of it) grows a branch
        per final item. complete() checks that the whole output agrees with what was streamed.
        (LLMCompiler-style streaming: a tool's latency overlaps the rest of the generation.)"""
        self._check_callable(node)
        if self.graph.nodes[node]["state"] != "running" or self.spec(node).kind != "llm":
            raise ProgramRunError(node, "only a running LLM node streams its output")
        if not members:
            return
        part = self._partial.setdefault(node, [] if isinstance(members[0][0], int) else {})
        for key, value in members:
            if isinstance(part, list) and key == len(part):
                part.append(value)
            elif isinstance(part, dict) and isinstance(key, str):
                part[key] = value
            else:
                self._die(node, f"streamed member {key!r} does not continue its output")
        for fan in self._ordered():
            attrs = self.graph.nodes.get(fan)
            if attrs is None or attrs["kind"] != "fan_out" or "width" in attrs or attrs["template"] or attrs["gates"]:
                continue
            over = attrs["spec"].over
            if over.node == node and len(over.path) <= 1:
                items = part if not over.path else part.get(over.path[0]) if isinstance(part, dict) else None
                if isinstance(items, list):
                    self._expand_items(fan, items)

    def stream_call(self, node: str, call: dict[str, Any], index: int = 0) -> bool:
        """Record call `index` (from 0) of the turn a running ToolCall node is writing, once its
        arguments object has closed in the streamed output ({"name", "arguments"}: the
        StreamedCalls scanner's call). A tool node taking its args from the call (args_from_call)
        becomes ready, and in an agent loop the call's tool node is added now; the runtime starts
        only idempotent ones. A node without ToolCall(parallel=True) makes one call (index 0). A
        call the node's spec would reject (a tool it may not call), or one out of order, is not
        recorded: the output says why when it ends. complete() checks that the output makes
        these calls. Returns whether it was recorded."""
        spec = self.spec(node)
        output = getattr(spec, "output", None)
        if not isinstance(output, ToolCall) or output.choice == "none":
            return False
        try:
            checked = output.check_call(call)
        except ValueError:  # a call it may not make
            return False
        if output.parallel:
            made = self._partial.get(node, {}).get("calls", [])
            if index != len(made):
                return False
            self.stream(node, [("calls", [*made, checked])])
        elif index == 0:
            self.stream(node, [("name", checked["name"]), ("arguments", checked["arguments"])])
        else:
            return False
        if spec.loop is not None:
            self._early_loop_tool(spec.loop, node, index, checked["name"])
        return True

    # -- plumbing --

    def _accept(self, node: str, value: Any) -> list[str]:
        before = set(self.ready())
        self._finish(node, value)
        loop = getattr(self.spec(node), "loop", None)  # agent-loop steps (LLM and tool nodes) only
        if loop is not None:
            self._advance_loop(loop, node)
        self._settle()
        return [n for n in self.ready() if n not in before]

    def _settle(self) -> None:
        """Expand, choose and fan in until nothing changes; then check whether the output is done."""
        changed = True
        while changed and self.status == "running":
            changed = False
            for node in self._ordered():
                attrs = self.graph.nodes.get(node)
                if attrs is None or attrs["state"] != "pending" or attrs["template"] or attrs["gates"]:
                    continue
                changed |= self._step(node, attrs)
        # an LLM node still streaming (a tool started on its members may be the output) has yet
        # to show that its whole output agrees with what it streamed
        if self.status == "running" and not self._partial and all(self._is_done(n) for n in self.program.output_nodes()):
            out = self.program.output
            self._result = self._resolve_for(out.node, out) if isinstance(out, Ref) else \
                {k: self._resolve_for(r.node, r) for k, r in out.items()}
            self.status = "done"

    def _step(self, node: str, attrs: dict[str, Any]) -> bool:
        spec, kind = attrs["spec"], attrs["kind"]
        if kind == "fan_out" and "width" not in attrs:
            if not self._is_done(spec.over.node):
                return False
            self._expand(node)
            return True
        if kind == "branch" and "case" not in attrs:
            if not self._is_done(spec.on.node):
                return False
            self._choose(node)
            return True
        if kind == "agent_loop" and "llm_steps" not in attrs:
            self._start_loop(node)
            return True
        if kind in ("fan_out", "branch") and all(self._is_done(p) for p in self.graph.predecessors(node)):
            self._finish(node, self._collect(node, spec, attrs))
            return True
        return False

    def _collect(self, node: str, spec: Any, attrs: dict[str, Any]) -> Any:
        """Fan-in: the list of branch results in item order; branch: the taken case's result (a
        constant's own copy: the spec is shared by every run of the program)."""
        if attrs["kind"] == "fan_out":
            return [self._resolve_for(node, spec.result.renamed(self._branch_rename(spec, i)))
                    for i in range(attrs["width"])]
        case = next(c for c in spec.cases if c.label == attrs["case"])
        if isinstance(case.result, Constant):
            return copy.deepcopy(case.result.value)
        return self._resolve_for(node, case.result)

    def _resolve_for(self, node: str, ref: Ref) -> Any:
        try:
            return resolve(ref, self._values)
        except ProgramRunError as e:
            self._die(node, f"cannot read {ref!s}: {e.reason}")

    def _finish(self, node: str, value: Any) -> None:
        streamed = self._partial.pop(node, None)
        if streamed is not None and not _extends(value, streamed):
            call = ""
            if isinstance(streamed, dict) and self._is_call_node(node):
                names = [c["name"] for c in streamed.get("calls", [streamed])]
                call = (f" (the call{'s' if len(names) > 1 else ''} of {', '.join(map(repr, names))} it streamed when "
                        "the arguments closed: an idempotent tool may have started on it)")
            self._die(node, f"the output differs from the members it streamed{call}")
        self._values[node] = value
        self.graph.nodes[node]["state"] = "done"

    def _die(self, node: str, reason: str) -> None:
        self.status = "failed"
        if node in self.graph:
            self.graph.nodes[node]["state"] = "failed"
        self.error = ProgramRunError(node, reason)
        raise self.error

    # -- queries --

    def _attrs(self, node: str) -> dict[str, Any]:
        if node not in self.graph:
            raise ProgramRunError(node, "no such node in this run (not declared, not expanded yet, or in a case not taken)")
        return self.graph.nodes[node]

    def _check_callable(self, node: str) -> None:
        attrs = self._attrs(node)
        if self.status != "running":
            raise ProgramRunError(node, f"the run is {self.status}")
        if attrs["kind"] not in EXEC_KINDS:
            raise ProgramRunError(node, f"is {attrs['kind']}: the run completes it itself")
        if attrs["state"] != "running" and not self._is_ready(node):
            raise ProgramRunError(node, f"not ready ({self._why_not_ready(node)})")

    def _is_done(self, node: str) -> bool:
        return self.graph.nodes[node]["state"] == "done"

    def _is_ready(self, node: str) -> bool:
        attrs = self.graph.nodes[node]
        if not (attrs["kind"] in EXEC_KINDS and attrs["state"] == "pending" and not attrs["template"]
                and not attrs["gates"]):
            return False
        waiting = [p for p in self.graph.predecessors(node) if not self._is_done(p)]
        return not waiting or (attrs["kind"] == "tool" and self._reads_streamed_only(node, waiting))

    def is_early(self, node: str) -> bool:
        """Ready (or running) before all its inputs finished: it reads members streamed so far."""
        return any(not self._is_done(p) for p in self.graph.predecessors(node))

    def _reads_streamed_only(self, node: str, waiting: list[str]) -> bool:
        """Every unfinished input of node is a streaming LLM node, and node reads only final
        top-level members of it (never the whole output)."""
        if any(p not in self._partial for p in waiting):
            return False
        read: set[str] = set()
        for use in self.spec(node).refs():
            ref = use.ref
            if ref.node in self._partial:
                part = self._partial[ref.node]
                if use.ref is self.spec(node).args and self._streamed_call_for(node, ref, part):
                    read.add(ref.node)
                    continue
                if not self._final_in_stream(ref, part):
                    return False
                read.add(ref.node)
        return read >= set(waiting)

    def _final_in_stream(self, ref: Ref, part: dict[str, Any] | list[Any]) -> bool:
        """Whether `ref` reads only what the node streamed so far, which is final: a top-level
        member or item, or in a parallel call turn (whose list of calls still grows) a call made."""
        if not ref.path:
            return False
        if isinstance(part, list):
            return isinstance(ref.path[0], int) and 0 <= ref.path[0] < len(part)
        if getattr(self.spec(ref.node).output, "parallel", False):
            index = ref.path[1] if len(ref.path) > 1 and ref.path[0] == "calls" else None
            return isinstance(index, int) and 0 <= index < len(part.get("calls", []))
        return ref.path[0] in part

    def _is_call_node(self, node: str) -> bool:
        return isinstance(getattr(self.spec(node), "output", None), ToolCall)

    def _streamed_call_for(self, node: str, ref: Ref, part: dict[str, Any] | list[Any]) -> bool:
        """A tool node taking its args from a call (args_from_call) reads a streamed call of its
        own tool whole: the call's arguments closed before it was streamed (stream_call). `ref`
        picks the call: the node's output (one call) or a call of its list (parallel calls)."""
        spec = self.spec(node)
        if not spec.args_from_call:
            return False
        call: Any = part
        if ref.path:
            if len(ref.path) != 2 or ref.path[0] != "calls" or not isinstance(part, dict):
                return False
            made, index = part.get("calls", []), ref.path[1]
            call = made[index] if isinstance(index, int) and 0 <= index < len(made) else None
        return isinstance(call, dict) and call.get("name") == spec.tool and isinstance(call.get("arguments"), dict)

    def _why_not_ready(self, node: str) -> str:
        attrs = self.graph.nodes[node]
        if attrs["state"] != "pending":
            return f"it is {attrs['state']}"
        if attrs["template"]:
            return "it is a fan-out template; its branches appear when the list is known"
        if attrs["gates"]:
            return f"its branch case {attrs['gates'][0][:-1]} is not decided"
        waiting = [p for p in self.graph.predecessors(node) if not self._is_done(p)]
        return f"waiting for {', '.join(waiting)}"

    def _ordered(self) -> list[str]:
        return sorted(self.graph, key=lambda n: self.graph.nodes[n]["order"])


def _extends(value: Any, streamed: dict[str, Any] | list[Any]) -> bool:
    """value has every streamed member, equal (a list: the streamed items are its first ones;
    a parallel call turn: the streamed calls are its first calls)."""
    if isinstance(streamed, list):
        return isinstance(value, list) and value[: len(streamed)] == streamed
    if isinstance(streamed.get("calls"), list) and isinstance(value, dict) and isinstance(value.get("calls"), list):
        return _extends(value["calls"], streamed["calls"])
    return isinstance(value, dict) and all(k in value and value[k] == v for k, v in streamed.items())
