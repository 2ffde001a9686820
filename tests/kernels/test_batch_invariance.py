"""Batch invariance of the C kernels: a row's output is bit-identical whatever else is in the
call. Linear layers: the first rows of an M-row call equal the 1-row calls, M in 1..64, with
every epilogue. Attention: a query computed alone (decode) equals the same query computed beside
its sequence's later tokens (verification, prefill chunks) and other sequences. The decoder
stack: a prompt fed whole, in chunks or a token at a time, alone or in a mixed batch, leaves the
same hidden states and the same K/V cache bits. (These are what make greedy decoding identical
with and without speculation in bf16: tests/engine/test_bf16_determinism.py.)"""
from __future__ import annotations

import pytest
import torch

from agentrt.kernels.cpu_build import unsupported_reason
from agentrt.kernels.decoder import Dims, LayerWeights, decoder_layers, layer_table
from agentrt.kernels.linear import linear, pack_weight
from agentrt.kernels.paged_attention import paged_attention

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=f"CPU kernels cannot run here: {unsupported_reason()}")


def _bf16(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("epilogue", ["plain", "norm+bias", "residual", "gated", "gemma norm+geglu", "f32 out"])
@pytest.mark.parametrize("N,K", [(96, 80), (576, 576), (33, 31)])
def test_linear_rows_do_not_depend_on_the_batch(epilogue, N, K):
    g = torch.Generator().manual_seed(N * K)
    gated = epilogue in ("gated", "gemma norm+geglu")
    w = pack_weight(_bf16(2 * N if gated else N, K, g=g, scale=0.1), gated=gated)
    x, res = _bf16(64, K, g=g), _bf16(64, N, g=g)
    nw, bias = _bf16(K, g=g) + 1, _bf16(N, g=g)

    def call(lo: int, hi: int) -> torch.Tensor:
        kw = {"norm_weight": nw, "eps": 1e-5, "bias": bias} if epilogue == "norm+bias" else {}
        if epilogue == "gemma norm+geglu":
            kw = {"norm_weight": nw.float(), "eps": 1e-5, "act": "gelu_tanh"}
        if epilogue == "residual":
            kw["residual"] = res[lo:hi].clone()
        if epilogue == "f32 out":
            kw["out_dtype"] = torch.float32
        return linear(x[lo:hi], w, num_threads=2, **kw)

    rows = torch.cat([call(i, i + 1) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(call(0, m), rows[:m]), f"M={m}"


def _cache(g, num_blocks, block_size, nkv, d):
    slots = num_blocks * block_size
    return _bf16(slots, nkv, d, g=g), _bf16(slots, nkv, d, g=g), torch.randperm(num_blocks, generator=g)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("d,nq,nkv,block_size", [(64, 9, 3, 16), (128, 8, 2, 16), (48, 4, 2, 16), (32, 4, 4, 4)])
def test_attention_queries_do_not_depend_on_the_batch(d, nq, nkv, block_size, window):
    """Ragged batches of 1-70 new tokens per sequence (decode, verification, prefill chunks over
    several 64-query tasks) against every token computed alone at its position; with a sliding
    window, blocks start at their earliest query's window, which differs alone and in a batch."""
    g = torch.Generator().manual_seed(d + nq + block_size)
    kc, vc, perm = _cache(g, 4 * 400 // block_size, block_size, nkv, d)
    for trial in range(4):
        B = int(torch.randint(1, 5, (), generator=g))
        new = torch.randint(1, 71 if trial == 0 else 17, (B,), generator=g)
        ctx = new + torch.randint(0, 300, (B,), generator=g)
        per_seq = int((ctx.max() + block_size - 1) // block_size)
        tables = perm[: B * per_seq].view(B, per_seq)
        positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx.tolist(), new.tolist())])
        cu_q = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)])
        q = _bf16(positions.numel(), nq * d, g=g, scale=3.0)
        scale = d**-0.5
        batch = paged_attention(q, kc, vc, cu_q, positions, tables, block_size, scale, nq, window=window)
        seq_of = torch.repeat_interleave(torch.arange(B), new)
        for t in range(positions.numel()):
            b = int(seq_of[t])
            alone = paged_attention(q[t : t + 1], kc, vc, torch.tensor([0, 1]), positions[t : t + 1], tables[b : b + 1],
                                    block_size, scale, nq, window=window)
            assert torch.equal(alone, batch[t : t + 1]), f"trial {trial}, token {t} (sequence {b})"


def _stack(g, hidden=64, inter=96, nq=6, nkv=2, d=64, layers=3, gemma=False):
    """Llama layers, or Gemma 3's (QK-norm, post-norms, GeGLU, fp32 (1 + w) norms; layers 0 and 2
    sliding, window 20, with their own rotary tables)."""
    dims = Dims(hidden, inter, nq, nkv, d, 1e-6, d**-0.5)
    norm = (lambda n: torch.randn(n, generator=g) * 0.3 + 1) if gemma else (lambda n: _bf16(n, g=g) + 1)  # noqa: E731

    def extra(i):
        if not gemma:
            return {}
        sliding = {"window": 20, "cos": torch.randn(128, d // 2, generator=g),
                   "sin": torch.randn(128, d // 2, generator=g)} if i != 1 else {}
        return {"q_norm": norm(d), "k_norm": norm(d), "attn_out_norm": norm(hidden), "mlp_out_norm": norm(hidden),
                "gelu": True, "gemma_norms": True, **sliding}

    ws = [LayerWeights(pack_weight(_bf16((nq + 2 * nkv) * d, hidden, g=g, scale=0.1)), _bf16((nq + 2 * nkv) * d, g=g),
                       pack_weight(_bf16(hidden, nq * d, g=g, scale=0.1)),
                       pack_weight(_bf16(2 * inter, hidden, g=g, scale=0.1), gated=True),
                       pack_weight(_bf16(hidden, inter, g=g, scale=0.1)), norm(hidden), norm(hidden), **extra(i))
          for i in range(layers)]
    return dims, ws


@pytest.mark.parametrize("gemma", [False, True])
def test_decoder_stack_prompt_whole_chunked_or_token_by_token_is_bit_identical(gemma):
    """Two sequences' prompts run three ways through a 3-layer stack: both whole in one batch,
    in uneven chunks (prefill and decode rows mixed), and one token per call, one sequence at a
    time: the final hidden states of every token and both caches agree bit for bit."""
    g = torch.Generator().manual_seed(21)
    dims, ws = _stack(g, gemma=gemma)
    bs, lens = 16, [37, 22]
    h0 = [_bf16(n, dims.hidden, g=g) for n in lens]
    cos, sin = torch.randn(128, dims.head_dim // 2, generator=g), torch.randn(128, dims.head_dim // 2, generator=g)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])

    def run(schedule):
        """schedule: steps of [(sequence, first, end)]; returns per-sequence hidden rows and caches."""
        shape = (6 * bs, dims.num_kv_heads, dims.head_dim)
        kcs, vcs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in ws], [torch.zeros(shape, dtype=torch.bfloat16) for _ in ws]
        table = layer_table(ws, kcs, vcs)
        out = [torch.empty_like(h) for h in h0]
        for step in schedule:
            h = torch.cat([h0[b][s:e] for b, s, e in step])
            positions = torch.cat([torch.arange(s, e) for _, s, e in step])
            slots = torch.cat([tables[b, torch.arange(s, e) // bs] * bs + torch.arange(s, e) % bs for b, s, e in step])
            cu_q = torch.tensor([0] + [e - s for _, s, e in step]).cumsum(0)
            bt = torch.stack([tables[b] for b, _, _ in step])
            decoder_layers(table, len(ws), dims, h, positions, cos, sin, slots, cu_q, bt, bs)
            i = 0
            for b, s, e in step:
                out[b][s:e] = h[i : i + e - s]
                i += e - s
        return out, kcs, vcs

    whole = run([[(0, 0, 37), (1, 0, 22)]])
    chunked = run([[(0, 0, 5)], [(1, 0, 17), (0, 5, 6)], [(0, 6, 30), (1, 17, 18)], [(1, 18, 22), (0, 30, 37)]])
    single = run([[(b, t, t + 1)] for b, n in enumerate(lens) for t in range(n)])
    for other in (chunked, single):
        for a, b in zip(whole[0], other[0]):
            assert torch.equal(a, b)
        for a, b in zip(whole[1] + whole[2], other[1] + other[2]):
            assert torch.equal(a, b)
