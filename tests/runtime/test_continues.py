"""A call that continues an earlier call's conversation (LLMSpec.continues) on the embedded
engine: its prompt replays what the earlier call sent (the engine's JSON instructions included),
so the engine reuses the KV of that prompt and of the reply, held while the tool ran."""
from __future__ import annotations

import asyncio

from agentrt.dag import JsonSchema, Program
from agentrt.runtime import EngineBackend, Runtime
from agentrt.tools import tool

PLAN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}


@tool(idempotent=True)
async def lookup(city: str) -> dict:
    """Facts about a city."""
    await asyncio.sleep(0.05)
    return {"city": city, "museums": 12}


async def test_a_continued_call_reuses_the_conversation_kv(engine):
    p = Program("continued", inputs={"request": str}, tools=[lookup])
    plan = p.llm("plan", system="You are a concise travel assistant.",
                 prompt="Trip request: {request}\nGive the JSON object for this trip.", output=JsonSchema(PLAN),
                 max_tokens=40)
    look = p.tool("look", "lookup", args={"city": plan["city"]})
    p.output(p.llm("note", continues=plan, prompt="Facts: {look}\nNow one sentence about the trip.", max_tokens=8))
    backend = EngineBackend(engine)
    requests = {}
    complete = backend.complete

    async def recording(request, **kw):
        requests[request.node.node] = request
        return await complete(request, **kw)

    backend.complete = recording
    rt = Runtime(backend, tools=[lookup])
    try:
        result = await asyncio.wait_for(rt.run(p, {"request": "Two days in Oslo."}), 120)
    finally:
        await rt.aclose()
        backend.close()
    assert result.ok, result.error
    sent_plan = rt.runs[result.run_id].sent["plan"]
    assert "JSON schema" in sent_plan[0]["content"]  # the engine's format instructions were recorded
    assert list(sent_plan[1:]) == list(requests["plan"].messages[1:])
    note_messages = requests["note"].messages
    assert list(note_messages[:2]) == list(sent_plan)
    assert note_messages[2]["role"] == "assistant" and note_messages[2]["content"].startswith('{"city": ')
    assert "note" not in rt.runs[result.run_id].sent  # nothing continues it

    spans = {s["attributes"]["agentrt.node"]: s["attributes"] for s in rt.trace.records()
             if s["type"] == "span" and s["parent_id"] is None and "agentrt.node" in s["attributes"]}
    first, note = spans["plan"], spans["note"]
    conversation = first["gen_ai.usage.input_tokens"] + first["gen_ai.usage.output_tokens"]
    block = engine.engine.blocks.block_size
    # every full block of the earlier prompt and reply, less the last one or two (the reply's
    # end-of-turn token and the chat template's markup around it are written differently)
    assert note["gen_ai.usage.cache_read.input_tokens"] >= (conversation // block - 2) * block
    assert note["agentrt.kv.hold_outcome"] == "hit" and note["agentrt.kv.hold_from"] == "plan"
    engine.engine.blocks.check_invariants()


async def test_fan_out_branches_continue_an_outer_conversation(scripted):
    """Each branch of a fan-out continues the same outer call: every branch's request starts with
    that conversation, and only the messages of calls that are continued are kept."""
    p = Program("branches", inputs={"topic": str})
    poem = p.llm("poem", system="Be brief.", prompt="A haiku about {topic}")
    title = p.llm("title", continues=poem, prompt="Its title?")
    words = p.llm("words", prompt="Two words on {topic}", output=JsonSchema({"type": "array", "items": {
        "type": "string"}}))
    p.output(p.fan_out("notes", over=words, body=lambda b: b.llm("note", continues=title, prompt="Now {item}.")))
    backend = scripted({"poem": "Rain falls", "title": "Rain", "words": ["wet", "grey"], "notes*": "ok"})
    rt = Runtime(backend)
    result = await asyncio.wait_for(rt.run(p, {"topic": "rain"}), 10)
    await rt.aclose()
    assert result.ok, result.error
    notes = sorted((r for r in backend.requests if r.node.node.startswith("notes[")), key=lambda r: r.node.node)
    assert [[m["content"] for m in r.messages] for r in notes] == [
        ["Be brief.", "A haiku about rain", "Rain falls", "Its title?", "Rain", f"Now {w}."] for w in ("wet", "grey")]
    assert sorted(rt.runs[result.run_id].sent) == ["poem", "title"]


async def test_an_agent_loops_answering_step_reuses_the_kv_of_the_steps_before(engine):
    """The last step of an agent loop (on_max_steps="answer") keeps the tools described and only
    forbids calling them (tool_choice "none"), so its prompt starts with the tokens of the step
    before: the engine reuses their KV. With a plain text format the system message would lose
    the tool instructions and nothing after its first line would be reused."""
    from agentrt.engine import SamplingParams
    from agentrt.runtime.engine_backend import chat_messages

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    step = {"type": "tool_call", "tools": tools, "allow_text": True}
    messages = [{"role": "system", "content": "You are a weather assistant."},
                {"role": "user", "content": "What is the weather in Oslo? Use the tool."}]
    first = await engine.generate(messages, SamplingParams(max_tokens=32, temperature=0, response_format=step))
    history = chat_messages((*messages,
                             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                             {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "4 C, rain"}))
    block = engine.engine.blocks.block_size
    answer = await engine.generate(history, SamplingParams(max_tokens=4, temperature=0,
                                                           response_format={**step, "tool_choice": "none"}))
    assert answer.parsed is None and answer.error is None  # free text, no grammar
    assert answer.cached_tokens >= (first.prompt_tokens // block - 1) * block
    plain = await engine.generate(history, SamplingParams(max_tokens=4, temperature=0))
    assert plain.cached_tokens < 2 * block
