"""ProgramRun: run-time expansion of fan-outs, branches and agent loops, and failure handling."""
import pytest

from agentrt.dag import JsonSchema, Program, Text, ToolCall, render_prompt, tool_arguments
from agentrt.errors import ProgramRunError


def fn(name, properties):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties}}}


SEARCH = fn("search", {"query": {"type": "string"}})
LOOKUP = fn("lookup", {"key": {"type": "string"}})


def fan_out_program():
    p = Program("fan", inputs={"topics": list}, tools=[SEARCH])

    def body(b):
        b.tool("search", "search", args={"query": b.item})
        return b.llm("summary", prompt="{item}: {search}")

    summaries = p.fan_out("summaries", over=p.input("topics"), body=body)
    p.output(p.llm("merge", prompt="Merge {summaries}"))
    return p.compile()


def test_fan_out_expands_into_indexed_branches_with_their_edges():
    run = fan_out_program().start({"topics": ["a", "b"]})
    g = run.graph
    assert not any("[*]" in n for n in g)
    assert {n for n in g if n.startswith("summaries[")} == {
        "summaries[0].item", "summaries[0].search", "summaries[0].summary",
        "summaries[1].item", "summaries[1].search", "summaries[1].summary"}
    for i in (0, 1):
        assert g.has_edge("topics", f"summaries[{i}].item")
        assert g.has_edge(f"summaries[{i}].item", f"summaries[{i}].search")
        assert g.has_edge(f"summaries[{i}].search", f"summaries[{i}].summary")
        assert g.has_edge(f"summaries[{i}].summary", "summaries")
        assert run.values[f"summaries[{i}].item"] == "ab"[i]
        assert run.spec(f"summaries[{i}].item").index == i
    assert g.nodes["summaries"]["width"] == 2
    assert run.ready() == ["summaries[0].search", "summaries[1].search"]
    assert "summaries[0].search" in run.to_mermaid() and '"summaries[1].summary" -> "summaries"' in run.to_dot()


def test_fan_in_waits_for_every_branch():
    run = fan_out_program().start({"topics": ["a", "b", "c"]})
    for i in range(3):
        run.complete(f"summaries[{i}].search", {"hits": i})
    run.complete("summaries[0].summary", "A")
    run.complete("summaries[2].summary", "C")
    assert "summaries" not in run.values and run.ready() == ["summaries[1].summary"]
    assert run.complete("summaries[1].summary", "B") == ["merge"]
    assert run.values["summaries"] == ["A", "B", "C"]


def test_fan_out_over_an_empty_list_fans_in_at_once():
    run = fan_out_program().start({"topics": []})
    assert run.values["summaries"] == [] and run.ready() == ["merge"]
    assert render_prompt(run.spec("merge"), run.values)[0]["content"] == "Merge []"


def test_fan_out_over_a_value_that_is_not_a_list_fails_naming_the_fan_out():
    p = Program("p", inputs={"q": str}, tools=[SEARCH])  # search has no output schema: checked at run time
    items = p.tool("items", "search", args={"query": p.input("q")})
    p.output(p.fan_out("each", over=items, body=lambda b: b.llm("s", prompt="{item}")))
    run = p.compile().start({"q": "x"})
    with pytest.raises(ProgramRunError, match=r"^each: over items is an object, not a list"):
        run.complete("items", {"a": 1})


def test_nested_fan_out_expands_level_by_level():
    p = Program("nested", inputs={"groups": list})

    def outer(b):
        inner = b.fan_out("inner", over=b.item, body=lambda c: c.llm("leaf", prompt="{item}"))
        return b.llm("group", prompt="{inner}")

    p.output(p.fan_out("outer", over=p.input("groups"), body=outer))
    c = p.compile()
    assert "outer[*].inner[*].leaf" in c.graph
    run = c.start({"groups": [["x", "y"], ["z"]]})
    assert run.ready() == ["outer[0].inner[0].leaf", "outer[0].inner[1].leaf", "outer[1].inner[0].leaf"]
    assert run.values["outer[0].inner[1].item"] == "y"
    for leaf, text in [("outer[0].inner[0].leaf", "X"), ("outer[0].inner[1].leaf", "Y"),
                       ("outer[1].inner[0].leaf", "Z")]:
        run.complete(leaf, text)
    assert run.values["outer[0].inner"] == ["X", "Y"]
    run.complete("outer[0].group", "XY")
    run.complete("outer[1].group", "Z")
    assert run.result == ["XY", "Z"]


def branch_program(with_default=False):
    p = Program("route", inputs={"question": str}, tools=[SEARCH])
    kind = p.llm("kind", prompt="Classify {question}",
                 output=JsonSchema({"type": "object", "properties": {"needs_search": {}}}))

    def search_then_answer(b):
        b.tool("search", "search", args={"query": p.input("question")})
        return b.llm("answer", prompt="{question} given {search}")

    cases = {True: search_then_answer, False: lambda b: b.llm("direct", prompt="Answer: {question}")}
    p.output(p.branch("reply", on=kind["needs_search"], cases=cases,
                      default=(lambda b: b.llm("fallback", prompt="Sorry: {question}")) if with_default else None))
    return p.compile()


def test_branch_cases_wait_for_the_decision_then_only_the_taken_case_remains():
    c = branch_program()
    assert {"reply?true.search", "reply?true.answer", "reply?false.direct"} <= set(c.graph)
    run = c.start({"question": "Who won in 2022?"})
    assert run.ready() == ["kind"]  # case nodes are gated until the branch decides
    with pytest.raises(ProgramRunError, match=r"^reply\?false\.direct: not ready \(its branch case reply\?false"):
        run.begin("reply?false.direct")
    assert run.complete("kind", {"needs_search": True}) == ["reply?true.search"]
    assert not any(n.startswith("reply?false.") for n in run.graph)
    assert run.graph.nodes["reply"]["case"] == "true"
    assert set(run.graph.predecessors("reply")) == {"kind", "reply?true.answer"}
    run.complete("reply?true.search", ["hit"])
    run.complete("reply?true.answer", "Argentina.")
    assert run.result == "Argentina."


def test_branch_false_case_and_default():
    run = branch_program().start({"question": "2+2?"})
    assert run.complete("kind", {"needs_search": False}) == ["reply?false.direct"]
    run = branch_program(with_default=True).start({"question": "?"})
    assert run.complete("kind", {"needs_search": None}) == ["reply?default.fallback"]


def test_branch_without_a_matching_case_fails_naming_it():
    run = branch_program().start({"question": "?"})
    with pytest.raises(ProgramRunError, match=r"^reply: kind.needs_search = 1 matches no case \(true, false\)"):
        run.complete("kind", {"needs_search": 1})  # 1 is not true: JSON semantics


def test_branch_counts_its_largest_case_until_decided():
    c = branch_program()
    assert c.remaining_calls(done={"question"}).llm == 2  # kind + the larger case (1 llm each)
    assert c.remaining_calls(done={"question"}).tool == 1
    run = c.start({"question": "?"})
    run.complete("kind", {"needs_search": False})
    assert (run.remaining_calls().llm, run.remaining_calls().tool) == (1, 0)


def loop_program(max_steps, on_max_steps="answer"):
    p = Program("loop", inputs={"goal": str}, tools=[SEARCH, LOOKUP])
    p.output(p.agent_loop("agent", prompt="{goal}", tools=["search", "lookup"], max_steps=max_steps,
                          on_max_steps=on_max_steps))
    return p.compile()


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def test_loop_expansion_stops_at_max_steps_with_a_forced_answer():
    run = loop_program(3).start({"goal": "g"})
    assert isinstance(run.spec("agent#1.llm").output, ToolCall)
    run.complete("agent#1.llm", call("search", query="a"))
    run.complete("agent#1.tool", "r1")
    run.complete("agent#2.llm", call("lookup", key="b"))
    run.complete("agent#2.tool", "r2")
    last = run.spec("agent#3.llm")
    # the tools stay described (the prompt starts as the earlier steps' did), not callable
    assert last.output == ToolCall(("search", "lookup"), choice="none")
    assert last.output.to_response_format()["tool_choice"] == "none"
    assert last.output.to_response_format()["tools"] == run.spec("agent#2.llm").output.to_response_format()["tools"]
    with pytest.raises(ProgramRunError, match=r"^agent#3.llm: output rejected: called tool 'search', but this call "
                                              r"answers in text"):
        run.complete("agent#3.llm", call("search", query="again"))
    assert "agent#3.tool" not in run.graph


def test_loop_final_step_answers():
    run = loop_program(2).start({"goal": "g"})
    run.complete("agent#1.llm", call("search", query="a"))
    run.complete("agent#1.tool", "r1")
    assert run.complete("agent#2.llm", "final") == []
    assert run.result == "final"
    assert sorted(n for n in run.graph if n.startswith("agent#")) == ["agent#1.llm", "agent#1.tool", "agent#2.llm"]


def test_loop_on_max_steps_error_names_the_loop():
    run = loop_program(2, on_max_steps="error").start({"goal": "g"})
    run.complete("agent#1.llm", call("search", query="a"))
    run.complete("agent#1.tool", "r1")
    assert isinstance(run.spec("agent#2.llm").output, ToolCall)
    with pytest.raises(ProgramRunError, match=r"^agent: no final answer after max_steps=2: step 2 called 'lookup'"):
        run.complete("agent#2.llm", call("lookup", key="k"))
    assert run.status == "failed" and run.error.node == "agent"


def test_loop_answering_at_once_and_its_budget():
    c = loop_program(4)
    assert (c.remaining_calls().llm, c.remaining_calls().tool) == (4, 3)
    assert c.critical_path_length() == 7.0
    assert c.critical_path_length(weights={"llm": 2.0, "tool": 0.5}) == 9.5
    run = c.start({"goal": "g"})
    assert (run.remaining_calls().llm, run.remaining_calls().tool) == (4, 3)
    run.complete("agent#1.llm", call("search", query="q"))
    assert (run.remaining_calls().llm, run.remaining_calls().tool) == (3, 3)
    assert run.critical_path_length(from_node="agent#1.tool") == 6.0
    run.complete("agent#1.tool", "r")
    run.complete("agent#2.llm", {"text": "done"})
    assert run.result == "done" and run.remaining_calls().total == 0


def test_loop_rejects_a_tool_it_was_not_given():
    run = loop_program(3).start({"goal": "g"})
    with pytest.raises(ProgramRunError, match=r"^agent#1.llm: output rejected: called tool 'rm_rf'"):
        run.complete("agent#1.llm", call("rm_rf"))


def test_tool_call_mismatch_at_run_time_names_the_tool_node():
    p = Program("p", inputs={"q": str}, tools=[SEARCH, LOOKUP])
    pick = p.llm("pick", prompt="{q}", output=ToolCall(["search", "lookup"]))
    p.output(p.tool("do_search", "search", args=pick))
    run = p.compile().start({"q": "x"})
    run.complete("pick", call("lookup", key="k"))
    with pytest.raises(ProgramRunError, match=r"^do_search: pick called 'lookup', but this node runs 'search'"):
        tool_arguments(run.spec("do_search"), run.values)


def test_invalid_llm_output_ends_the_run_naming_the_node():
    p = Program("p", inputs={"q": str})
    p.output(p.llm("plan", prompt="{q}", output=JsonSchema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
    run = p.compile().start({"q": "x"})
    with pytest.raises(ProgramRunError, match=r"^plan: output rejected: output does not match its JSON schema"):
        run.complete("plan", {"n": "three"})


def test_llm_failure_without_a_fallback_ends_the_run():
    p = Program("p", inputs={"q": str})
    p.output(p.llm("a", prompt="{q}"))
    run = p.compile().start({"q": "x"})
    with pytest.raises(ProgramRunError, match=r"^a: llm call failed: out of memory"):
        run.fail("a", MemoryError("out of memory"))
    with pytest.raises(ProgramRunError, match=r"^a: the run is failed"):
        run.complete("a", "late")


def test_inputs_are_checked():
    c = loop_program(2)
    with pytest.raises(ProgramRunError, match=r"^goal: missing input"):
        c.start({})
    with pytest.raises(ProgramRunError, match=r"^goal: input must be string, got a number"):
        c.start({"goal": 3})
    with pytest.raises(ProgramRunError, match=r"^extra: not an input of program 'loop'"):
        c.start({"goal": "g", "extra": 1})


def test_begin_and_completing_nodes_that_are_not_ready():
    run = fan_out_program().start({"topics": ["a"]})
    run.begin("summaries[0].search")
    assert run.ready() == [] and run.graph.nodes["summaries[0].search"]["state"] == "running"
    with pytest.raises(ProgramRunError, match=r"^summaries\[0\]\.summary: not ready \(waiting for summaries\[0\]\.search\)"):
        run.complete("summaries[0].summary", "x")
    with pytest.raises(ProgramRunError, match=r"^summaries: is fan_out: the run completes it itself"):
        run.complete("summaries", [])
    with pytest.raises(ProgramRunError, match=r"^nope: no such node"):
        run.complete("nope", 1)
    run.complete("summaries[0].search", [])
    with pytest.raises(ProgramRunError, match=r"^[^:]+: run is running: no result"):
        run.result


def test_outputs_as_a_dict():
    p = Program("p", inputs={"q": str})
    a = p.llm("a", prompt="{q}")
    b = p.llm("b", prompt="{q}", output=JsonSchema({"type": "array"}))
    p.output({"text": a, "first": b[0]})
    run = p.compile().start({"q": "x"})
    run.complete("a", "A")
    run.complete("b", [7, 8])
    assert run.result == {"text": "A", "first": 7}


def test_a_missing_part_of_an_output_fails_naming_the_consumer():
    p = Program("p", inputs={"q": str}, tools=[SEARCH])
    hits = p.tool("hits", "search", args={"query": p.input("q")})  # no output schema: unchecked until run time
    p.output(p.fan_out("each", over=hits["pages"], body=lambda b: b.llm("s", prompt="{item}")))
    run = p.compile().start({"q": "x"})
    with pytest.raises(ProgramRunError, match=r"^each: cannot read hits.pages: hits has no key 'pages' \(keys: urls\)"):
        run.complete("hits", {"urls": []})
