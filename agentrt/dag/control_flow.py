"""How control nodes rewrite a run's live graph: a fan-out copies its body once per item, a
branch keeps the case its value picks, an agent loop adds its next LLM or tool step. Mixed into
ProgramRun, which owns the graph and the values these read (`graph`, `spec`, `_values`) and the
outcomes they report (`_finish`, `_die`, `_resolve_for`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from agentrt.dag.refs import Ref, type_name
from agentrt.dag.specs import ItemSpec, NodeSpec, PredicateError, ToolSpec

PREVIEW_CHARS = 200  # of a value quoted in an error


class ControlFlow:
    def _expand(self, node: str) -> None:
        """Fan-out: copy the template body once per item ("<id>[i].<local>"), drop the templates."""
        spec = self.spec(node)
        items = self._resolve_for(node, spec.over)
        if not isinstance(items, list):
            self._die(node, f"over {spec.over!s} is {type_name(items)}, not a list")
        self._expand_items(node, items)
        self.graph.remove_nodes_from([n for n in self.graph if n.startswith(spec.body)])
        self.graph.nodes[node]["width"] = len(items)

    def _expand_items(self, node: str, items: list[Any]) -> None:
        """The branches of the items not expanded yet (items streamed earlier got theirs then)."""
        spec, attrs = self.spec(node), self.graph.nodes[node]
        done = attrs.setdefault("expanded", [])
        if items[: len(done)] != done:
            self._die(node, f"over {spec.over!s} differs from the items it streamed")
        templates = [n for n in self.graph if n.startswith(spec.body)]
        inside = set(templates)
        edges = [(u, v, d) for u, v, d in self.graph.edges(data=True) if u in inside or v in inside]
        for i, item in enumerate(items[len(done):], len(done)):
            rename = self._branch_rename(spec, i)
            for t in templates:
                attrs = self.graph.nodes[t]
                new_spec = attrs["spec"].renamed(rename)
                if isinstance(new_spec, ItemSpec) and new_spec.fan_out == node:
                    new_spec = replace(new_spec, index=i)
                new_id = rename(t)
                self.graph.add_node(new_id, **{**attrs, "spec": new_spec, "order": attrs["order"] + (i,),
                                               "template": "[*]" in new_id,
                                               "gates": tuple(rename(g) for g in attrs["gates"])})
                if new_spec.kind == "item" and new_spec.fan_out == node:
                    self._finish(new_id, item)
            self.graph.add_edges_from((rename(u), rename(v), d) for u, v, d in edges)
        done.extend(items[len(done):])

    @staticmethod
    def _branch_rename(spec: Any, index: int) -> Callable[[str], str]:
        old, new = spec.body, spec.branch_prefix(index)
        return lambda s: new + s[len(old):] if s.startswith(old) else s

    def _choose(self, node: str) -> None:
        """Branch: keep the case matching `on`, remove the others, open the kept case's gate. A
        case predicate that fails fails the branch, naming the case."""
        spec = self.spec(node)
        value = self._resolve_for(node, spec.on)
        try:
            case = spec.case_for(value)
        except PredicateError as e:
            self._die(node, f"{e} (on {spec.on!s} = {_preview(value)})")
        if case is None:
            labels = ", ".join(c.label for c in spec.cases)
            self._die(node, f"{spec.on!s} = {value!r} matches no case ({labels}) and there is no default")
        for other in spec.cases:
            if other is not case:
                self.graph.remove_nodes_from([n for n in self.graph if n.startswith(other.prefix)])
        for n in self.graph:
            if n.startswith(case.prefix):
                attrs = self.graph.nodes[n]
                attrs["gates"] = tuple(g for g in attrs["gates"] if g != case.prefix)
        self.graph.nodes[node]["case"] = case.label
        result = [case.result.node] if isinstance(case.result, Ref) else []  # a Constant is known already
        self._rewire(node, [spec.on.node, *result])

    def _start_loop(self, loop: str) -> None:
        spec = self.spec(loop)
        first = spec.step_spec(1, ())
        self._add_step(loop, first, (1, 0), [u.ref.node for u in first.refs()])
        self.graph.nodes[loop].update(llm_steps=1, tool_steps=0)

    def _advance_loop(self, loop: str, node: str) -> None:
        """After a loop step: a text answer ends the loop; a step's calls add its tool nodes (one
        per call); a tool result adds the next LLM step (with parallel calls, once every call of
        the step has ended). The loop's attribute "ended" says how it ended (see _end_loop;
        "exceeded_max_steps": the last step called a tool, under on_max_steps="error")."""
        spec, attrs, step_spec = self.spec(loop), self.graph.nodes[loop], self.spec(node)
        if step_spec.kind == "llm":
            step = len(step_spec.history) + 1
            value = self._values[node]
            calls = step_calls(value)
            if not calls:
                self._end_loop(loop, step, value if isinstance(value, str) else value["text"])
            elif step >= spec.max_steps:
                attrs["ended"] = "exceeded_max_steps"
                names = ", ".join(f"'{c['name']}'" for c in calls)
                self._die(loop, f"no final answer after max_steps={spec.max_steps}: step {step} called {names}")
            else:
                for i, call in enumerate(calls):
                    if spec.call_id(step, i) not in self.graph:  # else added as the call streamed
                        self._add_tool_step(loop, node, step, i, call["name"])
                if spec.parallel_calls:  # the calls may all have ended already (started early)
                    self._next_step_after_calls(loop, step)
            return
        llm = step_spec.args.node
        step = len(self.spec(llm).history) + 1
        if spec.parallel_calls:
            self._next_step_after_calls(loop, step)
            return
        history = self.spec(llm).history + ((llm, node),)
        # a tool step started early may end before its LLM step: the next step reads both
        preds = [node] if self._is_done(llm) else [llm, node]
        self._add_step(loop, spec.step_spec(step + 1, history), (step + 1, 0), preds)
        attrs["llm_steps"] += 1

    def _next_step_after_calls(self, loop: str, step: int) -> None:
        """Parallel calls: the next LLM step, once step `step` has ended (no call may follow) and
        every one of its calls has ended too. It reads their results in the order made."""
        spec = self.spec(loop)
        llm = spec.step_id(step, "llm")
        if not self._is_done(llm) or spec.step_id(step + 1, "llm") in self.graph:
            return
        tools = [spec.call_id(step, i) for i in range(len(step_calls(self._values[llm])))]
        if all(t in self.graph and self._is_done(t) for t in tools):
            history = self.spec(llm).history + ((llm, *tools),)
            self._add_step(loop, spec.step_spec(step + 1, history), (step + 1, 0), tools)
            self.graph.nodes[loop]["llm_steps"] += 1

    def _early_loop_tool(self, loop: str, node: str, index: int, name: str) -> None:
        """LLM step `node` is still writing, but its call `index` (to tool `name`) is known: add
        that call's tool node now, so that it can start before the step ends. Not at max_steps: a
        call there ends the loop (_advance_loop)."""
        step = len(self.spec(node).history) + 1
        if step < self.spec(loop).max_steps and self.spec(loop).call_id(step, index) not in self.graph:
            self._add_tool_step(loop, node, step, index, name)

    def _add_tool_step(self, loop: str, node: str, step: int, index: int, name: str) -> None:
        spec = self.spec(loop)
        args = Ref(node, ("calls", index)) if spec.parallel_calls else Ref(node)
        tool = ToolSpec(spec.call_id(step, index), name, args, args_from_call=True, errors_to_output=True, loop=loop)
        self._add_step(loop, tool, (step, 1 + index), [node])
        self.graph.nodes[loop]["tool_steps"] += 1

    def _end_loop(self, loop: str, step: int, answer: str) -> None:
        """The text answer of step `step` ends the loop: "ended" is "answered" (the model chose
        to) or "answered_at_max_steps" (the step had to); the value is the answer, or with
        output="detail" the answer and how the loop went (AgentLoopSpec.detail_schema)."""
        spec, attrs = self.spec(loop), self.graph.nodes[loop]
        attrs["ended"] = spec.ended_at(step)
        if spec.output == "text":
            self._finish(loop, answer)
            return
        calls = []
        for k in range(1, step):
            for i, call in enumerate(step_calls(self._values[spec.step_id(k, "llm")])):
                tool = spec.call_id(k, i)
                calls.append({"name": call["name"], "arguments": call["arguments"],
                              "ok": "error" not in self.graph.nodes[tool],  # ProgramRun.fail marks a failed step
                              **({"step": k} if spec.parallel_calls else {})})
        self._finish(loop, {"answer": answer, "ended": attrs["ended"], "steps": attrs["llm_steps"],
                            "tool_calls": calls})

    def _add_step(self, loop: str, spec: NodeSpec, order: tuple[int, int], preds: list[str]) -> None:
        loop_attrs = self.graph.nodes[loop]
        self.graph.add_node(spec.id, kind=spec.kind, spec=spec, order=loop_attrs["order"] + order,
                            template=False, gates=(), state="pending")
        self.graph.add_edges_from((p, spec.id) for p in preds)
        self._rewire(loop, [spec.id])

    def _rewire(self, node: str, preds: list[str]) -> None:
        self.graph.remove_edges_from(list(self.graph.in_edges(node)))
        self.graph.add_edges_from((p, node) for p in preds)


def step_calls(value: Any) -> list[dict[str, Any]]:
    """The calls a loop step's (checked) value makes, in order: [] for a text answer."""
    if isinstance(value, str):
        return []
    if "calls" in value:
        return value["calls"]
    return [value] if value.get("name") is not None else []


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "..."
