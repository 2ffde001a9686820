"""The C kernels (agentrt/kernels/csrc) against their PyTorch references, on bf16 tensors of odd
shapes. The kernels reproduce the references' bf16 rounding op by op, so only dot-product
summation order may differ: outputs agree bit for bit except at rounding ties (bound: 1 bf16 ulp
of the output for linear layers; attention's exp() adds at most a few ulps)."""
from __future__ import annotations

import pytest
import torch

from agentrt.kernels.cpu_build import cpu_kernels, unsupported_reason
from agentrt.kernels.linear import linear, linear_reference, pack_weight
from agentrt.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    rotary_kv_write,
    rotary_kv_write_reference,
)

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=f"CPU kernels cannot run here: {unsupported_reason()}")


def test_kernels_build_and_load_where_supported():
    assert cpu_kernels() is not None  # a supported machine whose build failed: see the log for the compiler error


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign finite values)."""
    ia = a.to(torch.bfloat16).view(torch.int16).int()
    ib = b.to(torch.bfloat16).view(torch.int16).int()
    return (ia - ib).abs()


def _bf16(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("M", [1, 5, 16, 17, 33])
@pytest.mark.parametrize("N,K", [(64, 64), (200, 72), (960, 576), (33, 31)])
def test_linear_plain_matches_reference(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w, x = _bf16(N, K, g=g, scale=0.1), _bf16(M, K, g=g)
    out = linear(x, pack_weight(w), num_threads=2)
    ref = linear_reference(x, w)
    assert out.shape == (M, N)
    ulps = _ulps(out, ref)
    assert ulps.max() <= 1
    assert (ulps == 0).float().mean() > 0.97


@pytest.mark.parametrize("M", [1, 7, 20])
def test_linear_norm_bias_residual_and_strided_input(M):
    g = torch.Generator().manual_seed(M)
    N, K = 96, 80
    w, bias, nw = _bf16(N, K, g=g, scale=0.1), _bf16(N, g=g), _bf16(K, g=g)
    big = _bf16(M, 2 * K, g=g)
    x = big[:, :K]  # strided rows, as a view into a wider buffer
    h = _bf16(M, N, g=g)
    ref = linear_reference(x, w, norm_weight=nw, eps=1e-5, bias=bias, residual=h)
    out = linear(x, pack_weight(w), norm_weight=nw, eps=1e-5, bias=bias, residual=h, out=h)  # in place
    assert out.data_ptr() == h.data_ptr()
    assert _ulps(out, ref).max() <= 2  # the residual add may inherit one tie flip
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("act,norm_dtype", [("silu", torch.bfloat16), ("gelu_tanh", torch.float32)])
@pytest.mark.parametrize("M", [1, 9, 18])
def test_linear_gated(M, act, norm_dtype):
    """SwiGLU after Llama's norm; GeGLU after Gemma's norm (an fp32 (1 + w) weight)."""
    g = torch.Generator().manual_seed(M + 7)
    inter, K = 72, 64  # 72 = not a multiple of 16: a padded unit pair
    w, x, nw = _bf16(2 * inter, K, g=g, scale=0.2), _bf16(M, K, g=g), _bf16(K, g=g).to(norm_dtype)
    out = linear(x, pack_weight(w, gated=True), norm_weight=nw, eps=1e-6, act=act)
    ref = linear_reference(x, w, norm_weight=nw, eps=1e-6, gated=True, act=act)
    assert out.shape == (M, inter)
    assert torch.allclose(out.float(), ref.float(), rtol=2**-6, atol=2**-8)


def test_linear_fp32_output_is_the_rounded_bf16_value():
    g = torch.Generator().manual_seed(3)
    w, x = _bf16(500, 64, g=g), _bf16(3, 64, g=g)
    out = linear(x, pack_weight(w), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, out.bfloat16().float())
    assert _ulps(out, linear_reference(x, w)).max() <= 1


def test_linear_rejects_mismatched_input():
    w = pack_weight(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        linear(torch.zeros(2, 48, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="2-D bf16"):
        pack_weight(torch.zeros(32, 64))


def _paged_setup(g, lens, nq, nkv, d, block_size=4, num_blocks=64):
    """A cache with shuffled blocks holding random K/V for sequences of the given context lengths."""
    slots = num_blocks * block_size
    kc, vc = _bf16(slots, nkv, d, g=g), _bf16(slots, nkv, d, g=g)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max((n + block_size - 1) // block_size for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    used = 0
    for b, n in enumerate(lens):
        nb = (n + block_size - 1) // block_size
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    return kc, vc, tables


# (context after the step, queries per sequence): decode and verification; then prefill-shaped
# runs whose query rows (tokens x query heads per kv head) split over several 64-row tasks.
SHAPES = {"decode": ([5, 40, 17, 1], [1, 17, 3, 1]), "prefill": ([130, 40, 70], [130, 17, 25])}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("d,nq,nkv", [(16, 4, 2), (64, 9, 3), (32, 4, 4)])
def test_paged_attention_matches_reference(d, nq, nkv, shape):
    g = torch.Generator().manual_seed(d + nq)
    ctx, new = SHAPES[shape]
    kc, vc, tables = _paged_setup(g, ctx, nq, nkv, d)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, new)])
    cu_q = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.long)
    qkv = _bf16(positions.numel(), 2 * nq * d, g=g)  # q as a strided view, as in the model
    q = qkv[:, : nq * d]
    for window in (None, 5, 37):  # a sliding layer's: 37 starts most queries past a 16-key chunk
        out = paged_attention(q, kc, vc, cu_q, positions, tables, 4, d**-0.5, nq, window=window)
        ref = paged_attention_reference(q.reshape(-1, nq, d), kc, vc, cu_q, positions, tables, 4, d**-0.5, window)
        assert torch.allclose(out.float(), ref.reshape(-1, nq * d).float(), rtol=2**-6, atol=2**-7), window


# Decode over long contexts (past the 32-row prefetch distance, 16-slot blocks as the engine
# uses), 1-3 tokens per sequence: 3-9 queries per kv head with g = 3, 4-12 with g = 4 (128-wide
# heads: two 64-wide chunks), 2-6 with g = 2 (48-wide heads: a 3-column chunk).
LONG_DECODE = ([300, 77, 129, 33], [1, 2, 3, 1])


@pytest.mark.parametrize("d,nq,nkv", [(64, 9, 3), (128, 8, 2), (48, 4, 2)])
@pytest.mark.parametrize("prefetch_rows", [0, 32])
def test_paged_attention_long_decode_matches_reference(d, nq, nkv, prefetch_rows):
    """V tiles straight from the cache (and copied where a 16-key chunk passes the context),
    with and without prefetching, against the reference; prefetching changes no bit."""
    g = torch.Generator().manual_seed(d * nq)
    ctx, new = LONG_DECODE
    kc, vc, tables = _paged_setup(g, ctx, nq, nkv, d, block_size=16, num_blocks=64)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, new)])
    cu_q = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.long)
    q = _bf16(positions.numel(), nq * d, g=g)
    args = (q, kc, vc, cu_q, positions, tables, 16, d**-0.5, nq)
    out = paged_attention(*args, prefetch_rows=prefetch_rows)
    ref = paged_attention_reference(q.reshape(-1, nq, d), kc, vc, cu_q, positions, tables, 16, d**-0.5)
    assert torch.allclose(out.float(), ref.reshape(-1, nq * d).float(), rtol=2**-6, atol=2**-7)
    assert torch.equal(out, paged_attention(*args, prefetch_rows=0))


def test_paged_attention_rejects_negative_tuning():
    g = torch.Generator().manual_seed(0)
    kc, vc, tables = _paged_setup(g, [5], 4, 2, 16)
    q = _bf16(1, 4 * 16, g=g)
    cu_q, positions = torch.tensor([0, 1]), torch.tensor([4])
    with pytest.raises(ValueError, match="prefetch_rows"):
        paged_attention(q, kc, vc, cu_q, positions, tables, 4, 0.25, 4, prefetch_rows=-1)


@pytest.mark.parametrize("d,T", [(32, 6), (16, 3), (48, 5), (64, 70), (128, 2)])
def test_rotary_kv_write_is_bit_identical_to_reference(d, T):
    """Head widths whose halves fill 16-lane vectors partly (8, 24) and whole; T >= 64 takes the
    threaded path; zeros in q and k check the sign of -0 * sin."""
    g = torch.Generator().manual_seed(5 + d)
    nq, nkv = 4, 2
    cos, sin = torch.randn(100, d // 2, generator=g), torch.randn(100, d // 2, generator=g)
    positions = torch.randint(0, 100, (T,), generator=g)
    slots = torch.randperm(128, generator=g)[:T]
    qkv = _bf16(T, (nq + 2 * nkv) * d, g=g)
    qkv[:, ::7] = 0.0
    caches = [torch.zeros(128, nkv, d, dtype=torch.bfloat16) for _ in range(4)]
    ref_qkv = qkv.clone()
    rotary_kv_write_reference(ref_qkv, positions, cos, sin, slots, caches[0], caches[1], nq)
    rotary_kv_write(qkv, positions, cos, sin, slots, caches[2], caches[3], nq)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("gemma", [False, True])
def test_rotary_kv_write_with_qk_norm_matches_reference(gemma):
    """QK-norm of each q and k head before rotary: Qwen3's (bf16 weights, Llama's norm) or Gemma's
    (fp32 1 + w); the norm's sum of squares may differ in summation order: 1 ulp of a norm output,
    carried through rotary's bf16 products."""
    g = torch.Generator().manual_seed(17)
    nq, nkv, d, T = 4, 2, 64, 70
    cos, sin = torch.randn(100, d // 2, generator=g), torch.randn(100, d // 2, generator=g)
    positions, slots = torch.randint(0, 100, (T,), generator=g), torch.randperm(128, generator=g)[:T]
    norms = [(torch.randn(d, generator=g) * 0.3 + 1).to(torch.float32 if gemma else torch.bfloat16) for _ in range(2)]
    qkv = _bf16(T, (nq + 2 * nkv) * d, g=g, scale=3.0)
    caches = [torch.zeros(128, nkv, d, dtype=torch.bfloat16) for _ in range(4)]
    ref_qkv = qkv.clone()
    rotary_kv_write_reference(ref_qkv, positions, cos, sin, slots, caches[0], caches[1], nq, *norms, 1e-6)
    rotary_kv_write(qkv, positions, cos, sin, slots, caches[2], caches[3], nq, *norms, eps=1e-6)
    assert torch.allclose(qkv.float(), ref_qkv.float(), rtol=2**-6, atol=2**-6)
    assert (qkv != ref_qkv).float().mean() < 0.05  # all but the few rounding ties bit-identical
    assert torch.equal(caches[3], caches[1])  # v is copied untouched
    assert torch.allclose(caches[2].float(), caches[0].float(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("N,K", [(64, 64), (200, 72), (34, 31)])
def test_c_packer_matches_the_torch_layout(N, K, gated):
    from agentrt.kernels.linear import _units

    w = _bf16(N, K, g=torch.Generator().manual_seed(N + K))
    k32 = (K + 31) // 32 * 32
    assert torch.equal(pack_weight(w, gated).data, _units(w, k32, 2 if gated else 1).view(-1, k32 // 2, 16, 2))


def _family_fields(family: str, i: int, g, hidden: int, d: int) -> dict:
    """LayerWeights' optional fields of layer i: none (Llama), QK-norm (Qwen3), or Gemma 3's (QK-norm,
    post-norms, GeGLU, fp32 (1 + w) norms; even layers sliding with their own rotary tables)."""
    if family == "llama":
        return {}
    gemma = family == "gemma3"
    norm = lambda n: (torch.randn(n, generator=g) * 0.3 + 1).to(torch.float32 if gemma else torch.bfloat16)  # noqa: E731
    fields = {"q_norm": norm(d), "k_norm": norm(d), "gemma_norms": gemma}
    if gemma:
        fields |= {"attn_out_norm": norm(hidden), "mlp_out_norm": norm(hidden), "gelu": True}
        if i % 2 == 0:
            fields |= {"window": 6, "cos": torch.randn(64, d // 2, generator=g), "sin": torch.randn(64, d // 2, generator=g)}
    return fields


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_decoder_stack_matches_the_composed_references(family):
    from agentrt.kernels.decoder import Dims, LayerWeights, decoder_layers, decoder_layers_reference, layer_table

    g = torch.Generator().manual_seed(11)
    hidden, inter, nq, nkv, d, bs = 64, 96, 4, 2, 16, 4
    dims = Dims(hidden, inter, nq, nkv, d, 1e-6, d**-0.5 if family == "llama" else 0.3)
    layers = []
    for i in range(2):
        plain = {"qkv": _bf16((nq + 2 * nkv) * d, hidden, g=g, scale=0.1), "o": _bf16(hidden, nq * d, g=g, scale=0.1),
                 "gate_up": _bf16(2 * inter, hidden, g=g, scale=0.1), "down": _bf16(hidden, inter, g=g, scale=0.1)}
        fields = _family_fields(family, i, g, hidden, d)
        norm = (lambda: torch.randn(hidden, generator=g) * 0.3 + 1) if fields.get("gemma_norms") else (
            lambda: _bf16(hidden, g=g) + 1)
        w = LayerWeights(pack_weight(plain["qkv"]), _bf16((nq + 2 * nkv) * d, g=g), pack_weight(plain["o"]),
                         pack_weight(plain["gate_up"], gated=True), pack_weight(plain["down"]), norm(), norm(), **fields)
        layers.append((w, plain))
    ctx, new = [9, 20], [2, 5]
    kc, vc, tables = _paged_setup(g, ctx, nq, nkv, d, block_size=bs)
    caches = [(kc.clone(), vc.clone()) for _ in layers]
    ref_caches = [(kc.clone(), vc.clone()) for _ in layers]
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, new)])
    slots = torch.stack([tables[b, p // bs] * bs + p % bs for b, (c, n) in enumerate(zip(ctx, new))
                         for p in range(c - n, c)])
    cu_q = torch.tensor([0, 2, 7])
    cos, sin = torch.randn(64, d // 2, generator=g), torch.randn(64, d // 2, generator=g)
    h = _bf16(7, hidden, g=g)
    ref = decoder_layers_reference(layers, [c[0] for c in ref_caches], [c[1] for c in ref_caches], dims, h.clone(),
                                   positions, cos, sin, slots, cu_q, tables, bs)
    table = layer_table([w for w, _ in layers], [c[0] for c in caches], [c[1] for c in caches])
    out = decoder_layers(table, 2, dims, h, positions, cos, sin, slots, cu_q, tables, bs)
    assert out.data_ptr() == h.data_ptr()
    assert torch.allclose(out.float(), ref.float(), rtol=2**-5, atol=2**-5)
    for (k, v), (rk, rv) in zip(caches, ref_caches):  # every layer wrote the same K/V, up to rounding
        assert torch.allclose(k.float(), rk.float(), rtol=2**-5, atol=2**-5)
        assert torch.allclose(v.float(), rv.float(), rtol=2**-5, atol=2**-5)


def test_packing_row_blocks_equals_packing_the_stacked_weight():
    g = torch.Generator().manual_seed(9)
    q, k, v = _bf16(64, 40, g=g), _bf16(32, 40, g=g), _bf16(32, 40, g=g)
    assert torch.equal(pack_weight([q, k, v]).data, pack_weight(torch.cat([q, k, v])).data)
    gate, up = _bf16(24, 40, g=g), _bf16(24, 40, g=g)  # 24 rows: padded units
    assert torch.equal(pack_weight([gate, up], gated=True).data, pack_weight(torch.cat([gate, up]), gated=True).data)
    odd = [_bf16(20, 40, g=g), _bf16(8, 40, g=g)]  # a block not a multiple of 16 rows: stacked first
    assert torch.equal(pack_weight(odd).data, pack_weight(torch.cat(odd)).data)
