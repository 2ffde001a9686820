"""agent_loop(tool_choice=...): which steps must call a tool (grammar-enforced, on xgrammar's real
constraints), with every step's prompt unchanged; and how a loop ended: the loop node's "ended"
attribute and output="detail"."""
from __future__ import annotations

import string

import pytest

from agentrt.dag import Program, ToolCall
from agentrt.dag.export import describe
from agentrt.errors import ProgramRunError, ProgramValidationError, RequestError
from agentrt.structured.output_format import instructions, parse_output, parse_response_format

SEARCH = {"name": "search", "description": "Search the web", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 3}}, "required": ["query"]}}
LOOKUP = {"name": "lookup", "description": "Look a key up", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "maxLength": 3}}, "required": ["key"]}}


def loop_program(max_steps=3, on_max_steps="answer", **kw):
    p = Program("loop", inputs={"goal": str}, tools=[SEARCH, LOOKUP])
    p.output(p.agent_loop("agent", prompt="{goal}", tools=["search", "lookup"], max_steps=max_steps,
                          on_max_steps=on_max_steps, **kw))
    return p.compile()


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def step_formats(run, steps):
    """The response format of each LLM step, the loop driven by a tool call at every step but the last."""
    formats = []
    for k in range(1, steps + 1):
        formats.append(run.spec(f"agent#{k}.llm").output.to_response_format())
        if k < steps:
            tool = run.spec(f"agent#{k}.llm").output.callable_tools[0]
            run.complete(f"agent#{k}.llm", call(tool, **({"query": "q"} if tool == "search" else {"key": "k"})))
            run.complete(f"agent#{k}.tool", "r")
    return formats


def choices(formats):
    return [rf.get("tool_choice", "text" if rf["allow_text"] else "call") for rf in formats]


# -- which steps must call --

def test_required_first_forbids_text_at_step_one_only():
    formats = step_formats(loop_program(3, tool_choice="required_first").start({"goal": "g"}), 3)
    assert choices(formats) == ["required", "text", "none"]
    assert formats[0]["allow_text"] is False
    fmt = parse_response_format(formats[0])
    assert not fmt.allow_text and parse_output(fmt, '{"name": "search", "arguments": {"query": "a"}}')["name"] == "search"
    with pytest.raises(ValueError):  # text is no answer here
        parse_output(fmt, "Hello!")


def test_every_step_describes_the_same_tools_and_instructions():
    """What a step allows is the grammar's business: the prompt (tools and instructions) is the
    same at every step, so each step's prompt extends the step before's and reuses its KV."""
    for choice in ("required_first", "required", "lookup"):
        formats = step_formats(loop_program(3, tool_choice=choice).start({"goal": "g"}), 3)
        parsed = [parse_response_format(rf) for rf in formats]
        assert len({str(f.tools) for f in parsed}) == 1 and len(parsed[0].tools) == 2, choice
        assert len({instructions(f) for f in parsed}) == 1, choice
        assert "reply in plain text" in instructions(parsed[0])


def test_named_choice_makes_step_one_call_that_tool():
    run = loop_program(3, tool_choice="lookup").start({"goal": "g"})
    first = run.spec("agent#1.llm").output
    assert first == ToolCall(("search", "lookup"), choice="lookup") and first.callable_tools == ("lookup",)
    rf = first.to_response_format()
    assert rf["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    fmt = parse_response_format(rf)
    assert fmt.tool_choice == "required" and fmt.schema["properties"]["name"] == {"const": "lookup"}
    assert [t["function"]["name"] for t in fmt.tools] == ["search", "lookup"]  # both still described
    assert first.value_schema()["properties"]["arguments"] == LOOKUP["parameters"]
    with pytest.raises(ProgramRunError, match=r"^agent#1.llm: output rejected: called tool 'search', but this call "
                                              r"must call 'lookup'"):
        run.complete("agent#1.llm", call("search", query="q"))


def test_named_choice_step_one_rejects_text_and_later_steps_are_free():
    run = loop_program(3, tool_choice="lookup").start({"goal": "g"})
    run.complete("agent#1.llm", call("lookup", key="k"))
    run.complete("agent#1.tool", "v")
    assert run.spec("agent#2.llm").output.choice == "auto"
    run.complete("agent#2.llm", call("search", query="q"))  # any tool from step 2 on
    with pytest.raises(ProgramRunError, match=r"answered in text, but this call must call one of \['lookup'\]"):
        loop_program(3, tool_choice="lookup").start({"goal": "g"}).complete("agent#1.llm", "hi")


def test_required_calls_until_the_last_step():
    assert choices(step_formats(loop_program(4, tool_choice="required").start({"goal": "g"}), 4)) == \
        ["required", "required", "required", "none"]
    # under on_max_steps="error" the last step is free: it answers, or its call fails the run
    assert choices(step_formats(loop_program(3, "error", tool_choice="required").start({"goal": "g"}), 3)) == \
        ["required", "required", "text"]
    run = loop_program(3, tool_choice="required").start({"goal": "g"})
    with pytest.raises(ProgramRunError, match=r"^agent#1.llm: output rejected: answered in text, but this call must "
                                              r"call one of \['search', 'lookup'\]"):
        run.complete("agent#1.llm", {"text": "I know already."})


def test_auto_is_todays_loop():
    assert choices(step_formats(loop_program(3).start({"goal": "g"}), 3)) == ["text", "text", "none"]


def test_response_format_tool_choices_are_checked():
    tools = [{"type": "function", "function": SEARCH}]
    with pytest.raises(RequestError, match=r"tool_choice names 'lookup', which is not among the tools \(search\)"):
        parse_response_format({"type": "tool_call", "tools": tools,
                               "tool_choice": {"type": "function", "function": {"name": "lookup"}}})
    with pytest.raises(RequestError, match="tool_choice must be 'auto', 'none', 'required' or"):
        parse_response_format({"type": "tool_call", "tools": tools, "tool_choice": "any"})
    # "required" wins over allow_text; without a choice, allow_text False describes a call-only turn
    required = parse_response_format({"type": "tool_call", "tools": tools, "allow_text": True, "tool_choice": "required"})
    assert not required.allow_text and required.offers_text
    call_only = parse_response_format({"type": "tool_call", "tools": tools})
    assert not call_only.offers_text and "plain text" not in instructions(call_only)
    with pytest.raises(ValueError, match="ToolCall choice must be 'auto', 'none', 'required' or one of its tools"):
        ToolCall(["search"], choice="lookup")


# -- validation at declaration --

def declaration_problem(**kw):
    p = Program("loop", inputs={"goal": str}, tools=[SEARCH, LOOKUP])
    with pytest.raises(ProgramValidationError) as e:
        p.agent_loop("agent", prompt="{goal}", tools=["search", "lookup"], **kw)
    (problem,) = e.value.problems
    return problem


@pytest.mark.parametrize("kw, message", [
    ({"tool_choice": "fetch"}, "tool_choice must be 'auto', 'required', 'required_first' or one of the loop's tools "
                               "(search, lookup), got 'fetch'"),
    ({"tool_choice": None}, "tool_choice must be 'auto', 'required', 'required_first' or one of the loop's tools "
                            "(search, lookup), got None"),
    ({"tool_choice": "required_first", "max_steps": 1},
     "tool_choice='required_first' makes step 1 call a tool, but with max_steps=1 step 1 is the last step, which must "
     "answer in text (on_max_steps='answer'): use max_steps >= 2"),
    ({"tool_choice": "search", "max_steps": 1, "on_max_steps": "error"},
     "tool_choice='search' makes step 1 call a tool, but with max_steps=1 step 1 is the last step, which fails the "
     "run if it calls a tool (on_max_steps='error'): use max_steps >= 2"),
    ({"output": "json"}, "output must be 'text' or 'detail', got 'json'"),
])
def test_bad_tool_choice_or_output_names_the_loop(kw, message):
    assert declaration_problem(**kw) == ("agent", message)


def test_required_with_on_max_steps_error_is_allowed():
    """Not contradictory: the steps before the last must call; the last may answer (or its call
    fails the run, as on_max_steps="error" says)."""
    c = loop_program(2, "error", tool_choice="required")
    assert c.spec("agent").possible_ends() == ("answered",)


# -- the real grammar: xgrammar over a one-character-per-token vocabulary --

VOCAB = list(string.printable[:95]) + ["</s>"]


@pytest.fixture(scope="module")
def grammars():
    import xgrammar as xgr

    from agentrt.structured.grammar import GrammarCache

    return GrammarCache(xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1]))


def decode(grammars, rf, wants):
    """Greedy decoding, masked by the grammar of `rf` as the engine masks, by a 'model' that wants
    to write `wants` and stop: at position i it ranks wants[i] (then the end) first, then the
    characters of `wants`, then the rest of the vocabulary. Returns what it wrote."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammars.compile(parse_response_format(rf)))
    stop, fallback = len(VOCAB) - 1, [VOCAB.index(c) for c in wants] + list(range(len(VOCAB)))
    out = []
    while not matcher.is_terminated() and len(out) < 200:
        first = VOCAB.index(wants[len(out)]) if len(out) < len(wants) else stop
        out.append(next(t for t in [first, *fallback] if matcher.accept_token(t)))
    return "".join(VOCAB[t] for t in out if t != stop)


def test_the_grammar_turns_a_model_that_prefers_text_into_a_call(grammars):
    import xgrammar as xgr

    formats = step_formats(loop_program(3, tool_choice="required_first").start({"goal": "g"}), 2)
    first = xgr.GrammarMatcher(grammars.compile(parse_response_format(formats[0])))
    assert not first.accept_token(VOCAB.index("H")) and first.accept_token(VOCAB.index("{"))
    chatty = "Hello, I think the answer is 42."
    written = decode(grammars, formats[0], chatty)
    value = parse_output(parse_response_format(formats[0]), written)
    assert value["name"] in ("search", "lookup") and written.startswith('{"name": ')
    assert decode(grammars, formats[1], chatty) == chatty  # step 2 is free: the same model answers


def test_the_grammar_of_a_named_choice_allows_only_that_tool(grammars):
    rf = loop_program(3, tool_choice="search").start({"goal": "g"}).spec("agent#1.llm").output.to_response_format()
    # this model would rather call lookup ("l" before "s"): the grammar makes it search
    assert parse_output(parse_response_format(rf), decode(grammars, rf, "lookup Hi"))["name"] == "search"
    unnamed = loop_program(3, tool_choice="required").start({"goal": "g"}).spec("agent#1.llm").output
    assert decode(grammars, unnamed.to_response_format(), "lookup Hi").startswith('{"name": "lookup"')


# -- how the loop ended --

def test_ended_answered_and_the_detail_value():
    c = loop_program(3, output="detail")
    run = c.start({"goal": "g"})
    run.complete("agent#1.llm", call("search", query="q"))
    run.fail("agent#1.tool", RuntimeError("rate limited"))  # the error goes back to the model
    run.complete("agent#2.llm", call("lookup", key="k"))
    run.complete("agent#2.tool", {"v": 1})
    run.complete("agent#3.llm", "done")  # the last step, which had to answer
    assert run.graph.nodes["agent"]["ended"] == "answered_at_max_steps"
    assert run.result == {"answer": "done", "ended": "answered_at_max_steps", "steps": 3, "tool_calls": [
        {"name": "search", "arguments": {"query": "q"}, "ok": False},
        {"name": "lookup", "arguments": {"key": "k"}, "ok": True}]}
    assert describe(run.graph.nodes["agent"]) == \
        "agent loop, max 3 steps: search, lookup -> answered_at_max_steps at step 3"
    early = loop_program(3).start({"goal": "g"})
    early.complete("agent#1.llm", {"text": "I know."})
    assert (early.result, early.graph.nodes["agent"]["ended"]) == ("I know.", "answered")


def test_ended_exceeded_max_steps_under_error():
    run = loop_program(1, "error").start({"goal": "g"})
    with pytest.raises(ProgramRunError, match="^agent: no final answer after max_steps=1"):
        run.complete("agent#1.llm", call("search", query="q"))
    assert run.graph.nodes["agent"]["ended"] == "exceeded_max_steps"


def test_possible_ends_follow_the_choice():
    ends = lambda *a, **kw: loop_program(*a, **kw).spec("agent").possible_ends()  # noqa: E731
    assert ends(3) == ("answered", "answered_at_max_steps")
    assert ends(1) == ("answered_at_max_steps",)
    assert ends(3, tool_choice="required") == ("answered_at_max_steps",)
    assert ends(2, tool_choice="required_first") == ("answered_at_max_steps",)
    assert ends(3, tool_choice="lookup") == ("answered", "answered_at_max_steps")
    assert ends(3, "error", tool_choice="required_first") == ("answered",)


def test_typecheck_knows_the_detail_shape():
    p = Program("loop", inputs={"goal": str}, tools=[SEARCH, LOOKUP])
    agent = p.agent_loop("agent", prompt="{goal}", tools=["search", "lookup"], output="detail")
    p.output(p.llm("report", prompt="{agent.answer} after {agent.steps} steps, {agent.tool_calls}; {agent.why}"))
    with pytest.raises(ProgramValidationError) as e:
        p.compile()
    assert e.value.problems == [("report", "prompt placeholder {agent.why}: agent.why cannot exist: agent has no "
                                           "property 'why' in its schema (properties: answer, ended, steps, "
                                           "tool_calls)")]


def test_a_branch_on_how_the_loop_ended():
    p = Program("loop", inputs={"goal": str}, tools=[SEARCH, LOOKUP])
    agent = p.agent_loop("agent", prompt="{goal}", tools=["search", "lookup"], max_steps=2, output="detail",
                         tool_choice="required_first")
    p.output(p.branch("final", on=agent["ended"], cases={
        "answered": lambda b: b.llm("polish", prompt="Polish {agent.answer}"),
        "answered_at_max_steps": lambda b: b.llm("caveat", prompt="Say this may be incomplete: {agent.answer}")}))
    # required_first with 2 steps: step 2 is the last and must answer, so "answered" can never happen
    with pytest.raises(ProgramValidationError, match="case answered can never match"):
        p.compile()


def test_loop_sampling_reaches_every_step():
    p = Program("demo", inputs={"q": str}, tools=[{"name": "look", "parameters": {"type": "object", "properties": {}}}])
    p.output(p.agent_loop("agent", prompt="{q}", tools=["look"], max_steps=3, sampling={"frequency_penalty": 0.3}))
    run = p.compile().start({"q": "x"})
    assert dict(run.spec("agent#1.llm").sampling) == {"frequency_penalty": 0.3}
    with pytest.raises(ProgramValidationError, match="agent"):
        p2 = Program("demo", inputs={"q": str}, tools=[{"name": "look", "parameters": {"type": "object", "properties": {}}}])
        p2.agent_loop("agent", prompt="{q}", tools=["look"], sampling={"not_a_setting": 1})
