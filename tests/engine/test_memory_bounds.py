"""The engine's memory settings reach what they bound: the step log, the shared grammar cache and
the drafters' history of earlier outputs; a history too small to draft from is refused."""
from __future__ import annotations

import pytest

from agentrt.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from agentrt.errors import SpecConfigError


def test_settings_bound_the_step_log_grammars_and_draft_history():
    engine = LLMEngine(EngineConfig(kv_cache_tokens=512, step_log_steps=3, grammar_cache_bytes=1 << 20,
                                    spec=SpecConfig(drafter="template", history_tokens=16)))
    params = SamplingParams(max_tokens=8, temperature=0)
    for i in range(3):
        engine.generate([[{"role": "user", "content": f"Count to {i + 5}."}]], params)
    assert engine.step_no > 3 and len(engine.step_log) == 3
    assert engine.step_log[-1].step == engine.step_no - 1  # the newest kept
    assert engine.grammars.max_bytes == 1 << 20
    suffix = engine.spec.drafter.suffix
    assert suffix.config.history_tokens == 16 and 0 < suffix.history_tokens <= 16


@pytest.mark.parametrize("bad", [0, 1, -5, True, 2.5])
def test_a_history_too_small_is_refused(bad):
    with pytest.raises(SpecConfigError, match="history_tokens"):
        SpecConfig(drafter="suffix", history_tokens=bad)
