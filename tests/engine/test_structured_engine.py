"""Structured outputs through the engine: always schema-valid, identical with and without
template drafting (greedy, fp32), truncation reported, bad schemas refused up front."""
from __future__ import annotations

import jsonschema
import pytest

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.errors import RequestError

S = {"type": "string", "maxLength": 24}
# Bounded numbers: an unbounded integer lets a sampled small model spin digits past any max_tokens
# (the engine then reports truncation, tested below), which is the schema's fault, not the decoder's.
I = {"type": "integer", "minimum": -100000, "maximum": 100000}
N = {"type": "number", "minimum": -1000, "maximum": 10000}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": I, "email": S},
               "required": ["id", "email"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "enum": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit", "kelvin"]}, "value": N},
             "required": ["unit", "value"]},
    "optional": {"type": "object", "properties": {"title": S, "subtitle": S, "pages": I}, "required": ["title"]},
    "anyof": {"type": "object", "properties": {"id": {"anyOf": [I, S]}}, "required": ["id"]},
    "numbers": {"type": "object", "properties": {"lat": N, "lon": N, "alt": I},
                "required": ["lat", "lon", "alt"]},
    "matrix": {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 3,
               "items": I}}}, "required": ["rows"]},
    "event": {"type": "object", "properties": {"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
              "what": S, "attendees": {"type": "array", "items": S, "maxItems": 2}}, "required": ["when", "what", "attendees"]},
    "flags": {"type": "object", "properties": {"debug": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}, "name": {"type": ["string", "null"], "maxLength": 12}},
              "required": ["debug", "level", "name"]},
}
ASK = {
    "person": "Describe a fictional person.", "nested": "Make up a user account.", "tags": "Tag a blog post about cats.",
    "enum": "Give a temperature reading.", "optional": "Describe a book.", "anyof": "Give an identifier.",
    "numbers": "Give the location of a mountain.", "matrix": "Give a small matrix.", "event": "Plan a meeting.",
    "flags": "Configure a logger.",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search_web", "description": "Search the web", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 40}}, "required": ["query"]}}}


def _fmt(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_every_generated_call_is_schema_valid(smollm2_greedy, make_engine):
    """10 schemas x 5 samples (temperature 0.8, seeded) = 50 calls: all must parse and validate.
    On the quantized path where it runs (fp32 elsewhere): validity does not depend on the weights."""
    engine = make_engine(smollm2_greedy, spec=SpecConfig(drafter="template"), kv_cache_tokens=16384)
    rids = {}
    for name in SCHEMAS:
        for i in range(5):
            p = SamplingParams(max_tokens=160, temperature=0.8, seed=i, response_format=_fmt(name))
            rids[engine.add_request([{"role": "user", "content": ASK[name]}], p)] = name
    results = {}
    while len(results) < len(rids):
        results.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    invalid = []
    for rid, name in rids.items():
        r = results[rid]
        if r.error is not None or r.parsed is None:
            invalid.append((name, r.error))
            continue
        jsonschema.validate(r.parsed, SCHEMAS[name])
    assert not invalid, invalid
    assert sum(r.spec.total.forced for r in results.values()) > 0


def test_constrained_greedy_identity_with_template_drafting(smollm2_fp32, make_engine):
    rf = {"type": "tool_call", "tools": [WEATHER, SEARCH]}
    chats = [[{"role": "user", "content": "What's the weather in Lisbon for 2 days?"}],
             [{"role": "user", "content": "Search the web for cheap flights to Rome."}],
             [{"role": "user", "content": "Describe a fictional person."}]]
    params = [SamplingParams(max_tokens=60, temperature=0, response_format=rf)] * 2 + [
        SamplingParams(max_tokens=60, temperature=0, response_format=_fmt("person"))]

    def run(engine):
        rids = [engine.add_request(c, p) for c, p in zip(chats, params)]
        got = {}
        while len(got) < len(rids):
            got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
        return [got[r] for r in rids]

    plain = run(make_engine(smollm2_fp32))
    spec = run(make_engine(smollm2_fp32, spec=SpecConfig(drafter="template")))
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]
    assert plain[0].parsed["name"] == "get_weather" and plain[1].parsed["name"] == "search_web"
    forced = sum(r.spec.total.forced for r in spec)
    passes = sum(r.spec.total.target_passes for r in spec)
    assert forced > 0 and passes < sum(len(r.token_ids) for r in spec)


def test_truncation_is_an_error_with_the_raw_text(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"))
    r = engine.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=5, temperature=0, response_format=_fmt("nested")))[0]
    assert r.parsed is None and r.finish_reason == "length"
    assert "truncated" in r.error and "max_tokens=5" in r.error and r.text in r.error


def test_bad_schema_is_refused_before_queueing(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"))
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 3}}}}}
    with pytest.raises(RequestError, match="properties/a"):
        engine.add_request([{"role": "user", "content": "hi"}], SamplingParams(response_format=bad))
    assert not engine.has_work()


def test_engines_over_one_model_share_their_grammars(tiny_loaded, make_engine):
    loaded = tiny_loaded("smollm")
    first, second = make_engine(loaded), make_engine(loaded)
    assert first.grammars is second.grammars  # tokenizer info and compiled grammars built once
    other = make_engine(tiny_loaded("llama3"))
    assert other.grammars is not first.grammars
