"""The inference engine. Public names load lazily so `agentrt.engine.loading.registry` stays light."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLMEngine": "agentrt.engine.llm_engine",
    "EngineConfig": "agentrt.engine.llm_engine",
    "AsyncEngine": "agentrt.engine.async_engine",
    "SamplingParams": "agentrt.engine.sampling_params",
    "SpecConfig": "agentrt.engine.step.spec_runner",
    "GenerationResult": "agentrt.engine.outputs",
    "TokenEvent": "agentrt.engine.outputs",
    "load_model": "agentrt.engine.loading.model_loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agentrt.engine' has no attribute {name!r}")
