"""The JSON depth limit and the parser for JSON from outside: the depth measured in the text
agrees with the parsed value's, deep or unbalanced text is refused without recursion, and good
text parses as json.loads parses it."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, json_depth, parse_json, text_depth_exceeds

tricky_text = st.sampled_from(['[', ']', '{', '}', '"', '\\', '\\"', 'x', '\\\\"]'])
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.lists(tricky_text, max_size=4).map("".join), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.lists(tricky_text, max_size=3).map("".join), inner, max_size=3)),
    max_leaves=30)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(value=values, limit=st.integers(0, 8), indent=st.sampled_from([None, 1]))
def test_the_text_depth_is_the_value_depth(value, limit, indent):
    """Brackets inside strings (escaped quotes included) do not count."""
    text = json.dumps(value, indent=indent)
    assert text_depth_exceeds(text, limit) == (json_depth(value, limit) > limit)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000, 1_000_000])
@pytest.mark.parametrize("shape", ["list", "object", "unclosed", "closers first"])
def test_deep_text_is_refused_naming_the_limit(depth, shape):
    text = {"list": "[" * depth + "]" * depth, "object": '{"a":' * depth + "1" + "}" * depth,
            "unclosed": "[" * depth, "closers first": "]" * 10 + "[" * depth}[shape]
    with pytest.raises(JsonDepthError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        parse_json(text)
    with pytest.raises(JsonDepthError):
        parse_json(text.encode())


def test_text_at_the_limit_parses_as_json_loads_does():
    at_limit = "[" * MAX_JSON_DEPTH + '"]["' + "]" * MAX_JSON_DEPTH
    assert parse_json(at_limit) == json.loads(at_limit)
    assert parse_json(b'{"a": [1, 2.5, null, "\\u00e9"]}') == {"a": [1, 2.5, None, "é"]}
    assert parse_json('{"a": "x"}'.encode("utf-16")) == {"a": "x"}  # encodings json.loads detects
    assert parse_json(" [NaN] ")[0] != parse_json(" [NaN] ")[0]
    for bad in ("", "[1,", "{'a': 1}", b"\xff\xfe\xfd"):
        with pytest.raises(ValueError):
            parse_json(bad)


def test_a_wide_document_is_measured_quickly():
    """The body limit's worth of shallow JSON: the depth check costs about what parsing does."""
    text = json.dumps([[i, {"k": [i, "[[{"]}] for i in range(100_000)])
    t0 = time.perf_counter()
    json.loads(text)
    parse_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert not text_depth_exceeds(text, MAX_JSON_DEPTH)
    assert time.perf_counter() - t0 < 3 * parse_s + 0.05
