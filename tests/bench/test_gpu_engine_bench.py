"""scripts/gpu_engine_bench.py, the GPU day's engine timings: its speculation and tool-call parts
run here on the CPU engine (the PyTorch path, a tiny model), so a change to what they read from
the engine's results shows before a lent GPU's minutes are spent on it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_engine_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_engine_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from agentrt.engine import EngineConfig, LLMEngine
    from agentrt.engine.loading.model_loader import load_model

    path = str(tiny_model_dir("smollm"))
    loaded = load_model(path, "float32", progress=False)
    return lambda **kw: LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_tokens=4096, **kw), loaded=loaded)


def test_spec_summary(bench, engine):
    got = bench.spec_summary(engine, tokens=8)
    assert got["same_tokens"] is True and got["plain_tokens_per_s"] > 0 and got["spec_tokens_per_s"] > 0
    assert got["spec"]["total"]["emitted"] == 8  # the report as JSON, the request's 8 tokens
    json.dumps(got)


def test_toolcall_summary(bench, engine):
    got = bench.toolcall_summary(engine)
    assert got["requests"] == got["valid"] == 8 and got["tokens"] > 0  # the budget's completion closes each call
    assert got["forced"] > 0 and got["tokens_per_pass"] > 1  # the skeleton drafted and accepted
    json.dumps(got)
