"""Chat messages are checked before the chat template sees them (agentrt/engine/chat/messages.py)."""
from __future__ import annotations

import pytest

from agentrt.engine import SamplingParams
from agentrt.engine.chat.messages import normalize_messages
from agentrt.errors import RequestError


def test_text_parts_and_tool_only_replies_are_rendered():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, {"role": "tool", "content": "{}"}]
    out = normalize_messages(msgs)
    assert [m["content"] for m in out] == ["ab", "", "{}"]
    assert out[1]["tool_calls"] == [{"id": "1"}] and msgs[0]["content"][0]["text"] == "a"  # the input is untouched


@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string or a list of text parts, got int"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\]\.content: missing"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]: only text parts .* got 'image_url'"),
    ([{"role": "user", "content": ["hi"]}], r"messages\[0\]\.content\[0\]: only text parts .* got 'str'"),
    ([{"role": "user", "content": "x"}, 7], r"messages\[1\]: expected an object"),
])
def test_bad_messages_name_the_field(messages, match):
    with pytest.raises(RequestError, match=match):
        normalize_messages(messages)


def test_the_engine_refuses_them_at_submission(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("llama3"))
    with pytest.raises(RequestError, match=r"messages\[0\]\.content"):
        engine.add_request([{"role": "user", "content": {"text": "x"}}])
    assert engine.unfinished() == []
    rid = engine.add_request([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], SamplingParams(max_tokens=8))
    assert engine.sequence(rid).prompt_ids
