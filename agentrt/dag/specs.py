"""Node specs: the plain-data attribute `spec` of each graph node, one frozen dataclass per kind.

Every spec has `id` (its node id), `kind`, `refs()` (the outputs it reads) and `renamed(fn)`
(the same spec with node ids mapped by fn, used when a fan-out body is copied per item).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Iterator, Literal, Mapping

from agentrt.dag.outputs import OutputSpec, ToolCall
from agentrt.dag.refs import Ref, Template
from agentrt.dag.tooldefs import ToolDef
from agentrt.retry import RetryPolicy

Rename = Callable[[str], str]
# The kinds of node the runtime carries out (each gets a lane, a span, events); the run itself
# completes the others (inputs, items, fan-outs, branches, agent loops).
EXEC_KINDS = ("llm", "tool", "wait_for")


@dataclass(frozen=True)
class RefUse:
    """One reference read by a node: where it appears, and the scope it is read in (None: the
    node's own scope; a body prefix for a fan-out or case result)."""

    where: str
    ref: Ref
    scope: str | None = None


def template_refs(where: str, t: Template | None) -> Iterator[RefUse]:
    if t is not None and t.refs is not None:
        for r in t.refs:
            yield RefUse(f"{where} placeholder {{{r!s}}}", r)


def walk_args(value: Any, where: str) -> Iterator[tuple[str, Ref | Template]]:
    """Refs and Templates inside a (possibly nested) tool-argument value."""
    if isinstance(value, (Ref, Template)):
        yield where, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from walk_args(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from walk_args(v, f"{where}[{i}]")


def map_args(value: Any, fn: Callable[[Ref | Template], Any]) -> Any:
    if isinstance(value, (Ref, Template)):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_args(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_args(v, fn) for v in value]
    return value


@dataclass(frozen=True)
class InputSpec:
    id: str
    type: str  # JSON type name: string, integer, number, boolean, array, object
    kind: ClassVar[str] = "input"

    def refs(self) -> list[RefUse]:
        return []

    def renamed(self, rename: Rename) -> InputSpec:
        return replace(self, id=rename(self.id))


@dataclass(frozen=True)
class LLMSpec:
    """One LLM call: user `prompt` (+ `system`), producing `output`. Loop steps also carry `loop`
    (the agent_loop id) and `history`: per earlier step, (its llm node, its tool nodes...) (one
    tool node per call: several when the loop allows parallel calls).
    `continues`: the id of an earlier LLM call whose conversation (its messages and its reply)
    comes before this call's prompt, as the next user turn (the call then has no system of its own)."""

    id: str
    prompt: Template
    system: Template | None
    output: OutputSpec
    max_tokens: int
    temperature: float
    loop: str | None = None
    history: tuple[tuple[str, ...], ...] = ()
    continues: str | None = None
    sampling: tuple[tuple[str, Any], ...] = ()  # further sampling settings (penalties, top_p, ...), sorted
    kind: ClassVar[str] = "llm"

    def refs(self) -> list[RefUse]:
        if self.history:  # a later loop step reads the chain before it (and, through it, the prompt)
            return [RefUse("previous step", Ref(tool)) for tool in self.history[-1][1:]]
        earlier = [RefUse("continues", Ref(self.continues))] if self.continues else []
        return [*earlier, *template_refs("system", self.system), *template_refs("prompt", self.prompt)]

    def renamed(self, rename: Rename) -> LLMSpec:
        return replace(self, id=rename(self.id), prompt=self.prompt.renamed(rename),
                       system=self.system.renamed(rename) if self.system else None,
                       loop=rename(self.loop) if self.loop else None,
                       history=tuple(tuple(map(rename, entry)) for entry in self.history),
                       continues=rename(self.continues) if self.continues else None)


@dataclass(frozen=True)
class ToolSpec:
    """One tool call. `args` is a dict of values (Ref, Template, literal, nested) or one Ref to the
    whole argument dict; `args_from_call` marks a Ref to a ToolCall output (its "arguments").
    `has_fallback`: a failure makes `fallback` the output. `errors_to_output` (agent-loop steps):
    a failure makes {"error": message} the output, for the model to read. `retry`: the node's
    RetryPolicy, laid over the tool's own (None: the tool's)."""

    id: str
    tool: str
    args: Mapping[str, Any] | Ref
    has_fallback: bool = False
    fallback: Any = None
    args_from_call: bool = False
    errors_to_output: bool = False
    loop: str | None = None
    retry: RetryPolicy | None = None
    kind: ClassVar[str] = "tool"

    def refs(self) -> list[RefUse]:
        uses = []
        for where, item in walk_args(self.args, "args"):
            if isinstance(item, Ref):
                uses.append(RefUse(where, item))
            else:
                uses.extend(template_refs(where, item))
        return uses

    def renamed(self, rename: Rename) -> ToolSpec:
        return replace(self, id=rename(self.id), args=map_args(self.args, lambda v: v.renamed(rename)),
                       loop=rename(self.loop) if self.loop else None)


@dataclass(frozen=True)
class WaitForSpec:
    """A value from outside the program (Program.wait_for): nothing runs for it; the run waits
    until someone gives a value valid against the JSON schema `schema`. `prompt` (a template over
    earlier outputs) is the question shown to whoever answers."""

    id: str
    schema: Mapping[str, Any]
    prompt: Template | None = None
    kind: ClassVar[str] = "wait_for"

    def refs(self) -> list[RefUse]:
        return list(template_refs("prompt", self.prompt))

    def renamed(self, rename: Rename) -> WaitForSpec:
        return replace(self, id=rename(self.id), prompt=self.prompt.renamed(rename) if self.prompt else None)


@dataclass(frozen=True)
class ItemSpec:
    """The current item of a fan-out branch: `over[index]`, set when the fan-out expands."""

    id: str
    fan_out: str
    over: Ref
    index: int | None = None
    kind: ClassVar[str] = "item"

    def refs(self) -> list[RefUse]:
        return [RefUse("over", self.over)]

    def renamed(self, rename: Rename) -> ItemSpec:
        return replace(self, id=rename(self.id), fan_out=rename(self.fan_out), over=self.over.renamed(rename))


@dataclass(frozen=True)
class FanOutSpec:
    """Run the body (nodes under prefix `body`, e.g. "research[*].") once per item of `over`;
    the output is the list of each branch's `result`, in item order (the fan-in)."""

    id: str
    over: Ref
    body: str
    result: Ref
    kind: ClassVar[str] = "fan_out"

    def refs(self) -> list[RefUse]:
        return [RefUse("over", self.over), RefUse("body result", self.result, self.body)]

    def renamed(self, rename: Rename) -> FanOutSpec:
        return replace(self, id=rename(self.id), over=self.over.renamed(rename), body=rename(self.body),
                       result=self.result.renamed(rename))

    def branch_prefix(self, index: int) -> str:
        return f"{self.id}[{index}]."


Predicate = Callable[[Any], bool]


@dataclass(frozen=True)
class Constant:
    """A fixed JSON value as a branch case's result, so that a case which only has to say
    something ("no action needed") needs no node to say it. Any case body that is not a function
    is taken as a constant; write Constant(None) for a null `default=` (default=None means none)."""

    value: Any


class PredicateError(Exception):
    """A case predicate raised, or answered something other than a bool; `label` names the case."""

    def __init__(self, label: str, reason: str) -> None:
        super().__init__(f"case {label}: {reason}")
        self.label = label
        self.reason = reason


@dataclass(frozen=True)
class Case:
    """One case of a branch: taken when `on` equals `key`, or when `predicate(value)` is True (or,
    if is_default, when no other case is). Its nodes live under `prefix` (e.g. "route?yes.");
    `result` is the branch output: a Ref to one of them, or a Constant (then the case has none)."""

    key: Any
    label: str
    prefix: str
    result: Ref | Constant
    is_default: bool = False
    predicate: Predicate | None = None

    @property
    def is_equality(self) -> bool:
        return not self.is_default and self.predicate is None

    def matches(self, value: Any) -> bool:
        """Raises PredicateError when the predicate raises or answers a non-bool."""
        if self.predicate is not None:
            return self._ask(value)
        # JSON semantics: true is not 1.
        return self.is_equality and isinstance(value, bool) == isinstance(self.key, bool) and value == self.key

    def _ask(self, value: Any) -> bool:
        """The predicate's answer on its own copy of the value: whatever it does to it, the run's
        values (and what later predicates see) stay as they were."""
        name = predicate_name(self.predicate)
        try:
            answer = self.predicate(copy.deepcopy(value))
        except Exception as e:  # the author's code: whatever it raises fails the branch, not the process
            raise PredicateError(self.label, f"predicate {name} raised {type(e).__name__}: {e}") from e
        if not isinstance(answer, bool):
            raise PredicateError(self.label, f"predicate {name} returned {answer!r}, not a bool")
        return answer

    def renamed(self, rename: Rename) -> Case:
        result = self.result.renamed(rename) if isinstance(self.result, Ref) else self.result
        return replace(self, prefix=rename(self.prefix), result=result)


def predicate_name(predicate: Any) -> str:
    """How a predicate is shown: its function name, "<lambda>", or its type for other callables."""
    return getattr(predicate, "__name__", None) or type(predicate).__name__


@dataclass(frozen=True)
class BranchSpec:
    """Take the first case (in declaration order) whose key equals the value of `on` or whose
    predicate accepts it, else the default; the output is that case's result."""

    id: str
    on: Ref
    cases: tuple[Case, ...]
    kind: ClassVar[str] = "branch"

    def refs(self) -> list[RefUse]:
        return [RefUse("on", self.on),
                *(RefUse(f"case {c.label} result", c.result, c.prefix) for c in self.cases
                  if isinstance(c.result, Ref))]

    def renamed(self, rename: Rename) -> BranchSpec:
        return replace(self, id=rename(self.id), on=self.on.renamed(rename),
                       cases=tuple(c.renamed(rename) for c in self.cases))

    def case_for(self, value: Any) -> Case | None:
        """The case taken for `value`; raises PredicateError as Case.matches does."""
        found = next((c for c in self.cases if c.matches(value)), None)
        return found or next((c for c in self.cases if c.is_default), None)


LOOP_CHOICES = ("auto", "required", "required_first")  # agent_loop(tool_choice=...), besides a tool's name
LOOP_OUTPUTS = ("text", "detail")


@dataclass(frozen=True)
class AgentLoopSpec:
    """A bounded agent loop: step k is an LLM call (id "<loop>#k.llm") that picks one of `tools`
    or answers in text; a tool pick runs as "<loop>#k.tool" and its result (or error) goes back to
    the model. At most `max_steps` LLM steps; with on_max_steps="answer" the last step must answer
    in text, with "error" a tool pick at the last step ends the run with an error.

    tool_choice: which steps before that last one must call a tool (the grammar forbids text):
    none ("auto"), step 1 ("required_first"), all of them ("required"), or step 1 and only the
    named tool (a tool's name). Every step describes all the tools alike (ToolCall.choice).
    output: "text" (the answer) or "detail" (the answer and how the loop ended: detail_schema()).
    parallel_calls: a step may make several calls in one turn (ToolCall.parallel); call i of step
    k runs as "<loop>#k.tool[i]", and the next step follows once all of them have ended.
    """

    id: str
    prompt: Template
    system: Template | None
    tools: tuple[str, ...]
    max_steps: int
    max_tokens: int
    temperature: float
    on_max_steps: Literal["answer", "error"] = "answer"
    definitions: tuple[ToolDef, ...] = ()
    tool_choice: str = "auto"
    output: Literal["text", "detail"] = "text"
    sampling: tuple[tuple[str, Any], ...] = ()  # every step's further sampling settings (LLMSpec.sampling)
    parallel_calls: bool = False
    kind: ClassVar[str] = "agent_loop"

    def refs(self) -> list[RefUse]:
        return [*template_refs("system", self.system), *template_refs("prompt", self.prompt)]

    def renamed(self, rename: Rename) -> AgentLoopSpec:
        return replace(self, id=rename(self.id), prompt=self.prompt.renamed(rename),
                       system=self.system.renamed(rename) if self.system else None)

    def step_id(self, step: int, part: Literal["llm", "tool"]) -> str:
        return f"{self.id}#{step}.{part}"

    def call_id(self, step: int, index: int) -> str:
        """The tool node of call `index` (from 0) of step `step`."""
        return f"{self.id}#{step}.tool[{index}]" if self.parallel_calls else self.step_id(step, "tool")

    def forces_answer(self, step: int) -> bool:
        """Whether step `step` must answer in text: the last one, with on_max_steps="answer"."""
        return step == self.max_steps and self.on_max_steps == "answer"

    def step_choice(self, step: int) -> str:
        """The ToolCall choice of step `step`."""
        if self.forces_answer(step):
            return "none"
        if self.tool_choice == "required":
            return "required" if step < self.max_steps else "auto"
        if self.tool_choice != "auto" and step == 1:
            return "required" if self.tool_choice == "required_first" else self.tool_choice
        return "auto"

    def step_output(self, step: int) -> OutputSpec:
        # Every step describes the tools and that text may answer (the last step's tools stay
        # described, not callable): each step's prompt starts as the step before's did.
        return ToolCall(self.tools, allow_text=True, definitions=self.definitions, choice=self.step_choice(step),
                        parallel=self.parallel_calls)

    def step_spec(self, step: int, history: tuple[tuple[str, ...], ...]) -> LLMSpec:
        return LLMSpec(self.step_id(step, "llm"), self.prompt, self.system, self.step_output(step),
                       self.max_tokens, self.temperature, loop=self.id, history=history, sampling=self.sampling)

    def ended_at(self, step: int) -> str:
        """How a text answer at step `step` ends the loop: "answered_at_max_steps" if that step
        had to answer, else "answered" (the model chose to)."""
        return "answered_at_max_steps" if self.forces_answer(step) else "answered"

    def possible_ends(self) -> tuple[str, ...]:
        """The ways this loop can end with an answer. Steps 2 .. max_steps-1 all have the same
        choice, so steps 1, 2, max_steps-1 and max_steps stand for them all."""
        steps = {s for s in (1, 2, self.max_steps - 1, self.max_steps) if 1 <= s <= self.max_steps}
        ends = {self.ended_at(s) for s in steps if self.step_choice(s) in ("auto", "none")}
        return tuple(e for e in ("answered", "answered_at_max_steps") if e in ends)

    def value_schema(self) -> dict[str, Any]:
        return {"type": "string"} if self.output == "text" else self.detail_schema()

    def detail_schema(self) -> dict[str, Any]:
        """output="detail": the answer, how the loop ended, its LLM steps and its tool calls, in the
        order made (ok: the tool returned; False when its error went back to the model; with
        parallel_calls, step: the LLM step that made the call)."""
        props = {"name": {"enum": list(self.tools)}, "arguments": {"type": "object"}, "ok": {"type": "boolean"}}
        if self.parallel_calls:
            props["step"] = {"type": "integer", "minimum": 1, "maximum": max(1, self.max_steps - 1)}
        call = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
        calls = {"type": "array", "items": call}
        if not self.parallel_calls:  # one call per step but the last
            calls["maxItems"] = self.max_steps - 1
        return {"type": "object",
                "properties": {"answer": {"type": "string"}, "ended": {"enum": list(self.possible_ends())},
                               "steps": {"type": "integer", "minimum": 1, "maximum": self.max_steps},
                               "tool_calls": calls},
                "required": ["answer", "ended", "steps", "tool_calls"], "additionalProperties": False}


NodeSpec = InputSpec | LLMSpec | ToolSpec | WaitForSpec | ItemSpec | FanOutSpec | BranchSpec | AgentLoopSpec


@dataclass(frozen=True)
class Decl:
    """A node as the builder declared it, before compile() resolves its names."""
    spec: NodeSpec
    order: int  # declaration order (compile keeps it for ids and errors)
    site: str = ""  # file:line of the program author's code that declared it
