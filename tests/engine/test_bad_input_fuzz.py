"""Bad input beside good input: fuzzed sampling params, messages and JSON schemas (generated, and
a list of known-hard ones) are each submitted next to a well-formed request. The fuzzed request
is refused at submission with a RequestError, or runs and ends (done or with its own error)
within a bounded number of steps; the well-formed one always completes with the tokens it gets
alone; the engine is left with no unfinished request and consistent blocks. Hypothesis runs a
fixed, derandomized budget of examples."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.errors import RequestError

GOOD = ([{"role": "user", "content": "Name a colour."}], dict(max_tokens=12, temperature=0))
MAX_STEPS = 200  # a fuzzed request runs at most 16 tokens: far fewer steps than this

_leaf = {"type": "string", "maxLength": 8}
HARD_SCHEMAS = [
    {"$defs": {"n": {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}}, "required": ["child"]}},
     "$ref": "#/$defs/n"},  # recursion without end
    {"type": "object", "properties": {"c": {"enum": [f"v{i}" for i in range(5000)]}}, "required": ["c"]},  # huge enum
    {"$ref": "http://127.0.0.1:9/x.json"},  # remote
    {"type": "boolean", "if": {"$ref": "http://127.0.0.1:9/x.json"}},  # remote, nested
    {"$ref": "#/$defs/missing"},  # dangling
    {"type": "integer", "minimum": 10, "maximum": 1},  # contradictory bounds
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "string", "pattern": "(unclosed"},
    {"type": "unknown"},
    {"type": "object", "properties": {"a": _leaf}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1},
    {"anyOf": []},
    {"enum": []},
    True,
    "not a schema",
]


def _deep(depth: int) -> dict:
    node: dict = _leaf
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    return node


HARD_SCHEMAS += [_deep(40), _deep(300)]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=5), st.lists(st.integers(-3, 60000), max_size=3))
params = st.fixed_dictionaries({}, optional={
    name: scalars for name in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "frequency_penalty",
                               "presence_penalty", "repetition_penalty", "min_tokens", "logprobs", "logit_bias")})
contents = st.one_of(st.text(max_size=40), st.none(), st.integers(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "audio", 3])}), st.text(max_size=3)), max_size=3))
messages = st.lists(st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "", 7]),
                                                     "content": contents}),
                              st.integers(), st.text(max_size=5)), min_size=0, max_size=3)
json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4))
generated_schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array"])},
                          optional={"minimum": st.integers(-5, 5), "maximum": st.integers(-5, 5),
                                    "maxLength": st.integers(0, 8), "enum": st.lists(json_leaves, max_size=3)}),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.sampled_from("abc"), inner, max_size=3)},
                              optional={"required": st.lists(st.sampled_from("abcd"), max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"minItems": st.integers(0, 3),
                                                                                   "maxItems": st.integers(0, 3)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)})),
    max_leaves=6)
formats = st.one_of(st.none(), st.sampled_from(HARD_SCHEMAS), generated_schemas).map(
    lambda s: None if s is None else {"type": "json_schema", "json_schema": {"name": "f", "schema": s}})


@pytest.fixture(scope="module")
def engine_factory(smollm2_greedy, make_engine):
    # batch-invariant greedy: the good request's tokens cannot depend on what runs beside it
    return lambda: make_engine(smollm2_greedy, spec=SpecConfig(drafter="template"))


@pytest.fixture(scope="module")
def good_alone(engine_factory):
    engine = engine_factory()
    rid = engine.add_request(GOOD[0], SamplingParams(**GOOD[1]))
    return _run(engine, [rid])[rid].token_ids


def _run(engine, rids):
    results = {}
    for _ in range(MAX_STEPS):
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result
        if len(results) == len(rids):
            return results
    raise AssertionError(f"requests {set(rids) - set(results)} did not end within {MAX_STEPS} steps")


def _submit(engine, msgs, kw, fmt) -> int | None:
    """The fuzzed request's id, or None when it was refused (with a RequestError, nothing else)."""
    try:
        kw = dict(kw)
        if isinstance(kw.get("max_tokens"), int) and kw["max_tokens"] > 16:
            kw["max_tokens"] = 16  # keep the run short; the bound itself is tested elsewhere
        p = SamplingParams(**kw, response_format=fmt)
        if p.max_tokens > 16:
            p = SamplingParams(**{**kw, "max_tokens": 16}, response_format=fmt)
        return engine.add_request(msgs, p)
    except RequestError:
        return None


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(msgs=messages, kw=params, fmt=formats)
def test_fuzzed_requests_never_harm_a_good_one(engine_factory, good_alone, msgs, kw, fmt):
    engine = engine_factory()
    good = engine.add_request(GOOD[0], SamplingParams(**GOOD[1]))
    bad = _submit(engine, msgs, kw, fmt)
    results = _run(engine, [good] if bad is None else [good, bad])
    assert results[good].error is None and results[good].token_ids == good_alone
    if bad is not None:
        assert results[bad].finish_reason in ("stop", "length", "error")
    assert engine.unfinished() == []
    engine.blocks.check_invariants()


@pytest.mark.parametrize("schema", HARD_SCHEMAS, ids=range(len(HARD_SCHEMAS)))
def test_each_known_hard_schema_is_refused_or_harmless(engine_factory, good_alone, schema):
    engine = engine_factory()
    good = engine.add_request(GOOD[0], SamplingParams(**GOOD[1]))
    bad = _submit(engine, [{"role": "user", "content": "Fill it in."}], {"temperature": 0},
                  {"type": "json_schema", "json_schema": {"name": "hard", "schema": schema}})
    results = _run(engine, [good] if bad is None else [good, bad])
    assert results[good].token_ids == good_alone
    if bad is not None:  # accepted: it ran to an end of its own
        assert results[bad].finish_reason in ("stop", "length", "error")
    assert engine.unfinished() == []
    engine.blocks.check_invariants()
