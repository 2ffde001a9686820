"""Tool-call formats per model family: which one a chat template gets, how tools and earlier calls
render through the family's real chat template, and parsing calls back out of outputs.

The templates under data/chat_templates are the models' own, as published with them: Qwen3-0.6B,
Llama-3.3-70B-Instruct (the Llama 3.1 tool template), Mistral-Nemo-Instruct-2407 and Gemma 3's
instruction-tuned template (the same for every Gemma 3 size); llama.cpp keeps copies in
models/templates.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrt.engine.chat.messages import normalize_messages
from agentrt.engine.chat.tokenizer import Tokenizer
from agentrt.errors import RequestError
from agentrt.structured.output_format import parse_output, parse_response_format, with_instructions, with_syntax
from agentrt.structured.tool_formats import (FORMATS, GEMMA3, HOUSE, LLAMA3, MISTRAL, QWEN, detect_tool_format,
                                             mistral_call_id, tool_format)
from agentrt.structured.tool_parse import parse_tool_calls

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone.",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                        "required": ["tz"]}}}
OSLO = {"name": "get_weather", "arguments": {"city": "Oslo"}}
CET = {"name": "get_time", "arguments": {"tz": "CET"}}


def template(name: str) -> Tokenizer:
    return Tokenizer(None, {"bos_token": "<s>", "eos_token": "</s>"}, (), None, (TEMPLATES / name).read_text())


def render(tok: Tokenizer, syntax, messages: list[dict], parallel: bool = False, **rf) -> str:
    """The prompt as LLMEngine.prepare renders a tool_call request for a model with `syntax`."""
    fmt = with_syntax(parse_response_format({"type": "tool_call", "tools": [WEATHER, TIME], "parallel": parallel,
                                             **rf}), syntax)
    sent, tools = with_instructions(normalize_messages(messages), fmt, tok.has_tools_template,
                                    "tool_calls" in tok.chat_template)
    return tok.apply_chat_template(sent, add_generation_prompt=True, tools=tools)


def history(*calls: dict, content: str | None = None, follow_up: bool = True) -> list[dict]:
    """A user turn, an assistant turn that called `calls` (arguments as the OpenAI API sends them:
    JSON strings), their results, and a follow-up question."""
    ids = [f"call_{i}abcdefgh1234" for i in range(len(calls))]
    return [{"role": "user", "content": "Weather in Oslo, and the time?"},
            {"role": "assistant", "content": content, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for cid, c in zip(ids, calls)]},
            *[{"role": "tool", "tool_call_id": cid, "content": f"result {i}"} for i, cid in enumerate(ids)],
            *[{"role": "user", "content": "Thanks. And tomorrow?"}] * follow_up]


@pytest.mark.parametrize("file, expected", [("Qwen3-0.6B.jinja", QWEN), ("Llama-3.3-70B-Instruct.jinja", LLAMA3),
                                            ("gemma-3-it.jinja", GEMMA3), ("Mistral-Nemo-Instruct-2407.jinja", MISTRAL)])
def test_each_family_template_gets_its_format(file, expected):
    assert detect_tool_format((TEMPLATES / file).read_text()) is expected


def test_smollm2_keeps_the_house_format_and_architecture_decides_without_a_template():
    assert detect_tool_format(SMOLLM2_TEMPLATE, "llama") is HOUSE
    assert detect_tool_format(None, "llama") is HOUSE
    assert detect_tool_format(None, "qwen3") is QWEN and detect_tool_format(None, "gemma3") is GEMMA3
    assert tool_format("llama3") is LLAMA3
    with pytest.raises(RequestError, match="unknown tool-call format 'hermes'"):
        tool_format("hermes")


def test_qwen3_template_renders_the_tools_and_calls_as_the_format_writes_them():
    tok = template("Qwen3-0.6B.jinja")
    prompt = render(tok, QWEN, [{"role": "user", "content": "Weather in Oslo?"}])
    # the template's own tools section is the one the format writes for templates without tools
    assert QWEN.instructions((WEATHER, TIME), False, False) + "<|im_end|>" in prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in prompt
    # an earlier call renders exactly as the grammar makes the model write it, one block per call
    prompt = render(tok, QWEN, history(OSLO, CET), parallel=True)
    assert "<|im_start|>assistant\n" + QWEN.calls_text([OSLO, CET], parallel=True) + "<|im_end|>" in prompt
    assert "<tool_response>\nresult 0\n</tool_response>\n<tool_response>\nresult 1\n</tool_response>" in prompt


def test_llama3_template_renders_tools_in_the_first_user_turn_and_one_call_per_turn():
    tok = template("Llama-3.3-70B-Instruct.jinja")
    prompt = render(tok, LLAMA3, [{"role": "user", "content": "Weather in Oslo?"}])
    first_user = prompt.split("<|start_header_id|>user<|end_header_id|>\n\n", 1)[1]
    assert first_user.startswith(LLAMA3.instructions((WEATHER, TIME), False, False) + "\n\nWeather in Oslo?")
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    one = render(tok, LLAMA3, history(OSLO))
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n" + LLAMA3.calls_text([OSLO], False) + "<|eot_id|>" in one
    # the template refuses two calls in a turn: they go as two turns
    two = render(tok, LLAMA3, history(OSLO, CET), parallel=True)
    assert LLAMA3.calls_text([OSLO], False) in two and LLAMA3.calls_text([CET], False) in two
    assert two.count("<|start_header_id|>ipython<|end_header_id|>") == 2


def test_gemma3_gets_googles_prompt_in_the_first_turn_and_history_as_alternating_turns():
    tok = template("gemma-3-it.jinja")
    assert not tok.has_tools_template
    prompt = render(tok, GEMMA3, [{"role": "user", "content": "Weather in Oslo?"}], allow_text=True)
    assert prompt.startswith("<s><start_of_turn>user\nYou have access to functions. If you decide to invoke any")
    assert '"name": "get_weather",\n    "description": "Current weather in a city."' in prompt
    assert "If no tool is needed, reply in plain text instead.\n\nWeather in Oslo?<end_of_turn>" in prompt
    # the template has neither tool calls nor a tool role: calls are the model's text, results a user turn
    prompt = render(tok, GEMMA3, history(OSLO, CET), parallel=True)
    assert ("<start_of_turn>model\n" + GEMMA3.calls_text([OSLO, CET], parallel=True) + "<end_of_turn>\n"
            "<start_of_turn>user\n```tool_output\nresult 0\n```\n```tool_output\nresult 1\n```") in prompt


def test_mistral_template_gets_nine_character_call_ids():
    tok = template("Mistral-Nemo-Instruct-2407.jinja")
    prompt = render(tok, MISTRAL, history(OSLO, follow_up=False))  # its template wants an answer before a user turn
    cid = mistral_call_id("call_0abcdefgh1234")
    assert len(cid) == 9 and cid.isalnum()
    assert MISTRAL.calls_text([OSLO], False)[:-2] + f', "id": "{cid}"}}]</s>' in prompt
    assert f'"call_id": "{cid}"}}[/TOOL_RESULTS]' in prompt
    assert prompt.count("[AVAILABLE_TOOLS]") == 1


def test_house_format_is_unchanged_for_smollm2():
    tok = Tokenizer(None, {}, (), None, SMOLLM2_TEMPLATE)
    fmt = parse_response_format({"type": "tool_call", "tools": [WEATHER]})
    assert with_syntax(fmt, HOUSE) is fmt and with_syntax(fmt, None) is fmt
    sent, tools = with_instructions([{"role": "user", "content": "Hi"}], fmt, tok.has_tools_template)
    assert tools is None and sent[0]["content"].startswith("You can call these tools:")


@pytest.mark.parametrize("syntax", [QWEN, LLAMA3, GEMMA3, MISTRAL])
def test_well_formed_and_parallel_calls_parse_back(syntax):
    assert parse_tool_calls(syntax, syntax.calls_text([OSLO], False)).calls == (OSLO,)
    both = parse_tool_calls(syntax, syntax.calls_text([OSLO, CET], True), names={"get_weather", "get_time"})
    assert both.calls == (OSLO, CET) and both.content == ""
    fmt = with_syntax(parse_response_format({"type": "tool_call", "tools": [WEATHER, TIME], "parallel": True}), syntax)
    assert parse_output(fmt, syntax.calls_text([OSLO, CET], True)) == [OSLO, CET]


@pytest.mark.parametrize("syntax, text, calls, content", [
    (QWEN, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     [OSLO], "Let me check."),
    (QWEN, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', [],
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'),  # no call read: the text as written
    (QWEN, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "x",',
     [OSLO], '{"name": "x",'),
    (QWEN, "<b>bold</b> text", [], "<b>bold</b> text"),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [OSLO], ""),  # [TOOL_CALLS] decoded away
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]', [OSLO], "Sure."),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {"tz": "CET"}}',
     [OSLO, CET], ""),
    (LLAMA3, '<|python_tag|>get_weather.call(city="Oslo")', [OSLO], ""),
    (LLAMA3, '{"answer": 42}', [], '{"answer": 42}'),  # JSON that is no call is the answer
    (GEMMA3, '```tool_code\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```', [OSLO], ""),
    (GEMMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}} and then some', [OSLO], "and then some"),
    (GEMMA3, '{"name": "unknown_tool", "parameters": {}}', [], '{"name": "unknown_tool", "parameters": {}}'),
])
def test_unconstrained_outputs_parse_without_failing(syntax, text, calls, content):
    parsed = parse_tool_calls(syntax, text, names={"get_weather", "get_time"})
    assert list(parsed.calls) == calls and parsed.content == content


def test_parse_output_treats_malformed_calls_as_text_unless_a_call_was_required():
    auto = with_syntax(parse_response_format({"type": "tool_call", "tools": [WEATHER], "allow_text": True}), QWEN)
    assert parse_output(auto, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>') is None
    assert parse_output(auto, "It is sunny.") is None
    required = with_syntax(parse_response_format({"type": "tool_call", "tools": [WEATHER], "tool_choice": "required"}),
                           QWEN)
    with pytest.raises(ValueError, match="no valid call of get_weather"):
        parse_output(required, "It is sunny.")


def test_every_format_writes_what_it_reads():
    for syntax in FORMATS.values():
        assert parse_tool_calls(syntax, syntax.calls_text([OSLO, CET], True)).calls == (OSLO, CET), syntax.name
        with pytest.raises(ValueError, match="2 calls in a turn that writes one"):
            syntax.calls_text([OSLO, CET], False)


def test_the_module_examples_hold():
    import doctest

    import agentrt.server.tool_stream
    import agentrt.structured.tool_parse

    for module in (agentrt.structured.tool_parse, agentrt.server.tool_stream):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
