"""The engine on the Triton kernels (AGENTRT_KERNELS=triton: Triton's interpreter on CPU tensors):
each layer on rotary_kv_write + paged_attention + rmsnorm_residual + silu_gate, the sampler on
masked_argmax / verify_greedy, against the PyTorch path on the same tiny fp32 Llama."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.model_loader import load_model
from agentrt.engine.models.layer_ops import triton_support
from agentrt.errors import ModelLoadError
from agentrt.kernels.backend import KernelBackend, choose_backend

CHATS = [[{"role": "user", "content": "hello there, the the the"}], [{"role": "user", "content": "count: 1 2 3 1 2 3"}]]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}}, "required": ["city"]}}}


# On a CUDA machine (scripts/gpu_check.sh) the same tests run compiled on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _load(path, kernels: str):
    """The tiny Llama 3 with AGENTRT_KERNELS=kernels: the backend is chosen when the model is built."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTRT_KERNELS", kernels)
        return load_model(str(path), "float32", device=DEVICE, progress=False)


@pytest.fixture(scope="module")
def triton_llama(tiny_model_dir):
    loaded = _load(tiny_model_dir("llama3"), "triton")
    assert loaded.model.kernel_backend is KernelBackend.TRITON and loaded.model.triton_enabled
    return loaded


@pytest.fixture(scope="module")
def torch_llama(tiny_model_dir):
    loaded = _load(tiny_model_dir("llama3"), "torch")
    assert loaded.model.kernel_backend is KernelBackend.TORCH and not loaded.model.triton_enabled
    return loaded


def _generate(engine, chats, params):
    return [r.token_ids for r in engine.generate(chats, params)]


@pytest.mark.parametrize("drafter", ["none", "suffix"])
def test_greedy_output_on_triton_equals_the_pytorch_path(triton_llama, torch_llama, make_engine, drafter):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = _generate(make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE), CHATS, params)
    engine = make_engine(triton_llama, kv_cache_tokens=512, device=DEVICE, spec=SpecConfig(drafter=drafter, k=3))
    assert _generate(engine, CHATS, params) == want
    assert all(len(t) == 10 for t in want)


def test_a_constrained_tool_call_decodes_valid_on_triton_with_template_drafting(triton_llama, torch_llama, make_engine):
    rf = {"type": "tool_call", "tools": [WEATHER]}
    params = SamplingParams(max_tokens=100, temperature=0, response_format=rf)
    chat = ["weather in Lisbon? "]  # a text prompt: the tiny model's 256 positions leave no room to describe the tool
    engine = make_engine(triton_llama, kv_cache_tokens=512, device=DEVICE, spec=SpecConfig(drafter="template"))
    r = engine.generate(chat, params)[0]
    assert r.error is None, r.error
    assert r.parsed["name"] == "get_weather" and isinstance(r.parsed["arguments"]["city"], str)
    assert r.spec.total.forced > 0  # the template drafter's forced tokens went through verify_greedy
    plain = make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE).generate(chat, params)[0]
    assert r.token_ids == plain.token_ids


def test_a_family_the_triton_path_lacks_is_refused_naming_its_features(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("AGENTRT_KERNELS", "triton")
    with pytest.raises(ModelLoadError, match="AGENTRT_KERNELS=triton but .*QK-norm"):
        load_model(str(tiny_model_dir("qwen3")), "float32", device=DEVICE, progress=False)


def test_cuda_takes_the_triton_path_by_default(tiny_loaded):
    cfg = tiny_loaded("llama3").model.cfg
    assert choose_backend("cuda", {}).backend is KernelBackend.TRITON
    assert triton_support(cfg, torch.bfloat16, quantized=False) is None
    gemma = tiny_loaded("gemma3").model.cfg
    assert "sliding-window layers" in triton_support(gemma, torch.bfloat16, quantized=False)


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU machine's import graph")
def test_a_cpu_engine_never_imports_the_triton_kernels():
    code = ("import sys, json; import agentrt.engine.llm_engine, agentrt.engine.step_sampler; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('agentrt.kernels.triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
