"""Constrained outputs end valid within max_tokens (engine.step.budget): at every budget from the
schema's minimum up, with and without speculation, the output parses and meets its schema, the
tokens before the forced completion are the model's own, and the completion is short."""
from __future__ import annotations

import json

import jsonschema
import pytest

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.step.budget import CLOSING_WINDOW
from agentrt.structured.grammar import GrammarState
from agentrt.structured.output_format import parse_output, parse_response_format

RECIPE = {"type": "object", "properties": {
    "title": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "steps": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "n": {"type": "integer"}, "text": {"type": "string"},
        "tools": {"type": "array", "items": {"type": "string", "enum": ["pan", "whisk", "spatula"]}}},
        "required": ["n", "text"]}}}, "required": ["title", "tags", "steps"]}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query", "limit"]}}},
    {"type": "function", "function": {"name": "weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CASES = {  # name -> (response_format, prompt)
    "nested": ({"type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE}},
               "Write a detailed pancake recipe as JSON with many tags and ten steps, each naming its tools."),
    "calls": ({"type": "tool_call", "tools": TOOLS, "parallel": True},
              "Search for pancake, crepe, waffle and blini recipes, and get the weather in Oslo, Paris and Rome."),
    "long_string": ({"type": "json_schema", "json_schema": {"name": "essay", "schema": {
        "type": "object", "properties": {"essay": {"type": "string"}}, "required": ["essay"]}}},
        "Write a long essay about the history of pancakes as JSON with one field, essay."),
}


def minimum_tokens(engine, rf) -> int:
    """The length of the completion from an empty output: the shortest budget that can work."""
    return engine.constraints.grammars.minimum_tokens(parse_response_format(rf), engine.tokenizer.encode)


def run_budgets(engine, rf, prompt, budgets):
    """One request per budget, all in one batch (greedy)."""
    messages = [{"role": "user", "content": prompt}]
    rids = {engine.add_request(messages, SamplingParams(max_tokens=b, temperature=0, response_format=rf)): b
            for b in budgets}
    results = {}
    while len(results) < len(rids):
        results.update({rids[ev.request_id]: ev.result for ev in engine.step() if ev.finished})
    return results


@pytest.mark.parametrize("drafter", ["none", "template"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_budget_from_the_minimum_up_gives_valid_json(smollm2_greedy, make_engine, case, drafter):
    engine = make_engine(smollm2_greedy, spec=SpecConfig(drafter=drafter))
    rf, prompt = CASES[case]
    fmt = parse_response_format(rf)
    low = minimum_tokens(engine, rf)
    budgets = list(range(low, low + 32))
    unbounded = budgets[-1] + CLOSING_WINDOW + 32  # never watched while a budget's tokens are written
    full = run_budgets(engine, rf, prompt, [unbounded])[unbounded]
    results = run_budgets(engine, rf, prompt, budgets)
    # the prompts ask for more than the low budgets hold: the completion is exercised, not only plain ends
    assert any(r.completion_tokens for r in results.values())
    for b, r in results.items():
        assert r.error is None and r.parsed is not None, (b, r.text, r.error)
        assert len(r.token_ids) <= b
        assert parse_output(fmt, r.text) == r.parsed  # valid against the schema
        if r.completion_tokens:
            assert r.finish_reason == "length"
            own = len(r.token_ids) - r.completion_tokens
            # the model's own tokens, then the completion (batch-invariant greedy: as the unbounded run wrote them)
            assert r.token_ids[:own] == full.token_ids[:own], b
            assert r.completion_tokens <= low + 12
        else:
            assert r.token_ids == full.token_ids[: len(r.token_ids)]
    if case == "calls":  # a list of calls ends after the current one
        assert any(len(r.parsed) > 1 for r in run_budgets(engine, rf, prompt, [budgets[-1]]).values())


def test_below_the_minimum_the_output_is_cut_and_says_so(smollm2_greedy, make_engine):
    engine = make_engine(smollm2_greedy)
    rf, prompt = CASES["nested"]
    low = minimum_tokens(engine, rf)
    r = run_budgets(engine, rf, prompt, [low - 1])[low - 1]
    assert r.parsed is None and r.finish_reason == "length" and "truncated" in r.error


@pytest.mark.parametrize("text,expected", [
    ('{"title": "Pan', '", "tags": [], "steps": [{"n": 0, "text": ""}]}'),
    ('{"title": "x", "tags": ["a", "b', '"], "steps": [{"n": 0, "text": ""}]}'),
    ('{"title": "x", "tags": [], "steps": [{"n": 12', ', "text": ""}]}'),
    ('{"title": "x", "tags": [], "steps": [{"n": 1, "text": "y", "tools": ["wh', 'isk"]}]}'),
])
def test_completion_closes_what_is_open_and_adds_what_is_required(smollm2_greedy, make_engine, text, expected):
    engine = make_engine(smollm2_greedy)
    state = GrammarState(engine.constraints.grammars.compile(parse_response_format(CASES["nested"][0])))
    tok = engine.tokenizer
    assert state.try_advance(tok.encode(text)) == len(tok.encode(text))
    completion = state.completion(tok.encode, text)
    assert completion == expected
    jsonschema.validate(json.loads(text + completion), RECIPE)
    assert state.try_advance(tok.encode(completion)) == len(tok.encode(completion)) and state.complete


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 8}, {"type": "string"}, {"type": "string", "minLength": 2}])
def test_strings_never_take_raw_control_characters(smollm2_greedy, make_engine, schema):
    """JSON forbids them (json.loads rejects the text); xgrammar's rule for bounded strings let them in."""
    engine = make_engine(smollm2_greedy)
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": schema}, "required": ["a"]}}}
    state = GrammarState(engine.constraints.grammars.compile(parse_response_format(rf)))
    ids = engine.tokenizer.encode('{"a": "x')
    assert state.try_advance(ids) == len(ids)
    for ch in "\x00\x03\x1f\t\n":
        assert state.try_advance(engine.tokenizer.encode(ch)) == 0, repr(ch)
    assert state.try_advance(engine.tokenizer.encode("y")) == 1


def test_a_call_is_never_completed_into_a_text_answer(smollm2_fp32, make_engine):
    """A tool-call format that may answer in text: below what a call needs, the output is the
    model's call cut (an error), never a text answer made up by the completion. fp32: the
    quantized weights answer this prompt in text, not with the call."""
    engine = make_engine(smollm2_fp32)
    rf = {"type": "tool_call", "tools": TOOLS[1:], "allow_text": True}
    prompt = '{"name": "weather", "arguments": {"city": "Oslo"}} -- reply exactly with this JSON.'
    full = run_budgets(engine, rf, prompt, [200])[200]
    assert isinstance(full.parsed, dict) and full.parsed["name"] == "weather"
    for b, r in run_budgets(engine, rf, prompt, list(range(1, 30, 2))).items():
        assert r.text.lstrip().startswith("{"), (b, r.text)
        assert (r.parsed is not None and r.parsed["name"] == "weather") or "truncated" in r.error, (b, r.text)


def test_escapes_and_complete_prefixes(smollm2_greedy, make_engine):
    engine = make_engine(smollm2_greedy)
    tok = engine.tokenizer
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}
    state = GrammarState(engine.constraints.grammars.compile(parse_response_format(rf)))
    text = '{"a": "x\\'
    assert state.try_advance(tok.encode(text)) == len(tok.encode(text))
    completion = state.completion(tok.encode, text)
    assert json.loads(text + completion)["a"].startswith("x")
    # a number that is complete before the token the model wrote: the output ends there
    number = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number"}}}
    for b, r in run_budgets(engine, number, "Give the value of pi as JSON.", [1, 2, 3]).items():
        assert r.error is None and isinstance(r.parsed, (int, float)), (b, r.text, r.error)


@pytest.mark.parametrize("drafter", ["none", "template"])
def test_logprobs_follow_the_tokens_after_a_cut(smollm2_greedy, make_engine, drafter):
    engine = make_engine(smollm2_greedy, spec=SpecConfig(drafter=drafter))
    rf, prompt = CASES["calls"]
    low = minimum_tokens(engine, rf)
    messages = [{"role": "user", "content": prompt}]
    rids = [engine.add_request(messages, SamplingParams(max_tokens=b, temperature=0, response_format=rf, logprobs=2))
            for b in range(low, low + 12)]
    results = {}
    while len(results) < len(rids):
        results.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    assert any(r.completion_tokens for r in results.values())
    for r in results.values():
        assert r.parsed is not None
        assert [lp.token_id for lp in r.logprobs] == r.token_ids


def test_a_schema_whose_minimum_exceeds_the_window(smollm2_greedy, make_engine):
    """15 required fields: the shortest valid output is over 100 tokens, longer than the fixed
    window; the search starts early enough anyway (at a multiple of the schema's minimum)."""
    engine = make_engine(smollm2_greedy)
    props = {"essay": {"type": "string"}, **{f"field_number_{i}": {"type": "string"} for i in range(14)}}
    rf = {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "object", "properties": props, "required": list(props)}}}
    low = minimum_tokens(engine, rf)
    assert low > CLOSING_WINDOW
    results = run_budgets(engine, rf, "Write a long essay about the history of pancakes as JSON, essay first.",
                          [low, low + 40])
    for b, r in results.items():
        assert r.error is None and set(r.parsed) == set(props), (b, r.error)
