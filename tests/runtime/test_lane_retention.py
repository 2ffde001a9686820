"""A long-lived runtime (a server) keeps only the engine steps that runs and calls in flight
still need: after a program run is released and while only chat calls come, the trace's
engine lane does not grow with every step."""
from __future__ import annotations

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.backend import LLMRequest, NodeIdentity


def chat_request(i: int) -> LLMRequest:
    return LLMRequest(messages=({"role": "user", "content": f"question {i} " * 8},), response_format={"type": "text"},
                      max_tokens=16, temperature=0.0, node=NodeIdentity(f"chat-{i}", "chat.completions", "completion"))


async def test_chat_calls_leave_no_engine_steps_behind(scripted):
    backend = scripted(lambda req: "one two three four five six")
    runtime = Runtime(backend)
    p = Program("one", inputs={"q": str})
    p.output(p.llm("answer", prompt="Answer {q}"))
    handle = runtime.submit(p.compile(), {"q": "why"})
    result = await handle.wait()
    assert result.status == "done"
    records = runtime.release(handle.run_id)
    assert any(r["type"] == "engine_step" for r in records)  # the run's own lane went with it
    for i in range(20):
        response = await runtime.complete(chat_request(i))
        assert response.text == "one two three four five six"
    # each call's steps are dropped once nothing in flight started before them
    assert [r for r in runtime.trace.records() if r["type"] == "engine_step"] == []
    # a run in flight keeps the steps since it started
    handle = runtime.submit(p.compile(), {"q": "how"})
    await runtime.complete(chat_request(99))
    assert [r for r in runtime.trace.records() if r["type"] == "engine_step"]
    assert (await handle.wait()).status == "done"
    released = runtime.release(handle.run_id)
    assert [r for r in released if r["type"] == "engine_step"]
    await runtime.aclose()
