"""The compiled-grammar cache is bounded in bytes: the least recently used grammars go first, a
dropped one compiles again when it comes back, and the bound can be lowered on a live cache."""
from __future__ import annotations

import string

import pytest

from agentrt.structured.output_format import parse_response_format

VOCAB = list(string.printable[:95]) + ["</s>"]


def schema_format(i: int):
    return parse_response_format({"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": {
        "type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}}})


@pytest.fixture
def make_cache():
    import xgrammar as xgr

    from agentrt.structured.grammar import GrammarCache

    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
    return lambda max_bytes: GrammarCache(info, max_bytes)


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def test_least_recently_used_grammars_are_dropped_past_the_bound(make_cache):
    one = make_cache(1 << 30).compile(schema_format(0)).memory_size_bytes
    cache = make_cache(3 * one + one // 2)  # room for three of these grammars
    first = cache.compile(schema_format(0))
    dropped = cache.compile(schema_format(1))
    minimum = cache.minimum_tokens(schema_format(1), encode)
    assert minimum >= len('{"field_1":0}')
    cache.compile(schema_format(2))
    assert cache.compile(schema_format(0)) is first  # a hit, and now the most recently used
    cache.compile(schema_format(3))  # over the bound: format 1 (least recently used) goes
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert cache.compile(schema_format(0)) is first
    again = cache.compile(schema_format(1))  # compiled again: the cache had dropped it
    assert again is not dropped
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert cache.minimum_tokens(schema_format(1), encode) == minimum
    assert cache.compile(schema_format(1)) is again


def test_a_lower_bound_drops_grammars_at_once_but_keeps_the_newest(make_cache):
    cache = make_cache(1 << 30)
    for i in range(4):
        cache.compile(schema_format(i))
    newest = cache.compile(schema_format(3))
    cache.bound(0)  # smaller than any grammar: only the one a request may be using stays
    assert len(cache) == 1 and cache.compile(schema_format(3)) is newest
    with pytest.raises(ValueError, match="bound must be an integer >= 0"):
        cache.bound(-1)
