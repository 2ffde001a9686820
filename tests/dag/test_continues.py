"""LLMSpec.continues: a call that carries on an earlier call's conversation. Declaration and
compile errors name the node; the rendered messages are the earlier call's (as sent, when the
runtime recorded them), its reply, then the new user turn."""
import json

import pytest

from agentrt.dag import JsonSchema, Program, ToolCall, render_prompt
from agentrt.errors import ProgramRunError, ProgramValidationError

PLAN = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}
TOOLS = [{"name": "lookup", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def trip():
    p = Program("trip", inputs={"request": str}, tools=TOOLS)
    plan = p.llm("plan", system="Be brief.", prompt="Plan: {request}", output=JsonSchema(PLAN))
    look = p.tool("look", "lookup", args={"city": plan["city"]})
    p.output(p.llm("note", continues=plan, prompt="It said {look}. Write the note.", max_tokens=32))
    return p.compile()


def test_the_continued_call_comes_first_with_its_reply_as_the_model_wrote_it():
    program = trip()
    assert ("plan", "note") in program.graph.edges  # continuing is reading: the call waits for it
    run = program.start({"request": "Oslo, 2 days"})
    run.complete("plan", {"city": "Oslo", "days": 2})
    run.complete("look", {"ok": True})
    messages = render_prompt(run.spec("note"), run.values, run.spec)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Plan: Oslo, 2 days"},
        # JSON with the separators a JSON output is generated with (", " and ": ")
        {"role": "assistant", "content": '{"city": "Oslo", "days": 2}'},
        {"role": "user", "content": 'It said {"ok": true}. Write the note.'},
    ]
    # What the backend really sent (format instructions added) is replayed instead, so the new
    # prompt starts with exactly the tokens of the earlier one.
    sent = {"plan": [{"role": "system", "content": "Be brief.\n\nReply with JSON."},
                     {"role": "user", "content": "Plan: Oslo, 2 days"}]}
    again = render_prompt(run.spec("note"), run.values, run.spec, sent)
    assert again[:2] == sent["plan"] and again[2:] == messages[2:]
    assert sent["plan"][0]["content"].endswith("JSON.")  # the record is not changed by rendering


def test_a_chain_of_continued_calls_and_a_fan_out_branch_continuing_an_outer_call():
    p = Program("chain", inputs={"topic": str})
    poem = p.llm("poem", prompt="A haiku about {topic}")
    title = p.llm("title", continues=poem, prompt="Its title?")
    lines = p.llm("lines", prompt="Three words on {topic}", output=JsonSchema({"type": "array", "items": {
        "type": "string"}}))
    notes = p.fan_out("notes", over=lines, body=lambda b: b.llm("note", continues=title, prompt="Now {item}."))
    p.output({"title": title, "notes": notes})
    run = p.compile().start({"topic": "rain"})
    run.complete("poem", "Rain falls")
    run.complete("title", "Rain")
    run.complete("lines", ["wet", "grey"])
    assert sorted(run.ready()) == ["notes[0].note", "notes[1].note"]
    messages = render_prompt(run.spec("notes[1].note"), run.values, run.spec)
    assert [m["content"] for m in messages] == ["A haiku about rain", "Rain falls", "Its title?", "Rain", "Now grey."]


def test_rendering_without_the_specs_names_the_node():
    run = trip().start({"request": "Oslo"})
    run.complete("plan", {"city": "Oslo", "days": 1})
    run.complete("look", {})
    with pytest.raises(ProgramRunError, match="note.*continues plan"):
        render_prompt(run.spec("note"), run.values)


def test_declaration_errors_name_the_node():
    p = Program("bad", inputs={"topic": str})
    poem = p.llm("poem", prompt="A haiku about {topic}", output=JsonSchema(PLAN))
    with pytest.raises(ProgramValidationError, match="title: continues must be the Ref of an earlier LLM call"):
        p.llm("title", prompt="Its title?", continues="poem")
    with pytest.raises(ProgramValidationError, match="title2: continues must be the Ref"):
        p.llm("title2", prompt="Its title?", continues=poem["city"])
    with pytest.raises(ProgramValidationError, match="title3: a call that continues poem keeps that "
                                                     "conversation's system prompt"):
        p.llm("title3", prompt="Its title?", continues=poem, system="Be brief.")


@pytest.mark.parametrize("earlier, needle", [
    (lambda p: p.input("topic"), "which is not an LLM call (input)"),
    (lambda p: p.tool("look", "lookup", args={"city": p.input("topic")}), "which is not an LLM call (tool)"),
    (lambda p: p.llm("call", prompt="Look {topic} up", output=ToolCall(["lookup"])),
     "which answers with a tool call; to carry on after a tool's result use agent_loop"),
])
def test_only_a_call_answering_in_text_or_json_can_be_continued(earlier, needle):
    p = Program("bad", inputs={"topic": str}, tools=TOOLS)
    ref = earlier(p)
    p.output(p.llm("next", prompt="Go on about {topic}.", continues=ref))
    with pytest.raises(ProgramValidationError) as e:
        p.compile()
    assert any(node == "next" and needle in text for node, text in e.value.problems), e.value.problems


def test_the_reply_of_a_json_call_renders_without_escaping_text():
    program = trip()
    run = program.start({"request": "Zürich"})
    run.complete("plan", {"city": "Zürich", "days": 1})
    run.complete("look", {})
    reply = render_prompt(run.spec("note"), run.values, run.spec)[2]["content"]
    assert reply == json.dumps({"city": "Zürich", "days": 1}, ensure_ascii=False) and "Zürich" in reply
