"""The engine on the Triton kernels (AGENTRT_KERNELS=triton: Triton's interpreter on CPU tensors):
each layer on rotary_kv_write + paged_attention + rmsnorm_residual + silu_gate, the sampler on
masked_argmax / verify_greedy, against the PyTorch path on the same tiny fp32 Llama."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.loading.model_loader import load_model
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


@pytest.fixture
def triton_sampler_calls(monkeypatch):
    """{op name: calls} of the step sampler's Triton ops in this test."""
    from agentrt.engine.step import step_sampler

    calls: dict[str, int] = {}
    real = step_sampler._triton_ops()

    def counted(name):
        def op(*args):
            calls[name] = calls.get(name, 0) + 1
            return getattr(real, name)(*args)
        return op

    spied = step_sampler._SamplingOps(*(counted(n) for n in ("greedy", "sample", "verify_greedy", "verify_drafts")))
    monkeypatch.setattr(step_sampler, "_triton_ops", lambda: spied)
    return calls


def _generate(engine, chats, params):
    return [r.token_ids for r in engine.generate(chats, params)]


@pytest.mark.parametrize("drafter", ["none", "suffix"])
def test_greedy_output_on_triton_equals_the_pytorch_path(triton_llama, torch_llama, make_engine, drafter,
                                                        triton_sampler_calls):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = _generate(make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE), CHATS, params)
    engine = make_engine(triton_llama, kv_cache_tokens=512, device=DEVICE, spec=SpecConfig(drafter=drafter, k=3))
    assert not triton_sampler_calls  # the PyTorch-path model samples on the CPU ops
    assert _generate(engine, CHATS, params) == want
    assert all(len(t) == 10 for t in want)
    assert triton_sampler_calls["greedy"] > 0 and ("verify_greedy" in triton_sampler_calls) == (drafter != "none")


def test_seeded_sampling_on_triton_equals_the_pytorch_path_with_and_without_drafts(triton_llama, torch_llama, make_engine,
                                                                                    triton_sampler_calls):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    want = _generate(make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE), CHATS, params)
    for drafter in ("none", "suffix"):  # masked_sample draws, verify_greedy couples the point-mass drafts
        engine = make_engine(triton_llama, kv_cache_tokens=512, device=DEVICE, spec=SpecConfig(drafter=drafter, k=3))
        assert _generate(engine, CHATS, params) == want, drafter
    assert triton_sampler_calls["sample"] > 0 and triton_sampler_calls["verify_greedy"] > 0


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
    code = ("import sys, json; import agentrt.engine.llm_engine, agentrt.engine.step.step_sampler; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('agentrt.kernels.triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter runs on CPU-only machines")
def test_the_interpreter_runs_the_kernels_when_torch_imported_triton_first():
    # torch._dynamo imports triton (transformers imports torch._dynamo): triton.language's own
    # functions are then set up for a GPU, and kernels/triton rewraps them for the interpreter
    code = ("import sys, torch, torch._dynamo; assert 'triton' in sys.modules; "
            "from agentrt.kernels.triton.masked_sample import masked_argmax; "
            "from agentrt.kernels.triton.rmsnorm import rmsnorm_residual, rmsnorm_residual_reference; "
            "x, w = torch.randn(5, 70), torch.randn(70); "
            "assert torch.equal(masked_argmax(x), x.argmax(-1)); "
            "torch.testing.assert_close(rmsnorm_residual(x, x, w, 1e-6), rmsnorm_residual_reference(x, x, w, 1e-6)); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# ---- steps replayed from captured graphs (engine/models/step_graphs.py) ------------------------
# On CPU a replay reruns the forward on the bucket's buffers: the buckets, the padding and the
# copies are what these tests prove; on a GPU (scripts/gpu_check.sh) the same tests capture and
# replay CUDA graphs.

@pytest.mark.parametrize("drafter", ["none", "suffix"])
def test_steps_replayed_from_graphs_give_the_pytorch_path_s_tokens(triton_llama, torch_llama, make_engine, drafter):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    chats = CHATS + [[{"role": "user", "content": "one more: a b c a b c"}]]  # 3 sequences: the 4-wide bucket pads one
    want = _generate(make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE), chats, params)
    engine = make_engine(triton_llama, kv_cache_tokens=512, device=DEVICE, cuda_graphs=True,
                         spec=SpecConfig(drafter=drafter, k=3))
    assert _generate(engine, chats, params) == want
    graphs = engine.step_graphs
    assert graphs.replays > 0
    assert any(b.batch == 4 for b in graphs.graphs)  # three sequences decoding together, one padded
    if drafter == "suffix":
        assert any(b.rows > 1 for b in graphs.graphs)  # verification runs of k + 1 rows, ragged within the bucket


def test_a_step_fits_the_smallest_bucket_or_none(triton_llama, make_engine):
    from agentrt.engine.models.attention import build_attention_metadata
    from agentrt.engine.models.batch import ForwardBatch
    from agentrt.engine.models.step_graphs import Bucket

    engine = make_engine(triton_llama, kv_cache_tokens=512, device=DEVICE, cuda_graphs=True, max_num_seqs=16)
    graphs = engine.step_graphs
    assert graphs.batch_buckets == (1, 2, 4, 8, 16)  # none past max_num_seqs

    def batch(num_new: list[int]) -> ForwardBatch:
        T = sum(num_new)
        pos = torch.arange(T)
        meta = build_attention_metadata(num_new, [40] * len(num_new), pos, [[1, 2, 3]] * len(num_new), 16,
                                        torch.device(DEVICE))
        return ForwardBatch(pos, pos, pos, meta, logits_indices=pos)

    assert graphs.bucket_for(batch([1])) == Bucket(1, 1)
    assert graphs.bucket_for(batch([1, 4, 2])) == Bucket(4, 4)  # 3 sequences, at most 4 rows
    assert graphs.bucket_for(batch([9] * 5)) == Bucket(8, 16)
    assert graphs.bucket_for(batch([17])) is None  # a prefill chunk runs eagerly
    assert graphs.bucket_for(batch([1] * 17)) is None  # more sequences than the largest bucket


def test_graphs_refuse_a_model_off_the_triton_path(torch_llama, make_engine):
    with pytest.raises(ValueError, match="Triton"):
        make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE, cuda_graphs=True)
    assert make_engine(torch_llama, kv_cache_tokens=512, device=DEVICE).step_graphs is None  # the default: off there
