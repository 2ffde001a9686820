"""Response formats: parsing, bad schemas named, prompt instructions, output validation, and
exactness of verification under a grammar mask."""
from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chisquare

from agentrt.decoding.sampling import process_logits
from agentrt.errors import RequestError
from agentrt.spec.verify import verify_drafts
from agentrt.structured.output_format import instructions, parse_output, parse_response_format, with_instructions

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_invalid_schema_names_the_offending_part():
    with pytest.raises(RequestError, match=r"properties/age.*not valid|properties/age"):
        parse_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object", "properties": {"age": {"type": "integr"}}}}})
    bad_tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "required": "city"}}}
    with pytest.raises(RequestError, match="tool 't' parameters"):
        parse_response_format({"type": "tool_call", "tools": [bad_tool]})
    with pytest.raises(RequestError, match="unknown type"):
        parse_response_format({"type": "yaml"})
    with pytest.raises(RequestError, match="empty"):
        parse_response_format({"type": "tool_call", "tools": []})
    with pytest.raises(RequestError, match="expected an object with a 'schema', got str"):
        parse_response_format({"type": "json_schema", "json_schema": '{"type": "object"}'})


@pytest.mark.parametrize("schema, fragment", [
    # a remote reference would be fetched by the validator when the output completes (and fail
    # the engine step); the grammar ignores it, so the output would not even be constrained
    ({"type": "boolean", "if": {"$ref": "http://127.0.0.1:9/x.json"}},
     r"\$ref 'http://127.0.0.1:9/x.json' at /if is not a local reference"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "at /properties/a is not a local"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "names nothing in the schema"),
])
def test_schemas_with_references_outside_themselves_are_refused_up_front(schema, fragment):
    with pytest.raises(RequestError, match=fragment):
        parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def test_local_references_are_fine():
    schema = {"$defs": {"city": {"type": "string"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/city"}, "b": {"$ref": "#"}}}
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert parse_output(fmt, '{"a": "Oslo"}') == {"a": "Oslo"}


def test_tool_call_format_and_parse():
    fmt = parse_response_format({"type": "tool_call", "tools": [WEATHER], "allow_text": True})
    assert fmt.kind == "tool_call" and fmt.constrained
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert parse_output(fmt, json.dumps(call)) == call
    assert parse_output(fmt, "It is sunny.") is None  # answered in text
    with pytest.raises(ValueError, match="schema violation"):
        parse_output(fmt, json.dumps({"name": "get_weather", "arguments": {}}))
    # Tools are described in the system message with the grammar's own JSON formatting.
    text = instructions(fmt)
    assert json.dumps(WEATHER["function"], separators=(", ", ": ")) in text
    msgs, tools = with_instructions([{"role": "user", "content": "hi"}], fmt, template_has_tools=False)
    assert msgs[0]["role"] == "system" and tools is None
    msgs, tools = with_instructions([{"role": "user", "content": "hi"}], fmt, template_has_tools=True)
    assert tools == [WEATHER] and msgs == [{"role": "user", "content": "hi"}]


def test_instructions_of_a_later_turn_leave_the_earlier_turns_as_sent():
    """A first turn's format goes into the system message (shared by every prompt of one kind);
    once the conversation has a reply, the new turn's format joins that turn, so the earlier
    turns keep the tokens whose KV the engine cached (LLMSpec.continues)."""
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}})
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan."}]
    sent, _ = with_instructions(first, fmt, template_has_tools=False)
    assert sent[0]["content"].startswith("Be brief.\n\nReply with only a JSON object") and sent[1] == first[1]
    later = [*sent, {"role": "assistant", "content": "{}"}, {"role": "user", "content": "Again."}]
    again, _ = with_instructions(later, fmt, template_has_tools=False)
    assert again[:3] == later[:3]
    assert again[3]["content"].startswith("Again.\n\nReply with only a JSON object")
    assert later[3]["content"] == "Again."  # the caller's messages are not changed


def test_verification_is_exact_under_a_mask():
    """Target logits masked by a grammar (tokens 1 and 4 forbidden); drafts come from an
    UNMASKED q that often proposes forbidden tokens. The first emitted token must follow the
    masked p: chi-square over the allowed tokens, N = 2e5, p-value > 1e-4; forbidden tokens
    must never appear."""
    g = torch.Generator().manual_seed(3)
    V, N = 6, 200_000
    logits = torch.tensor([[0.3, 1.2, -0.4, 0.8, 2.0, 0.1]])
    allowed = torch.tensor([True, False, True, True, False, True])
    masked = logits.masked_fill(~allowed, float("-inf"))
    ones = torch.ones(1)
    p = process_logits(masked, ones, torch.zeros(1, dtype=torch.long), ones)[0]  # [V]
    q = torch.tensor([0.1, 0.3, 0.1, 0.1, 0.3, 0.1])
    drafts = torch.multinomial(q, N, replacement=True, generator=g)
    target = p.repeat(2 * N, 1)  # k = 1: rows (draft position, bonus position) per sequence
    res = verify_drafts(target, drafts, torch.arange(N + 1), q.repeat(N, 1), torch.rand(N, generator=g), torch.rand(N, generator=g))
    first = res.output_tokens[:, 0]
    counts = torch.bincount(first, minlength=V)
    assert counts[~allowed].sum() == 0
    expected = p[allowed].double() / p[allowed].double().sum() * N
    _, pvalue = chisquare(counts[allowed].double().numpy(), expected.double().numpy())
    assert pvalue > 1e-4


@pytest.mark.parametrize("seed", range(20))
def test_masked_argmax_equals_masking_then_argmax(seed):
    """The engine's greedy path under grammars: every row (masked or not) matches apply_masks +
    argmax, ties included (a few distinct logit values make ties common), and logits stay as
    they were."""
    import xgrammar as xgr

    from agentrt.structured.grammar import apply_masks, masked_argmax

    g = torch.Generator().manual_seed(seed)
    n, vocab = 7, 100
    logits = torch.randint(0, 4, (n, vocab), generator=g).float()
    bitmask = xgr.allocate_token_bitmask(n, vocab)
    bits = torch.rand(n, vocab, generator=g) < 0.3
    bits[torch.arange(n), torch.randint(0, vocab, (n,), generator=g)] = True  # every row allows one
    packed = torch.zeros(n, bitmask.shape[1], dtype=torch.int64)
    for t in range(vocab):
        packed[:, t // 32] |= bits[:, t].long() << (t % 32)
    bitmask.copy_(((packed + 2**31) % 2**32 - 2**31).to(torch.int32))
    rows = [i for i in range(n) if torch.rand((), generator=g) < 0.7]
    before = logits.clone()
    got = masked_argmax(logits, bitmask, rows)
    assert torch.equal(logits, before)
    ref = logits.clone()
    apply_masks(ref, bitmask, rows)
    assert torch.equal(got, ref.argmax(dim=-1))


def test_quoted_spans_are_what_the_request_quotes():
    """The template drafter's guess for a free string value: spans the request put in '...',
    not apostrophes inside words."""
    from agentrt.spec.drafters.template import QUOTED_SPAN

    text = "Translate 'Where is the train station?' into German. It's fine, don't worry; file 'memo.txt'."
    assert QUOTED_SPAN.findall(text) == ["Where is the train station?", "memo.txt"]
    assert QUOTED_SPAN.findall("the user's data isn't 'x' or ''") == []


def test_parallel_tool_calls_are_a_list_of_valid_calls():
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
    fmt = parse_response_format({"type": "tool_call", "tools": [WEATHER, time_tool], "parallel": True, "allow_text": True})
    assert fmt.parallel and fmt.schema["type"] == "array" and fmt.schema["minItems"] == 1
    assert "JSON list of calls" in instructions(fmt)
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]
    assert parse_output(fmt, json.dumps(calls)) == calls
    assert parse_output(fmt, "No tool needed.") is None and fmt.is_text_answer("No tool needed.")
    assert not fmt.is_text_answer(' [{"name"')
    with pytest.raises(ValueError, match="schema violation"):
        parse_output(fmt, json.dumps([{"name": "get_time", "arguments": {"city": "Oslo"}}]))
    with pytest.raises(ValueError, match="schema violation"):
        parse_output(fmt, "[]")
    single = parse_response_format({"type": "tool_call", "tools": [WEATHER]})
    assert not single.parallel and single.cache_key() != parse_response_format(
        {"type": "tool_call", "tools": [WEATHER], "parallel": True}).cache_key()


def test_parallel_grammar_takes_a_list_or_text_and_nothing_else():
    import xgrammar as xgr

    from agentrt.structured.grammar import GrammarCache

    vocab = ["[", "{", "]", "}", '"', "Hi", " there", ",", ":", " "] + [f"<tok{i}>" for i in range(6)]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    fmt = parse_response_format({"type": "tool_call", "tools": [WEATHER], "parallel": True, "allow_text": True})
    compiled = GrammarCache(info).compile(fmt)
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_token(vocab.index("["))  # a list of calls
    m = xgr.GrammarMatcher(compiled)
    assert not m.accept_token(vocab.index("{"))  # a lone call object is neither a list nor text
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_token(vocab.index("Hi"))  # text


def test_tool_choice_none_takes_text_that_does_not_start_like_a_call():
    import xgrammar as xgr

    from agentrt.structured.grammar import GrammarCache

    vocab = ["[", "{", "]", "}", '"', "Hi", " there", ",", ":", " "] + [f"<tok{i}>" for i in range(6)]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    none = parse_response_format({"type": "tool_call", "tools": [WEATHER], "tool_choice": "none"})
    auto = parse_response_format({"type": "tool_call", "tools": [WEATHER], "allow_text": True})
    assert none.constrained and none.cache_key() != auto.cache_key()
    cache = GrammarCache(info)
    for tok, ok in (("Hi", True), ("{", False), ("[", False), (" ", False)):
        assert xgr.GrammarMatcher(cache.compile(none)).accept_token(vocab.index(tok)) == ok, tok
    assert xgr.GrammarMatcher(cache.compile(auto)).accept_token(vocab.index("{"))  # auto: a call is fine
    assert parse_output(none, "It is sunny.") is None
