"""The grammar of each family's call turn (structured.grammar.family_grammar) run on token strings of the
SmolLM2 tokenizer, with Qwen's and Mistral's wrapper tokens added as the real vocabularies have
them: it accepts exactly the format's calls of the schema's tools, and the template drafter
forces the wrapper as the model's own tokens."""
from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer

from agentrt.spec.drafters.base import DraftRequest
from agentrt.spec.drafters.suffix import SuffixDrafter
from agentrt.spec.drafters.template import TemplateDrafter
from agentrt.structured.grammar import GrammarCache, GrammarState, tokenizer_info, xgr
from agentrt.structured.output_format import parse_response_format, with_syntax
from agentrt.structured.tool_formats import GEMMA3, LLAMA3, MISTRAL, QWEN

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["tz"]}}}
OSLO = {"name": "get_weather", "arguments": {"city": "Oslo"}}
CET = {"name": "get_time", "arguments": {"tz": "CET"}}
STOP = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def vocab(smollm2_source):
    tok = Tokenizer.from_file(str(smollm2_source.path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    cache = GrammarCache(tokenizer_info(tok, tok.get_vocab_size(with_added_tokens=True), [STOP]))
    return tok, cache


def fmt_of(syntax, parallel=False, **rf):
    return with_syntax(parse_response_format({"type": "tool_call", "tools": [WEATHER, TIME], "parallel": parallel,
                                             **rf}), syntax)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def accepts(vocab, fmt, text: str) -> bool:
    tok, cache = vocab
    m = xgr.GrammarMatcher(cache.compile(fmt))
    return all(m.accept_token(t) for t in encode(tok, text)) and m.accept_token(STOP)


@pytest.mark.parametrize("syntax", [QWEN, LLAMA3, GEMMA3, MISTRAL])
def test_grammar_accepts_exactly_the_formats_calls(vocab, syntax):
    required = fmt_of(syntax, tool_choice="required")
    assert accepts(vocab, required, syntax.calls_text([OSLO], False))
    assert accepts(vocab, required, syntax.calls_text([CET], False))
    assert not accepts(vocab, required, syntax.calls_text([OSLO, CET], True))  # one call only
    assert not accepts(vocab, required, "It is sunny.")
    assert not accepts(vocab, required, syntax.calls_text([{"name": "get_weather", "arguments": {"town": "Oslo"}}], False))
    assert not accepts(vocab, required, syntax.calls_text([{"name": "get_time", "arguments": {"tz": "PST"}}], False))
    assert not accepts(vocab, required, syntax.calls_text([{"name": "get_news", "arguments": {}}], False))
    # another family's syntax is not this one's (where it writes the call differently: at least one does)
    others = [o for o in {QWEN, LLAMA3, MISTRAL} - {syntax} if o.calls_text([OSLO], False) != syntax.calls_text([OSLO], False)]
    assert others
    for other in others:
        assert not accepts(vocab, required, other.calls_text([OSLO], False)), other.name
    parallel = fmt_of(syntax, parallel=True, tool_choice="required")
    assert accepts(vocab, parallel, syntax.calls_text([OSLO, CET], True))
    assert accepts(vocab, parallel, syntax.calls_text([OSLO, CET, OSLO], True))
    assert accepts(vocab, parallel, syntax.calls_text([OSLO], True))


@pytest.mark.parametrize("syntax", [QWEN, LLAMA3, GEMMA3, MISTRAL])
def test_tool_choice_auto_none_and_named(vocab, syntax):
    call = syntax.calls_text([OSLO], False)
    auto = fmt_of(syntax, allow_text=True)
    assert accepts(vocab, auto, call) and accepts(vocab, auto, "It is sunny in Oslo.")
    assert not accepts(vocab, auto, " " + call)  # text never starts blank: a call can hide behind it
    none = fmt_of(syntax, tool_choice="none")
    assert accepts(vocab, none, "It is sunny.") and not accepts(vocab, none, call)
    named = fmt_of(syntax, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert accepts(vocab, named, syntax.calls_text([CET], False)) and not accepts(vocab, named, call)


def test_formats_compile_apart_and_the_house_cache_key_is_unchanged(vocab):
    _, cache = vocab
    house = parse_response_format({"type": "tool_call", "tools": [WEATHER]})
    assert house.cache_key() == with_syntax(house, None).cache_key()
    keys = {fmt_of(s).cache_key() for s in (QWEN, LLAMA3, GEMMA3, MISTRAL)}
    assert len(keys) == 4 and house.cache_key() not in keys


def test_template_drafter_forces_the_wrapper_as_the_vocabularys_own_tokens(vocab):
    tok, cache = vocab
    state = GrammarState(cache.compile(fmt_of(QWEN, tool_choice="required")))
    drafter = TemplateDrafter(SuffixDrafter(), lambda s: encode(tok, s), lambda ids: tok.decode(ids))
    drafter.attach(0, state)
    prompt = encode(tok, "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    drafter.start(0, prompt)
    [draft] = drafter.propose([DraftRequest(0, prompt, 16)])
    assert draft.tokens[0] == tok.token_to_id("<tool_call>") and all(draft.forced[:4])
    assert tok.decode(draft.tokens).startswith('<tool_call>\n{"name": "get_')
    # the draft rolled the grammar back: the masks still start at the turn's beginning
    assert state.forced_string().startswith("<tool_call>")
    mistral = GrammarState(cache.compile(fmt_of(MISTRAL, tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}})))
    drafter.attach(1, mistral)
    drafter.start(1, prompt)
    [draft] = drafter.propose([DraftRequest(1, prompt, 16)])
    assert draft.tokens[0] == tok.token_to_id("[TOOL_CALLS]")
    assert tok.decode(draft.tokens, skip_special_tokens=False).startswith('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":')


def test_qwen_may_think_before_calling_where_text_is_allowed(vocab):
    from agentrt.structured.output_format import parse_output

    thought = "<think>\nThe user wants Oslo's weather.\n</think>\n\n" + QWEN.calls_text([OSLO], False)
    auto = fmt_of(QWEN, allow_text=True)
    assert accepts(vocab, auto, thought) and not auto.is_text_answer(QWEN.calls_text([OSLO], False))
    assert parse_output(auto, thought) == OSLO
    assert not accepts(vocab, fmt_of(QWEN, tool_choice="required"), thought)
    assert not accepts(vocab, auto, "<tool_cal>")  # a near miss of the wrapper is neither a call nor text
