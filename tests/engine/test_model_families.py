"""Llama 3.x rope scaling, Qwen3 and Gemma 3 (text) on our model code, against transformers on
the same tiny random weights (tests/engine/tiny_models.py): logits for a ragged prefill and decode
steps, greedy output with speculation and in a batch, and the fused kernels' refusal."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_runs import forward_step

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.block_manager import BlockManager
from agentrt.engine.kv_cache import KVCache
from agentrt.engine.models.llama import LlamaModel
from agentrt.engine.weights import load_state_dict
from agentrt.errors import ModelLoadError

transformers = pytest.importorskip("transformers")
FAMILIES = ["llama3", "qwen3", "gemma3"]
# fp32: observed max differences ~3e-6 (Gemma 3's extra norms and soft-capping add a little)
ATOL = 1e-4
LENGTHS = (9, 23, 2, 15)  # longer than Gemma's window of 6, so sliding layers drop positions
DECODE_STEPS = 3


def _ours(model, seqs: list[list[int]], batch_invariant: bool) -> list[torch.Tensor]:
    """Each sequence's logits at every position: all prefills in one ragged batch (but the last
    DECODE_STEPS tokens), then one decode step per remaining token, all sequences together."""
    bm = BlockManager(256, 4)
    kv = KVCache(model.cfg, 256, 4, model.dtype)
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
    assert llama3.rope_scaling.kind == "llama3" and not llama3.fused_kernel_gaps()
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32 != qwen3.hidden_size // 4
    assert qwen3.fused_kernel_gaps() == ["QK-norm"]
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
def test_fused_kernels_refuse_with_the_missing_features(family, tiny_model_dir):
    """The bf16 C decoder runs Llama layers only: asked for, it names what it lacks; by default the
    PyTorch path runs the model."""
    from agentrt.engine.model_loader import load_model

    loaded = load_model(str(tiny_model_dir(family)), "bfloat16", progress=False)
    assert not loaded.model.kernels_enabled
    sd = load_state_dict(loaded.source.path, loaded.model.cfg, torch.bfloat16)
    with pytest.raises(ModelLoadError, match="QK-norm"):
        LlamaModel(loaded.model.cfg, sd, use_kernels=True)


PROMPTS = ["one two three four five six seven. one two three four five", "the the the the", "a b c d e f g"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_same_with_speculation_and_in_a_batch(family, tiny_loaded, make_engine):
    loaded = tiny_loaded(family)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = make_engine(loaded)
    alone = [base.generate([p], params)[0].token_ids for p in PROMPTS]
    assert [r.token_ids for r in base.generate(PROMPTS[:2], params)] == alone[:2]  # a batch of two
    for spec in [SpecConfig(drafter="suffix", k=4), SpecConfig(drafter="layerskip:1", k=3)]:
        engine = make_engine(loaded, spec=spec)
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == alone, spec.drafter
