"""The batch-invariant PyTorch path (EngineConfig.batch_invariant, engine/models/invariant.py):
on machines without the C kernels, and in fp32, a request's greedy tokens do not depend on the
batch around it, speculation or chunked prefill. Each replaced op is checked bit for bit, then
whole engines on tiny random models (whose logits are full of near-ties, so any changed bit
would flip tokens); `agentrt bench decode --determinism --batch-invariant` does it on SmolLM2."""
from __future__ import annotations

import pytest
import torch

from engine_runs import run_requests

from agentrt.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from agentrt.engine.models import invariant
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.layers import Linear



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(576, 576), (3072, 576), (576, 1536), (1000, 64)])
def test_linear_rows_do_not_depend_on_the_other_rows(dtype, n, k):
    torch.manual_seed(0)
    layer = Linear(torch.randn(n, k, dtype=dtype) * 0.05)
    x = torch.randn(70, k, dtype=dtype)
    alone = invariant.linear(layer, x[3:4])
    for rows in (slice(0, 5), slice(3, 19), slice(2, 70), slice(3, 35)):
        got = invariant.linear(layer, x[rows])
        assert torch.equal(got[3 - rows.start], alone[0]), rows


def _attention_case(lengths: list[int], new: list[int], nq=6, nkv=2, d=16, bs=4, dtype=torch.float32):
    """q for `new[b]` tokens at the end of each sequence of lengths[b], over a shared paged cache."""
    g = torch.Generator().manual_seed(sum(lengths) * 7 + len(new))
    slots_per = [list(range(sum(-(-L // bs) for L in lengths[:b]) * bs, sum(-(-L // bs) for L in lengths[: b + 1]) * bs))
                 for b in range(len(lengths))]
    num_slots = max(s[-1] for s in slots_per) + 1
    k_cache = torch.randn(num_slots, nkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, nkv, d, generator=g).to(dtype)
    tables = [[s // bs for s in slots[::bs]] for slots in slots_per]
    positions = torch.tensor([p for L, n in zip(lengths, new) for p in range(L - n, L)])
    q = torch.randn(len(positions), nq, d, generator=g).to(dtype)
    meta = build_attention_metadata(new, lengths, positions, tables, bs, torch.device("cpu"))
    return q, k_cache, v_cache, meta, tables, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_per_query_does_not_depend_on_the_batch(dtype):
    """A query alone (decode) equals the same query in a 16-row verify run beside other sequences."""
    lengths, new = [37, 70, 5, 22], [16, 3, 5, 1]
    q, kc, vc, meta, tables, positions = _attention_case(lengths, new, dtype=dtype)
    together = invariant.attention(q, kc, vc, meta, 0.25)
    t = 0
    for b, (L, n) in enumerate(zip(lengths, new)):
        for j in range(n):
            p = L - n + j
            one = build_attention_metadata([1], [p + 1], torch.tensor([p]), [tables[b]], meta.block_size,
                                           torch.device("cpu"))
            alone = invariant.attention(q[t : t + 1], kc, vc, one, 0.25)
            assert torch.equal(alone[0], together[t]), (b, j)
            t += 1


@pytest.mark.parametrize("variant,dtype", [("llama3", "float32"), ("mistral", "float32"), ("llama3", "bfloat16")])
def test_tiny_random_model_greedy_is_invariant(tiny_loaded, variant, dtype):
    """Suffix drafts at k = 8 and adaptive, in a batch with chunked prefill, against each prompt
    alone without drafts; bf16 here on the PyTorch path (the kernels switched off)."""
    loaded = tiny_loaded(variant, dtype)
    was = loaded.model.kernels_enabled
    loaded.model.kernels_enabled = False
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        prompts = [list(range(3, 3 + n)) for n in (5, 19, 33)]

        def engine(**kw):
            return LLMEngine(EngineConfig(model=str(loaded.source.path), dtype=dtype, kv_cache_tokens=4096,
                                          batch_invariant=True, **kw), loaded=loaded)

        alone = [run_requests(engine(prefix_caching=False), [(p, params)])[0] for p in prompts]
        for spec in (SpecConfig(drafter="suffix", k=8), SpecConfig(drafter="suffix")):
            assert run_requests(engine(spec=spec, max_num_batched_tokens=16), [(p, params) for p in prompts], [0, 2, 5]) == alone
    finally:
        loaded.model.kernels_enabled = was
