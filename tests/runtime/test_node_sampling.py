"""An LLM node's further sampling settings (penalties, top_p, ...): checked by name when the
program is built, and sent with the node's request."""
from __future__ import annotations

import pytest

from agentrt.dag import Program
from agentrt.errors import ProgramValidationError
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend


def test_unknown_sampling_setting_names_the_node():
    p = Program("t", inputs={"q": str})
    with pytest.raises(ProgramValidationError, match=r"answer.*frequency_penalti"):
        p.llm("answer", prompt="{q}", sampling={"frequency_penalti": 0.5})
    with pytest.raises(ProgramValidationError, match="sampling must be a dict"):
        p.llm("answer2", prompt="{q}", sampling=[("top_p", 0.9)])


async def test_sampling_settings_reach_the_backend():
    p = Program("t", inputs={"q": str})
    p.output(p.llm("answer", prompt="{q}", sampling={"frequency_penalty": 0.5, "stop": ["\n\n"],
                                                     "logit_bias": {5: -100}}))
    backend = ScriptedBackend({"answer": "ok"})
    async with Runtime(backend) as rt:
        result = await rt.run(p.compile(), {"q": "hi"})
    assert result.ok
    [request] = backend.requests
    assert dict(request.sampling) == {"frequency_penalty": 0.5, "stop": ("\n\n",), "logit_bias": ((5, -100),)}
    await backend.aclose()
