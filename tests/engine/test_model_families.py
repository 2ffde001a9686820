"""Llama 3.x rope scaling, Qwen3 and Gemma 3 (text) on our model code, against transformers on
the same tiny random weights (tests/engine/tiny_models.py): logits for a ragged prefill and decode
steps, greedy output with speculation and in a batch, and the fused kernels' refusal."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_runs import forward_step

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.llama import LlamaModel
from agentrt.engine.loading.weights import load_state_dict
from agentrt.errors import ModelLoadError

transformers = pytest.importorskip("transformers")
FAMILIES = ["llama3", "qwen3", "gemma3"]
# fp32: observed max differences ~3e-6 (Gemma 3's extra norms and soft-capping add a little)
ATOL = 1e-4
LENGTHS = (9, 23, 2, 15)  # longer than Gemma's window of 6, so sliding layers drop positions
DECODE_STEPS = 3


def _ours(model, seqs: list[list[int]], batch_invariant: bool, kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each sequence's logits at every position: all prefills in one ragged batch (but the last
    DECODE_STEPS tokens), then one decode step per remaining token, all sequences together."""
    bm = BlockManager(256, 4)
    kv = KVCache(model.cfg, 256, 4, kv_dtype or model.kv_dtype)
    n = [len(s) - DECODE_STEPS for s in seqs]
    rows = [[] for _ in seqs]
    out = forward_step(model, kv, bm, [s[:k] for s, k in zip(seqs, n)], [0] * len(seqs), batch_invariant)
    for i, chunk in enumerate(out.split(n)):
        rows[i].append(chunk)
    for step in range(DECODE_STEPS):
        pos = [k + step for k in n]
        out = forward_step(model, kv, bm, [[s[p]] for s, p in zip(seqs, pos)], pos, batch_invariant)
        for i in range(len(seqs)):
            rows[i].append(out[i : i + 1])
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, batch_invariant, tiny_loaded, tiny_model_dir):
    loaded = tiny_loaded(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, loaded.model.cfg.vocab_size, (n + DECODE_STEPS,), generator=g).tolist() for n in LENGTHS]
    ours = _ours(loaded.model, seqs, batch_invariant)
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    for mine, theirs in zip(ours, ref):
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max().item() < ATOL


def test_families_parse_their_features(tiny_loaded):
    llama3, qwen3, gemma3 = (tiny_loaded(f).model.cfg for f in FAMILIES)
    assert llama3.rope_scaling.kind == "llama3" and not llama3.triton_gaps()
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32 != qwen3.hidden_size // 4
    assert qwen3.triton_gaps() == ["QK-norm"]
    assert gemma3.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (gemma3.sliding_window, gemma3.rope_local_theta, gemma3.rope_theta) == (6, 1e4, 1e6)
    assert (gemma3.rope_scaling.kind, gemma3.rope_scaling.factor) == ("linear", 2.0)
    assert gemma3.attention_scale == 24**-0.5 and gemma3.final_logit_softcapping == 30.0
    assert gemma3.hidden_act == "gelu_tanh" and gemma3.gemma_norms and gemma3.tie_word_embeddings


def test_gemma3_sliding_window_is_applied(tiny_loaded):
    """The same weights with a window wider than every sequence give other logits past the window."""
    loaded = tiny_loaded("gemma3")
    cfg = loaded.model.cfg
    sd = load_state_dict(loaded.source.path, cfg, torch.float32)
    wide = LlamaModel(dataclasses.replace(cfg, sliding_window=1 << 20), sd, use_kernels=False)
    seq = list(range(5, 5 + 20))
    narrow_rows, wide_rows = _ours(loaded.model, [seq], False)[0], _ours(wide, [seq], False)[0]
    assert torch.allclose(narrow_rows[:6], wide_rows[:6], atol=1e-6)  # within the window: the same
    assert (narrow_rows[6:] - wide_rows[6:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_bf16_runs_on_the_c_kernels(family, tiny_loaded):
    """In bf16 on CPU the C decoder runs the later families too (tests/engine/test_kernel_forward.py
    holds its logits against the PyTorch path's), with the layers' features in its table; the
    Triton path still refuses them, naming what it lacks."""
    from agentrt.engine.models.layer_ops import triton_support
    from agentrt.kernels.cpu_build import unsupported_reason

    if unsupported_reason() is not None:
        pytest.skip(f"CPU kernels cannot run here: {unsupported_reason()}")
    model = tiny_loaded(family, "bfloat16").model
    assert model.kernels_enabled
    dec = model.kernel_decoder
    assert all(ly.q_norm is not None for ly in dec.layers)
    if family == "gemma3":
        assert [ly.window for ly in dec.layers] == [6, None, 6] and all(ly.gelu and ly.gemma_norms for ly in dec.layers)
        assert dec.layers[0].cos is model.local_rope.cos and dec.layers[1].cos is None
    assert "QK-norm" in triton_support(model.cfg, torch.bfloat16, quantized=False)


PROMPTS = ["one two three four five six seven. one two three four five", "the the the the", "a b c d e f g"]


@pytest.mark.parametrize("family,dtype", [(f, "float32") for f in FAMILIES] + [("qwen3", "bfloat16"),
                                                                                ("gemma3", "bfloat16")])
def test_greedy_same_with_speculation_and_in_a_batch(family, dtype, tiny_loaded, make_engine):
    """bf16: on the C kernels (batch invariant, so exact as fp32 is)."""
    from agentrt.kernels.cpu_build import unsupported_reason

    if dtype == "bfloat16" and unsupported_reason() is not None:
        pytest.skip(f"CPU kernels cannot run here: {unsupported_reason()}")
    loaded = tiny_loaded(family, dtype)
    assert loaded.model.kernels_enabled == (dtype == "bfloat16")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = make_engine(loaded)
    alone = [base.generate([p], params)[0].token_ids for p in PROMPTS]
    assert [r.token_ids for r in base.generate(PROMPTS[:2], params)] == alone[:2]  # a batch of two
    for spec in [SpecConfig(drafter="suffix", k=4), SpecConfig(drafter="layerskip:1", k=3)]:
        engine = make_engine(loaded, spec=spec)
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == alone, spec.drafter


# ---------------------------------------------------------------- from GGUF (written as llama.cpp writes them)


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory):
    """family_gguf(family, projections) -> (GGUF path, the HF directory it was written from)."""
    from tiny_models import save_tiny_gguf

    made = {}

    def make(family: str, projections: str):
        if (family, projections) not in made:
            d = tmp_path_factory.mktemp(f"gguf-{family}-{projections}")
            made[family, projections] = save_tiny_gguf(d / f"{family}.gguf", hf_dir=d / "hf", variant=family,
                                                       projections=projections), d / "hf"
        return made[family, projections]

    return make


@pytest.fixture
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))  # the tiny GGUFs' conversions go here


@pytest.mark.usefixtures("_own_cache")
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_float_weights_match_transformers(family, family_gguf):
    """F32 tensors in the GGUF: the converted model's logits are transformers' on the source
    checkpoint (names, Gemma's norm offset, Llama 3's rope_freqs, the sliding pattern and scale)."""
    from agentrt.engine.loading.model_loader import load_model

    path, hf_dir = family_gguf(family, "F32")
    loaded = load_model(str(path), "float32", progress=False)
    source = load_model(str(hf_dir), "float32", progress=False).model
    ours_cfg = loaded.model.cfg
    # Llama 3's parameters come back as other, equivalent ones (llama3_scaling_from_factors): same tables
    assert torch.allclose(loaded.model.rope.cos, source.rope.cos[: loaded.model.rope.cos.shape[0]], atol=1e-6)
    same = dict(eos_token_ids=(), bos_token_id=None, max_position_embeddings=0, rope_scaling=None)
    assert dataclasses.replace(ours_cfg, **same) == dataclasses.replace(source.cfg, **same)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, ours_cfg.vocab_size, (n + DECODE_STEPS,), generator=g).tolist() for n in LENGTHS]
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    for mine, theirs in zip(_ours(loaded.model, seqs, False), ref):
        assert (mine - theirs).abs().max().item() < ATOL


def test_llama31_rope_freqs_give_back_its_scaling():
    """Llama 3.1 8B's scaling as llama.cpp stores it (128 divisors) reads back to the same curve."""
    from tiny_models import _llama3_rope_freqs

    from agentrt.engine.config import RopeScaling
    from agentrt.engine.loading.gguf_convert import llama3_scaling_from_factors
    from agentrt.engine.models.layers import _llama3_inv_freq

    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    factors = _llama3_rope_freqs({"hidden_size": 4096, "num_attention_heads": 32, "rope_parameters": params})
    got = llama3_scaling_from_factors(factors.astype("float64"), 500000.0, 128)
    assert got["factor"] == 8.0 and abs(got["low_freq_factor"] - 1.0) < 1e-3 and abs(got["high_freq_factor"] - 4.0) < 1e-3
    inv = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    kw = {k: got[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    assert torch.allclose(_llama3_inv_freq(inv, RopeScaling("llama3", **kw)), inv / torch.from_numpy(factors).double(),
                          rtol=1e-6)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        llama3_scaling_from_factors(factors[::-1].astype("float64"), 500000.0, 128)


@pytest.mark.usefixtures("_own_cache")
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_gguf_quantized_blocks_run_the_same_model(family, family_gguf, monkeypatch):
    """Q8_0 projections kept as blocks: with float activations (the reference linear) the logits are
    the dequantized fp32 model's; on the fused quantized decoder greedy output is the same with
    speculation."""
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.kernels import quant_linear as quant_kernels
    from agentrt.kernels.quant_build import unsupported_reason
    from agentrt.kernels.quant_formats import quant_linear_reference

    path, _ = family_gguf(family, "Q8_0")
    quant = load_model(str(path), "quantized", progress=False)
    assert quant.model.layers[0].qkv.formats == ["Q8_0"]
    fp32 = load_model(str(path), "float32", progress=False)
    seqs = [list(range(10, 30)), list(range(40, 47))]
    with monkeypatch.context() as m:
        m.setattr(quant.model, "quant_fused", False)  # the PyTorch path calls the linears one by one
        m.setattr(quant_kernels, "quant_linear", lambda x, w, out=None: quant_linear_reference(x, w) if out is None
                  else out.copy_(quant_linear_reference(x, w)))
        # an fp32 cache too (the fused decoder's is fp16): then the same ops on the same values
        for a, b in zip(_ours(quant.model, seqs, False, torch.float32), _ours(fp32.model, seqs, False)):
            assert (a - b).abs().max().item() < 1e-3
    if unsupported_reason() is not None:
        return
    from agentrt.engine import EngineConfig, LLMEngine

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert quant.model.quant_fused
    runs = [LLMEngine(EngineConfig(model=str(path), dtype="quantized", kv_cache_tokens=1024, spec=spec), loaded=quant)
            .generate(PROMPTS, params) for spec in (SpecConfig(), SpecConfig(drafter="suffix", k=4))]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must list 3 entries"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types must list"),
    ({"sliding_window": None}, "sliding layers need a positive integer sliding_window"),
    ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
    ({"hidden_activation": "relu"}, "unsupported activation 'relu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "unsupported rope_scaling type 'yarn'"),
])
def test_gemma3_config_errors_name_the_field(change, message, tiny_model_dir):
    import json

    from agentrt.engine.config import ModelConfig

    d = json.loads((tiny_model_dir("gemma3") / "config.json").read_text()) | change
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(d)


def test_qwen3_sliding_window_is_refused(tiny_model_dir):
    import json

    from agentrt.engine.config import ModelConfig

    d = json.loads((tiny_model_dir("qwen3") / "config.json").read_text()) | {"use_sliding_window": True,
                                                                             "sliding_window": 4}
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gemma3_chunked_prefill_equals_one_prefill(batch_invariant, tiny_loaded):
    """Chunks that start past the window (a sliding layer gathers from p - window + 1 only), with
    a second sequence of another length in the same steps, give the one-shot prefill's logits."""
    model = tiny_loaded("gemma3").model
    seqs = [list(range(7, 30)), list(range(50, 70))]
    whole = _ours(model, seqs, batch_invariant)
    bm, kv = BlockManager(256, 4), KVCache(model.cfg, 256, 4, model.kv_dtype)
    rows = [[], []]
    for lo, hi in [(0, 10), (10, 18), (18, 20)]:
        out = forward_step(model, kv, bm, [s[lo:hi] for s in seqs], [lo, lo], batch_invariant)
        for i, chunk in enumerate(out.split(hi - lo)):
            rows[i].append(chunk)
    for i, s in enumerate(seqs):
        assert (torch.cat(rows[i]) - whole[i][:20]).abs().max().item() < 1e-5
