"""Our model's logits and greedy output against transformers' on the same weights (fp32)."""
from __future__ import annotations

import pytest
import torch

from engine_runs import forward_step

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.kv.kv_cache import KVCache

transformers = pytest.importorskip("transformers")
VARIANTS = ["llama2", "llama3", "smollm", "mistral", "qwen2"]
ATOL = 1e-4  # fp32; observed max differences are ~1e-6 on tiny models, ~2e-5 on SmolLM2


def _ragged_forward(loaded, seqs: list[list[int]], block_size: int = 4):
    """Prefill all sequences in one ragged batch, then feed one more token each; returns both logits."""
    model = loaded.model
    bm = BlockManager(256, block_size)
    kv = KVCache(model.cfg, 256, block_size, model.kv_dtype)

    def step(feeds: list[list[int]], starts: list[int]):
        return forward_step(model, kv, bm, feeds, starts)

    prefill = step([s[:-1] for s in seqs], [0] * len(seqs))
    decode = step([s[-1:] for s in seqs], [len(s) - 1 for s in seqs])
    return prefill, decode


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_logits_match_transformers(variant, tiny_loaded, tiny_model_dir):
    loaded = tiny_loaded(variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(variant), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    vocab = loaded.model.cfg.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 23, 2, 15)]
    prefill, decode = _ragged_forward(loaded, seqs)
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    ref_prefill = torch.cat([r[:-1] for r in ref])
    ref_decode = torch.stack([r[-1] for r in ref])
    assert (prefill - ref_prefill).abs().max().item() < ATOL
    assert (decode - ref_decode).abs().max().item() < ATOL


def test_smollm2_logits_match_transformers(smollm2_fp32, hf_smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    seqs = [tok.encode("The quick brown fox jumps over the lazy dog."), tok.encode("def fib(n):\n    return")]
    prefill, decode = _ragged_forward(smollm2_fp32, seqs, block_size=16)
    with torch.no_grad():
        ref = [hf_smollm2_fp32(torch.tensor([s])).logits[0] for s in seqs]
    assert (prefill - torch.cat([r[:-1] for r in ref])).abs().max().item() < 1e-3
    assert (decode - torch.stack([r[-1] for r in ref])).abs().max().item() < 1e-3


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def test_smollm2_greedy_matches_transformers_generate(smollm2_fp32, hf_smollm2_fp32, make_engine):
    from agentrt.engine import SamplingParams

    engine = make_engine(smollm2_fp32)
    tok = smollm2_fp32.tokenizer
    n = 24
    ours = engine.generate([[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(max_tokens=n, temperature=0))
    for p, r in zip(PROMPTS, ours):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        with torch.no_grad():
            out = hf_smollm2_fp32.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        assert r.token_ids == out[0, len(ids):].tolist(), p
