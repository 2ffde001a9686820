"""The program builder: declare LLM calls, tool calls, fan-outs, branches and agent loops.

Each method checks what it can see alone (id syntax, duplicate ids, template syntax, JSON schema
validity, argument types; the checks are in declare.py) and raises ProgramValidationError at
once; what depends on the whole program (references, tools, cycles, types, reachability) is
checked by Program.compile().
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

from agentrt.dag.declare import (_case_label, _case_pairs, _check_case_labels, _check_extra_sampling,
                                  _check_json_value, _check_loop_choice, _check_retry, _check_template, _fail,
                                  _strip_refs, declaration_site)
from agentrt.dag.outputs import JsonSchema, OutputSpec, Text, ToolCall
from agentrt.dag.refs import Ref, Template
from agentrt.dag.specs import (LOOP_OUTPUTS, AgentLoopSpec, BranchSpec, Case, Constant, Decl, FanOutSpec,
                               InputSpec, ItemSpec, LLMSpec, NodeSpec, ToolSpec, WaitForSpec, walk_args)
from agentrt.dag.tooldefs import ToolDef, schema_problems, to_tool_def
from agentrt.retry import RetryPolicy

if TYPE_CHECKING:
    from agentrt.dag.compiled import CompiledProgram

_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
ITEM = "item"  # the local name of a fan-out branch's item
CaseBody = Any  # a function (Scope -> Ref) declaring a branch case's nodes, or a JSON constant: Scope.branch


class _NoFallback:
    def __repr__(self) -> str:
        return "NO_FALLBACK"


NO_FALLBACK: Any = _NoFallback()


class Scope:
    """Declares nodes in one scope: the program itself, or the body of a fan-out or branch case.

    Every method takes the node's local id first and returns a Ref to its output. In a fan-out body,
    `item` is the current item. Prompts are templates naming nodes in scope: "Summarise {weather}".
    """

    def __init__(self, program: Program, prefix: str, item: Ref | None = None) -> None:
        self._program = program
        self._prefix = prefix
        self._item = item
        self._open = True

    @property
    def item(self) -> Ref:
        """The current item of a fan-out branch (templates call it {item})."""
        if self._item is None:
            raise AttributeError("item exists only in a fan-out body")
        return self._item

    def llm(self, id: str, prompt: str, *, system: str | None = None, output: OutputSpec | None = None,
            max_tokens: int = 512, temperature: float = 0.0, continues: Ref | None = None,
            sampling: Mapping[str, Any] | None = None) -> Ref:
        """An LLM call. output: Text() (default), JsonSchema(schema) or ToolCall(tool_names).

        sampling: further settings, as OpenAI and vLLM name them: top_p, top_k, seed, stop,
        frequency_penalty, presence_penalty, repetition_penalty, min_tokens, logit_bias (e.g.
        {"frequency_penalty": 0.5} keeps a small model from repeating itself).

        continues: an earlier LLM call (Text or JsonSchema output) whose conversation this call
        carries on: its messages and its reply come first and `prompt` is the next user turn, so
        the model sees what it was asked and answered, and the engine reuses that KV instead of
        computing it again. The conversation keeps the earlier call's system prompt.

        >>> p = Program("demo", inputs={"topic": str})
        >>> poem = p.llm("poem", prompt="Write a haiku about {topic}", max_tokens=64)
        >>> p.llm("title", prompt="Now give it a title.", continues=poem, max_tokens=16)
        Ref('title')
        """
        node = self._new_id(id)
        if continues is not None:
            if not isinstance(continues, Ref) or continues.path:
                raise _fail(node, f"continues must be the Ref of an earlier LLM call (as p.llm returned it), "
                                  f"got {continues!r}")
            if system is not None:
                raise _fail(node, f"a call that continues {continues.node} keeps that conversation's system "
                                  "prompt; drop system=")
        output = Text() if output is None else output
        if not isinstance(output, (Text, JsonSchema, ToolCall)):
            raise _fail(node, f"output must be Text(), JsonSchema(schema) or ToolCall(tools), got {output!r}")
        if isinstance(output, JsonSchema):
            problems = schema_problems(output.schema)
            if problems:
                raise _fail(node, "output JsonSchema is invalid " + "; ".join(problems))
        self._check_sampling(node, max_tokens, temperature)
        spec = LLMSpec(node, _check_template(node, "prompt", prompt),
                       None if system is None else _check_template(node, "system", system),
                       output, max_tokens, float(temperature),
                       continues=None if continues is None else continues.node,
                       sampling=_check_extra_sampling(node, sampling))
        return self._add(spec)

    def tool(self, id: str, tool: str, args: Mapping[str, Any] | Ref | None = None, *,
             fallback: Any = NO_FALLBACK, retry: RetryPolicy | None = None) -> Ref:
        """A call to the tool named `tool` (declared in Program(tools=...)).

        args: a dict whose values are Refs, Template(...)s or literal JSON (nested is fine), or one
        Ref to the whole argument dict, e.g. an LLM call with output=ToolCall([tool]). If the tool
        fails and `fallback` is given, `fallback` becomes the output; otherwise the run ends with an
        error naming this node.

        retry: this call's RetryPolicy(max_attempts, backoff_s, backoff_factor, max_backoff_s,
        retry_on), each field it leaves None taken from the tool's own retries. A tool not declared
        idempotent is retried only on the failures retry_on names (its effect may have happened
        before the failure), so retrying it without retry_on is an error here.

        >>> p = Program("demo", inputs={"city": str}, tools=[{"name": "get_weather", "parameters": {
        ...     "type": "object", "properties": {"city": {"type": "string"}}}}])
        >>> p.tool("weather", "get_weather", args={"city": p.input("city")}, fallback={"forecast": "unknown"})
        Ref('weather')
        """
        node = self._new_id(id)
        if not isinstance(tool, str):
            raise _fail(node, f"name the tool by its name (a str declared in Program(tools=...)), got {tool!r}")
        args = {} if args is None else args
        if not isinstance(args, (Mapping, Ref)):
            raise _fail(node, f"args must be a dict or a Ref, got {type(args).__name__}")
        if isinstance(args, Mapping):
            args = dict(args)
            for where, item in walk_args(args, "args"):
                if isinstance(item, Template):
                    _check_template(node, where, item.text)
            plain = _strip_refs(args)
            _check_json_value(node, "args", plain)
        if fallback is not NO_FALLBACK:
            _check_json_value(node, "fallback", fallback)
        _check_retry(node, retry, self._program._tools.get(tool))
        has_fallback = fallback is not NO_FALLBACK
        return self._add(ToolSpec(node, tool, args, has_fallback, fallback if has_fallback else None, retry=retry))

    def wait_for(self, id: str, schema: Mapping[str, Any], *, prompt: str | None = None) -> Ref:
        """A value from outside the program: a person's approval, a webhook's payload. The run
        waits (status "waiting", nothing running for it) until the value is given, valid against
        the JSON schema `schema`: `POST /v1/runs/RUN_ID/input/NODE` on `agentrt serve`, or
        `Runtime.provide_input` in Python. `prompt`, a template over earlier outputs, says what
        is asked. A waiting run survives restarts of a server with a run store.

        >>> p = Program("demo", inputs={"sql": str})
        >>> ok = p.wait_for("approval", {"type": "object", "properties": {"approved": {"type": "boolean"}},
        ...                              "required": ["approved"]}, prompt="Run {sql}?")
        >>> p.output(ok["approved"])
        >>> run = p.compile().start({"sql": "DELETE FROM orders"})
        >>> run.ready(), run.spec("approval").kind
        (['approval'], 'wait_for')
        >>> run.complete("approval", {"approved": False})
        []
        >>> run.result
        False
        """
        node = self._new_id(id)
        problems = schema_problems(schema)
        if problems:
            raise _fail(node, f"schema is not a valid JSON schema: {problems[0]}")
        question = None if prompt is None else _check_template(node, "prompt", prompt)
        return self._add(WaitForSpec(node, dict(schema), question))

    def fan_out(self, id: str, over: Ref, body: Callable[[Scope], Ref]) -> Ref:
        """Run `body` once per item of the list `over`, in parallel; the output is the list of the
        branches' results, in item order (reference it to fan in).

        body(b) declares the per-item nodes on `b` (b.item is the item) and returns the branch result.
        Node ids inside become "<id>[i].<local id>" when the list is known.

        >>> p = Program("demo", inputs={"questions": list}, tools=[{"name": "search", "parameters": {
        ...     "type": "object", "properties": {"query": {"type": "string"}}}}])
        >>> hits = p.fan_out("hits", over=p.input("questions"),
        ...                  body=lambda b: b.tool("search", "search", args={"query": b.item}))
        >>> p.llm("answer", prompt="Answer using {hits}")
        Ref('answer')
        """
        node = self._new_id(id)
        if not isinstance(over, Ref):
            raise _fail(node, f"over must be a Ref to a list output, got {over!r}")
        if not callable(body):
            raise _fail(node, "body must be a function taking the body scope and returning its result Ref")
        prefix = f"{node}[*]."
        item = self._program._declare(ItemSpec(prefix + ITEM, node, over))
        result = self._run_body(node, body, Scope(self._program, prefix, item), "body")
        return self._add(FanOutSpec(node, over, prefix, result))

    def branch(self, id: str, on: Ref, cases: Mapping[Any, CaseBody] | Sequence[tuple[Any, CaseBody]],
               default: CaseBody | None = None) -> Ref:
        """Take the first case that matches the value of `on` (a node, e.g. on=tri, or a part of
        one, on=tri["urgency"]); `default` when none does (without one, no match ends the run with
        an error). The output is the taken case's result.

        cases: a dict {key: body}, or a list of (key, body) pairs, tried in order (the first match
        wins; `default` always comes last). A key is either a value `on` must equal (a bool, int,
        None or short str; JSON semantics: true is not 1) or a predicate, a function of the value
        that answers True or False; it gets a copy of the value, and if it raises or answers
        anything but a bool the run fails naming the branch and the case. A body is either a
        function that declares the case's nodes on its scope and returns its result Ref, or a plain
        JSON value, the output when that case is taken (no node needed; Constant(None) makes a null
        default, since default=None means no default).

        Case nodes get ids "<id>?<label>.<local id>": the label is the key, a predicate's function
        name, or case<i> for a lambda (i: its position in cases).

        >>> p = Program("demo", inputs={"question": str})
        >>> kind = p.llm("kind", prompt="Is this about math? {question}",
        ...              output=JsonSchema({"type": "string", "enum": ["math", "other"]}))
        >>> p.branch("answer", on=kind, cases={
        ...     "math": lambda b: b.llm("solve", prompt="Solve step by step: {question}"),
        ...     "other": lambda b: b.llm("reply", prompt="Answer briefly: {question}")})
        Ref('answer')

        Predicates read as much of the value as they like, and a case may just be a value:

        >>> p = Program("triage", inputs={"ticket": str})
        >>> tri = p.llm("tri", prompt="Triage: {ticket}", output=JsonSchema({"type": "object", "properties": {
        ...     "urgency": {"type": "integer"}, "topic": {"type": "string"}}, "required": ["urgency", "topic"]}))
        >>> def urgent(t):
        ...     return t["urgency"] >= 4
        >>> p.output(p.branch("route", on=tri, cases=[
        ...     (urgent, lambda b: b.llm("page", prompt="Write the on-call page for: {ticket}")),
        ...     (lambda t: t["topic"] == "billing", lambda b: b.llm("bill", prompt="Answer the bill: {ticket}")),
        ...     (lambda t: t["urgency"] < 2, "no action needed")],
        ...     default=lambda b: b.llm("reply", prompt="Reply to: {ticket}")))
        >>> program = p.compile()
        >>> run = program.start({"ticket": "My invoice is wrong and the site is down"})
        >>> run.complete("tri", {"urgency": 5, "topic": "billing"})  # urgent and billing: the first wins
        ['route?urgent.page']
        >>> run = program.start({"ticket": "Thanks, all good"})
        >>> run.complete("tri", {"urgency": 0, "topic": "praise"}), run.result
        ([], 'no action needed')
        """
        node = self._new_id(id)
        if not isinstance(on, Ref):
            raise _fail(node, f"on must be a Ref (a node, or a part of one), got {on!r}")
        pairs = _case_pairs(node, cases)
        entries = [(key, _case_label(node, key, i), body, False) for i, (key, body) in enumerate(pairs)]
        if default is not None:
            entries.append((None, "default", default, True))
        _check_case_labels(node, entries)
        built = []
        for key, label, body, is_default in entries:
            prefix = f"{node}?{label}."
            result = self._case_result(node, label, prefix, body)
            predicate = key if callable(key) else None
            built.append(Case(None if predicate else key, label, prefix, result, is_default, predicate))
        return self._add(BranchSpec(node, on, tuple(built)))

    def agent_loop(self, id: str, prompt: str, tools: Sequence[str], *, system: str | None = None,
                   max_steps: int = 8, max_tokens: int = 512, temperature: float = 0.0,
                   on_max_steps: Literal["answer", "error"] = "answer", tool_choice: str = "auto",
                   output: Literal["text", "detail"] = "text", sampling: Mapping[str, Any] | None = None,
                   parallel_calls: bool = False) -> Ref:
        """A bounded agent loop: at each step the model picks one of `tools` (its result, or its
        error, goes back to the model) or gives a final text answer, which is the output.

        parallel_calls=True: a step may make several calls in one turn (a JSON list of calls, each
        under its tool's schema). Each call runs as its own tool node "<id>#k.tool[i]", all at
        once, an idempotent one from the moment its own arguments close while the model still
        writes the turn; the next step gets the results in the order the calls were made.

        At most max_steps LLM steps. on_max_steps="answer": the last step must answer in text
        (its tools stay described, as OpenAI's tool_choice "none", so its prompt extends the step
        before and reuses that KV); "error": a tool pick at the last step ends the run with an
        error naming this node.

        tool_choice: when the model must call a tool rather than answer (the grammar forbids
        text; a small model otherwise tends to answer at once, without looking anything up):
        "auto" never; "required_first" at step 1; "required" at every step but the last (the
        loop then ends only there, answering under on_max_steps="answer", or answering or failing
        under "error"); a tool's name: step 1 calls that tool. Every step's prompt still describes
        all the tools and that text may answer, so each step extends the step before's prompt.

        output="detail": the value is {"answer", "ended", "steps", "tool_calls": [{"name",
        "arguments", "ok"}]} (every call in the order made; with parallel_calls each also has
        "step", the LLM step that made it); "ended" is "answered" (the model chose to) or
        "answered_at_max_steps" (the last step had to), so later nodes may branch on it. Either
        way the run's graph and trace record how the loop ended.

        sampling: every step's further sampling settings, as in llm() (e.g. {"frequency_penalty":
        0.5} keeps a small model from repeating a query until it runs out of tokens).

        >>> p = Program("demo", inputs={"question": str}, tools=[{"name": "run_query", "parameters": {
        ...     "type": "object", "properties": {"sql": {"type": "string"}}}}])
        >>> agent = p.agent_loop("agent", prompt="Answer with SQL: {question}", tools=["run_query"], max_steps=5,
        ...                      tool_choice="required_first", output="detail")
        >>> p.output(agent["answer"])
        >>> run = p.compile().start({"question": "How many users?"})
        >>> run.spec("agent#1.llm").output.describe()
        'tool call (required): run_query'
        >>> run.complete("agent#1.llm", {"name": "run_query", "arguments": {"sql": "SELECT count(*) FROM users"}})
        ['agent#1.tool']
        >>> run.complete("agent#1.tool", [[42]])
        ['agent#2.llm']
        >>> run.complete("agent#2.llm", "42 users.")
        []
        >>> run.values["agent"]["ended"], run.values["agent"]["steps"], run.result
        ('answered', 2, '42 users.')
        """
        node = self._new_id(id)
        if isinstance(tools, str) or not tools or not all(isinstance(t, str) for t in tools):
            raise _fail(node, f"tools must be a non-empty list of tool names, got {tools!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise _fail(node, f"max_steps must be an int >= 1, got {max_steps!r}")
        if on_max_steps not in ("answer", "error"):
            raise _fail(node, f"on_max_steps must be 'answer' or 'error', got {on_max_steps!r}")
        _check_loop_choice(node, tool_choice, tuple(tools), max_steps, on_max_steps)
        if output not in LOOP_OUTPUTS:
            raise _fail(node, f"output must be 'text' or 'detail', got {output!r}")
        if not isinstance(parallel_calls, bool):
            raise _fail(node, f"parallel_calls must be True or False, got {parallel_calls!r}")
        self._check_sampling(node, max_tokens, temperature)
        spec = AgentLoopSpec(node, _check_template(node, "prompt", prompt),
                             None if system is None else _check_template(node, "system", system),
                             tuple(tools), max_steps, max_tokens, float(temperature), on_max_steps,
                             tool_choice=tool_choice, output=output,
                             sampling=_check_extra_sampling(node, sampling), parallel_calls=parallel_calls)
        return self._add(spec)

    # -- internals --

    def _new_id(self, id: Any) -> str:
        if not self._open:
            raise _fail(self._prefix + str(id), "declared after its body returned: declare nodes inside the body")
        if not isinstance(id, str) or not _ID.match(id):
            raise _fail(self._prefix + str(id), "node id must be a Python-style identifier (letters, digits, _)")
        node = self._prefix + id
        if node in self._program._decls:
            what = "the fan-out's item" if id == ITEM and self._item is not None else "another node or input"
            raise _fail(node, f"duplicate id: already used by {what}")
        return node

    def _check_sampling(self, node: str, max_tokens: Any, temperature: Any) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _fail(node, f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise _fail(node, f"temperature must be a number >= 0, got {temperature!r}")

    def _case_result(self, node: str, label: str, prefix: str, body: Any) -> Ref | Constant:
        """A function body declares the case's nodes and returns the result; any other body is
        the case's result itself, a constant."""
        if callable(body):
            return self._run_body(node, body, Scope(self._program, prefix, self._item), f"case {label}",
                                  " (for a fixed value, give the value itself as the case's body)")
        if isinstance(body, (Ref, Template)):
            raise _fail(node, f"case {label}: the body is {body!r}; to take a node's output, give a function "
                              "returning its Ref (lambda b: ref)")
        constant = body if isinstance(body, Constant) else Constant(body)
        try:
            json.dumps(constant.value)
        except (TypeError, ValueError) as e:
            raise _fail(node, f"case {label}: the body must be a function declaring the case's nodes or a JSON "
                              f"value (its result), got {constant.value!r}: {e}") from None
        return constant

    def _run_body(self, node: str, body: Callable[[Scope], Ref], scope: Scope, what: str, hint: str = "") -> Ref:
        result = body(scope)
        scope._open = False
        if not isinstance(result, Ref):
            raise _fail(node, f"{what} must return the Ref of its result, got {result!r}{hint}")
        return result

    def _add(self, spec: NodeSpec) -> Ref:
        return self._program._declare(spec)


def _tool_name(tool: Any) -> str:
    if isinstance(tool, Mapping):
        inner = tool.get("function", tool)
        return str(inner.get("name", "?")) if isinstance(inner, Mapping) else "?"
    return str(getattr(tool, "name", "?"))


class Program(Scope):
    """An agent program under construction: inputs, tools, nodes, and one output.

    inputs: {name: type} with type one of str, int, float, bool, list, dict.
    tools: the tools nodes may name (agentrt.tools.Tool objects or OpenAI-format dicts).

    >>> p = Program("trip", inputs={"city": str}, tools=[{"name": "get_weather", "parameters": {
    ...     "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
    >>> weather = p.tool("weather", "get_weather", args={"city": p.input("city")})
    >>> p.output(p.llm("summary", prompt="Summarise for a traveller to {city}: {weather}"))
    >>> p.compile().topological_order
    ('city', 'weather', 'summary')
    """

    def __init__(self, name: str, inputs: Mapping[str, type] | None = None, tools: Sequence[Any] = ()) -> None:
        self.name = name
        self._decls: dict[str, Decl] = {}
        self._tools: dict[str, ToolDef] = {}
        self._output: Ref | dict[str, Ref] | None = None
        super().__init__(self, "")
        for tool in tools:
            try:
                found = to_tool_def(tool)
            except ValueError as e:
                raise _fail(f"tool {_tool_name(tool)}", str(e)) from None
            if found.name in self._tools:
                raise _fail(f"tool {found.name}", "declared twice in tools=")
            self._tools[found.name] = found
        for input_name, typ in (inputs or {}).items():
            node = self._new_id(input_name)
            if typ not in JSON_TYPES:
                raise _fail(node, f"input type must be one of str, int, float, bool, list, dict, got {typ!r}")
            self._declare(InputSpec(node, JSON_TYPES[typ]))

    def input(self, name: str) -> Ref:
        """The Ref of a declared input."""
        decl = self._decls.get(name)
        if decl is None or not isinstance(decl.spec, InputSpec):
            raise _fail(name, f"no input named '{name}' (inputs: {', '.join(self._input_names()) or 'none'})")
        return Ref(name)

    def output(self, value: Ref | Mapping[str, Ref]) -> None:
        """Declare the program's result: one Ref, or a dict {name: Ref}. Nodes that feed no output
        are rejected by compile() as unreachable."""
        if self._output is not None:
            raise _fail(self.name, "output declared twice")
        if isinstance(value, Mapping) and value and all(isinstance(v, Ref) for v in value.values()):
            self._output = dict(value)
        elif isinstance(value, Ref):
            self._output = value
        else:
            raise _fail(self.name, f"output must be a Ref or a non-empty dict of Refs, got {value!r}")

    def compile(self) -> CompiledProgram:
        """Validate the whole program and freeze it; raises ProgramValidationError listing every problem."""
        from agentrt.dag.compile import compile_program
        return compile_program(self.name, self._decls, self._tools, self._output)

    def _input_names(self) -> list[str]:
        return [n for n, d in self._decls.items() if isinstance(d.spec, InputSpec)]

    def _declare(self, spec: NodeSpec) -> Ref:
        self._decls[spec.id] = Decl(spec, len(self._decls), declaration_site())
        return Ref(spec.id)
