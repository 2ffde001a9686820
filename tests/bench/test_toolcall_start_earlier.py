"""bench toolcall's first_call_start_earlier: the tokens after the first call's arguments closed,
and their time at the run's decode speed."""
from __future__ import annotations

import pytest

from agentrt.bench.toolcall import first_call_start_earlier

PIECES = ['{"name": ', '"lookup", ', '"arguments": ', '{"q": ', '"bees"', '}', '}', '']  # '' : the end token


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def test_tokens_after_the_arguments_close_and_their_time():
    ids = list(range(len(PIECES)))
    # the arguments close with token 5; tokens 6 ("}") and 7 (the end) come after; 7 decode
    # intervals took 70 ms: 10 ms a token
    tokens, ms = first_call_start_earlier(decode, ids, decode_s=0.070)
    assert tokens == 2 and ms == pytest.approx(20.0)


def test_no_call_no_figure():
    assert first_call_start_earlier(lambda ids: "I cannot call a tool.", [1, 2, 3], 0.01) is None
    assert first_call_start_earlier(decode, [0, 1, 2, 3], 0.01) is None  # the arguments never closed


def test_in_a_list_of_calls_the_rest_of_the_turn_counts():
    """Parallel calls: the first call's tool could start before the second call is written."""
    pieces = ['[{"name": "lookup", "arguments": {"q": "a"}', '}, ', '{"name": "lookup", ', '"arguments": {"q": "b"}',
              '}', ']', '']
    ids = list(range(len(pieces)))
    tokens, ms = first_call_start_earlier(lambda ids: "".join(pieces[i] for i in ids), ids, decode_s=0.060)
    assert tokens == 6 and ms == pytest.approx(60.0)
