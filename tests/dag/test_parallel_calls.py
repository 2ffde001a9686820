"""Several tool calls in one model turn: ToolCall(parallel=True) and agent_loop(parallel_calls=True).

Each call of a step becomes its own tool node ("<loop>#k.tool[i]"); a call streamed while the step
still writes adds its node at once; the next step follows once the step and all its calls have
ended, and reads their results in the order the calls were made."""
from __future__ import annotations

import pytest

from agentrt.dag import Program, ToolCall, render_prompt
from agentrt.errors import ProgramRunError, ProgramValidationError

TOOLS = [{"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
         {"name": "mail", "parameters": {"type": "object", "properties": {"to": {"type": "string"}}}}]


def loop_run(output: str = "text", max_steps: int = 3):
    p = Program("agent", inputs={"q": str}, tools=TOOLS)
    p.output(p.agent_loop("agent", prompt="{q}", tools=["lookup", "mail"], max_steps=max_steps,
                          parallel_calls=True, output=output))
    return p.compile().start({"q": "?"})


def calls(*pairs) -> list[dict]:
    return [{"name": n, "arguments": a} for n, a in pairs]


TWO = calls(("lookup", {"q": "a"}), ("mail", {"to": "b"}))


def test_a_step_may_make_several_calls_each_its_own_tool_node():
    run = loop_run(output="detail")
    step = run.spec("agent#1.llm").output
    assert step.parallel and step.to_response_format()["parallel"] is True
    assert run.complete("agent#1.llm", TWO) == ["agent#1.tool[0]", "agent#1.tool[1]"]
    assert [run.spec(t).tool for t in ("agent#1.tool[0]", "agent#1.tool[1]")] == ["lookup", "mail"]
    # the calls end out of order: the next step waits for both, and reads them in the order made
    assert run.complete("agent#1.tool[1]", "sent") == []
    assert run.complete("agent#1.tool[0]", "found a") == ["agent#2.llm"]
    messages = render_prompt(run.spec("agent#2.llm"), run.values)
    assert [c["function"]["name"] for c in messages[-3]["tool_calls"]] == ["lookup", "mail"]
    assert [(m["role"], m["name"], m["content"], m["tool_call_id"]) for m in messages[-2:]] == \
        [("tool", "lookup", "found a", "call_1_1"), ("tool", "mail", "sent", "call_1_2")]
    assert [c["id"] for c in messages[-3]["tool_calls"]] == ["call_1_1", "call_1_2"]
    run.complete("agent#2.llm", calls(("lookup", {"q": "c"})))
    run.fail("agent#2.tool[0]", TimeoutError("lookup timed out"))  # its error goes back to the model
    assert "lookup timed out" in render_prompt(run.spec("agent#3.llm"), run.values)[-1]["content"]
    run.complete("agent#3.llm", "done")
    assert run.result == {"answer": "done", "ended": "answered_at_max_steps", "steps": 3, "tool_calls": [
        {"name": "lookup", "arguments": {"q": "a"}, "ok": True, "step": 1},
        {"name": "mail", "arguments": {"to": "b"}, "ok": True, "step": 1},
        {"name": "lookup", "arguments": {"q": "c"}, "ok": False, "step": 2}]}


def test_calls_stream_one_by_one_and_the_next_step_waits_for_the_turn():
    run = loop_run()
    run.begin("agent#1.llm")
    assert run.stream_call("agent#1.llm", TWO[0], 0)
    assert run.ready() == ["agent#1.tool[0]"] and run.is_early("agent#1.tool[0]")
    assert not run.stream_call("agent#1.llm", TWO[1], 2)  # out of order: not recorded
    run.begin("agent#1.tool[0]")
    # the first call's tool ends while the model still writes: no next step (more calls may come)
    assert run.complete("agent#1.tool[0]", "found a") == []
    assert run.stream_call("agent#1.llm", TWO[1], 1)
    assert run.ready() == ["agent#1.tool[1]"]
    run.begin("agent#1.tool[1]")
    assert run.complete("agent#1.tool[1]", "sent") == []
    # the turn ends with the calls it streamed: every call has ended, so the next step is ready
    assert run.complete("agent#1.llm", TWO) == ["agent#2.llm"]
    assert [t for _, *t in run.spec("agent#2.llm").history] == [["agent#1.tool[0]", "agent#1.tool[1]"]]


def test_a_turn_that_ends_with_more_calls_than_it_streamed_adds_them():
    run = loop_run()
    run.begin("agent#1.llm")
    run.stream_call("agent#1.llm", TWO[0], 0)
    assert run.complete("agent#1.llm", TWO) == ["agent#1.tool[1]"]  # tool[0] is ready already


def test_a_turn_that_differs_from_its_streamed_calls_fails_naming_them():
    run = loop_run()
    run.begin("agent#1.llm")
    run.stream_call("agent#1.llm", TWO[0], 0)
    with pytest.raises(ProgramRunError, match=r"differs from the members it streamed \(the call of 'lookup'"):
        run.complete("agent#1.llm", calls(("lookup", {"q": "other"})))


def test_calls_at_max_steps_fail_the_loop_naming_them():
    p = Program("agent", inputs={"q": str}, tools=TOOLS)
    p.output(p.agent_loop("agent", prompt="{q}", tools=["lookup", "mail"], max_steps=1, on_max_steps="error",
                          parallel_calls=True))
    run = p.compile().start({"q": "?"})
    with pytest.raises(ProgramRunError, match="step 1 called 'lookup', 'mail'"):
        run.complete("agent#1.llm", TWO)


def test_a_parallel_call_node_feeds_tools_one_call_each():
    p = Program("pick", inputs={"q": str}, tools=TOOLS)
    pick = p.llm("pick", prompt="{q}", output=ToolCall(["lookup"], parallel=True))
    p.output({"a": p.tool("a", "lookup", args=pick["calls"][0]), "b": p.tool("b", "lookup", args=pick["calls"][1])})
    run = p.compile().start({"q": "?"})
    assert run.spec("a").args_from_call
    run.begin("pick")
    run.stream_call("pick", {"name": "lookup", "arguments": {"q": "x"}}, 0)
    assert run.ready() == ["a"]  # b reads a call not made yet
    assert run.complete("pick", calls(("lookup", {"q": "x"}), ("lookup", {"q": "y"}))) == ["b"]
    assert run.values["pick"] == {"calls": calls(("lookup", {"q": "x"}), ("lookup", {"q": "y"})), "text": None}


def test_the_whole_list_of_calls_is_no_argument_object():
    p = Program("pick", inputs={"q": str}, tools=TOOLS)
    pick = p.llm("pick", prompt="{q}", output=ToolCall(["lookup"], parallel=True))
    p.output(p.tool("a", "lookup", args=pick))
    with pytest.raises(ProgramValidationError, match=r"parallel calls .*args=pick\['calls'\]\[i\]"):
        p.compile()


def test_parallel_call_values_are_checked():
    out = ToolCall(["lookup"], parallel=True, allow_text=True)
    assert out.check("no call needed") == {"calls": [], "text": "no call needed"}
    assert out.check({"name": "lookup", "arguments": {}}) == {"calls": calls(("lookup", {})), "text": None}
    with pytest.raises(ValueError, match="at least one call"):
        out.check([])
    with pytest.raises(ValueError, match="'mail', which is not one of"):
        out.check(calls(("lookup", {}), ("mail", {})))


def test_parallel_calls_must_be_a_bool():
    p = Program("agent", inputs={"q": str}, tools=TOOLS)
    with pytest.raises(ProgramValidationError, match="parallel_calls must be True or False"):
        p.agent_loop("agent", prompt="{q}", tools=["lookup"], parallel_calls="yes")
