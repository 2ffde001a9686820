"""The quantized decoder's attention (csrc/cpu_quant_attention.c) takes the rows of one sequence
together (a verification's k + 1 rows, a prefill): per chunk and KV head, their queries share each
key and value row read, two queries per 512-bit vector. Each row's bits must still be those of
the row computed alone: rows of two sequences at once against each row alone, with few rows
(chunk tasks) and many (group tasks), head sizes on the 512-bit P.V path (64, 128) and off it
(48), GQA groups of 1, 3 and 4 query heads, a sliding window, on 1 and 2 threads, on this CPU's
build and the x86-64-v3 one (VDPBF16PS where this CPU has it against two FMAs a pair there); and
the result against quant_attention_reference (the kernel's roundings in PyTorch)."""
from __future__ import annotations

import pytest
import torch

from agentrt.kernels.quant_build import (AVX2_MARCH, attention_tiles, has_fast_path, missing_cpu_flags, quant_kernels,
                                        unsupported_reason)
from agentrt.kernels.quant_decoder import KV_DTYPE, KV_FLUSH, kv_round, quant_attention, quant_attention_reference

pytestmark = pytest.mark.skipif(unsupported_reason() is not None,
                                reason=f"quantized kernels cannot run here: {unsupported_reason()}")
BS, BLOCKS, CONTEXT = 16, 40, 150  # past position 128 a query folds three chunks of 64
# AVX-512 without VDPBF16PS (its 512-bit loops with two FMAs a pair): what this CPU must have to run it
NO_BF16_MARCH = "icelake-server"
NO_BF16_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512dq", "avx512_vnni", "avx512vbmi", "avx512_vbmi2",
                 "avx512_bitalg", "avx512_vpopcntdq", "avx512ifma", "gfni", "vaes", "vpclmulqdq")


def _case(nq: int, nkv: int, d: int, rows: int):
    """Two sequences of CONTEXT + rows cached positions (blocks scattered), their last `rows` as queries."""
    g = torch.Generator().manual_seed(nq * 1000 + d + rows)
    k = torch.randn(BLOCKS * BS, nkv, d, generator=g).to(KV_DTYPE)
    v = torch.randn(BLOCKS * BS, nkv, d, generator=g).to(KV_DTYPE)
    tables = torch.randperm(BLOCKS, generator=g)[:2 * 12].view(2, 12)
    positions = torch.arange(CONTEXT, CONTEXT + rows).repeat(2)
    q = 2 * torch.randn(2 * rows, nq, d, generator=g)  # scores spread enough that the softmax is not flat
    return q, k, v, torch.tensor([0, rows, 2 * rows]), positions, tables


def _rows_alone_and_on_one_thread(q, k, v, cu_q, positions, tables, scale, window, rows, lib):
    """The two sequences' rows together on 2 threads, asserted equal to each row alone and to one thread."""
    together = quant_attention(q, k, v, cu_q, positions, tables, BS, scale, window, num_threads=2, lib=lib)
    for t in range(2 * rows):
        s = t // rows
        alone = quant_attention(q[t:t + 1].contiguous(), k, v, torch.tensor([0, 1]), positions[t:t + 1],
                                tables[s:s + 1], BS, scale, window, num_threads=2, lib=lib)
        assert torch.equal(together[t], alone[0]), t
    assert torch.equal(together, quant_attention(q, k, v, cu_q, positions, tables, BS, scale, window, num_threads=1,
                                                 lib=lib))
    return together


@pytest.mark.parametrize("nq, nkv, d, window", [(6, 2, 64, None), (3, 3, 128, None), (8, 2, 64, 50), (6, 2, 48, None)],
                         ids=["gqa3-d64", "mha-d128", "gqa4-d64-window", "gqa3-d48"])
@pytest.mark.parametrize("rows", [3, 19], ids=["chunk-tasks", "group-tasks"])
@pytest.mark.parametrize("build", ["native", "avx2", "avx512-no-bf16"])
def test_rows_together_equal_rows_alone_and_the_reference(nq, nkv, d, window, rows, build):
    """On this CPU's build, on the x86-64-v3 one (256-bit loops: up to 3 queries share a key
    row's split, 6 a value row's conversion) and on an AVX-512 one without VDPBF16PS (two FMAs a
    pair), the same bits as each row alone and as this CPU's build."""
    if build == "avx2" and not has_fast_path():
        pytest.skip("the AVX2 build needs avx2, fma and f16c")
    missing = missing_cpu_flags(NO_BF16_FLAGS)
    if build == "avx512-no-bf16" and missing:
        pytest.skip(f"the {NO_BF16_MARCH} build needs {', '.join(missing)}")
    lib = {"native": quant_kernels, "avx2": lambda: quant_kernels(march=AVX2_MARCH),
           "avx512-no-bf16": lambda: quant_kernels(march=NO_BF16_MARCH)}[build]()
    q, k, v, cu_q, positions, tables = _case(nq, nkv, d, rows)
    scale = d**-0.5
    together = _rows_alone_and_on_one_thread(q, k, v, cu_q, positions, tables, scale, window, rows, lib)
    if build != "native":
        native = quant_attention(q, k, v, cu_q, positions, tables, BS, scale, window, num_threads=2)
        assert torch.equal(together, native)
    # the reference rounds the same numerators to bf16, but from torch.exp and other sums: one on a
    # rounding boundary can round the other way (2^-8 of its weight, ~1e-4 here); all else agrees
    # to fp32 rounding (mean ~1e-7; against unrounded probabilities the mean is ~2e-4)
    ref = quant_attention_reference(q, k, v, cu_q, positions, tables, BS, scale, window)
    torch.testing.assert_close(together, ref, rtol=0, atol=3e-4)
    assert (together - ref).abs().mean() < 1e-6


@pytest.mark.parametrize("nq, nkv, d, window", [(6, 2, 64, None), (3, 3, 128, None), (8, 2, 64, 50), (4, 1, 256, None)],
                         ids=["gqa3-d64", "mha-d128", "gqa4-d64-window", "gqa4-d256"])
@pytest.mark.parametrize("rows", [3, 19], ids=["chunk-tasks", "group-tasks"])
def test_attention_on_amx_tiles_keeps_each_rows_bits(nq, nkv, d, window, rows):
    """Scores and P.V on AMX-BF16 tiles (TDPBF16PS, up to 16 queries a tile multiply): each row's
    bits those of the row alone (a row's 1-4 queries take the keys as they lie in the cache, 19
    rows' 57 key tiles: the same bits) and of one thread, the result within rounding of
    quant_attention_reference as the vector paths are. The tile unit sums in its own order, so
    the bits differ from the vector paths' (not asserted: rounding may agree)."""
    lib = quant_kernels()
    try:
        attention_tiles(lib, True)
    except ValueError as e:
        pytest.skip(str(e))
    try:
        q, k, v, cu_q, positions, tables = _case(nq, nkv, d, rows)
        scale = d**-0.5
        together = _rows_alone_and_on_one_thread(q, k, v, cu_q, positions, tables, scale, window, rows, lib)
    finally:
        attention_tiles(lib, False)
    ref = quant_attention_reference(q, k, v, cu_q, positions, tables, BS, scale, window)
    torch.testing.assert_close(together, ref, rtol=0, atol=3e-4)
    assert (together - ref).abs().mean() < 1e-6


def test_attention_tiles_leave_heads_of_other_depths_on_the_vector_path():
    """A head of 48 values is no whole number of 32-value tile rows: with tiles asked for, the
    vector path's bits; and the switch reports and restores its state."""
    lib = quant_kernels()
    q, k, v, cu_q, positions, tables = _case(6, 2, 48, 5)
    vector = quant_attention(q, k, v, cu_q, positions, tables, BS, 0.125, num_threads=2, lib=lib)
    assert not attention_tiles(lib)
    try:
        attention_tiles(lib, True)
    except ValueError as e:
        assert "cannot run on AMX tiles" in str(e) and not attention_tiles(lib)
        pytest.skip(str(e))
    try:
        assert attention_tiles(lib)
        assert torch.equal(quant_attention(q, k, v, cu_q, positions, tables, BS, 0.125, num_threads=2, lib=lib), vector)
    finally:
        attention_tiles(lib, False)
    assert not attention_tiles(lib)


@pytest.mark.skipif(not has_fast_path(), reason="the AVX2 build needs avx2, fma and f16c")
def test_softmax_numerators_far_below_the_max_are_the_avx2_builds():
    """Scores spread over hundreds (queries 40x larger): numerators e^(s - m) from 1 down to past
    e^-88, where AVX-512's exp clamps at -40 and scales by VSCALEFPS (their values flush to zero
    either way) and the AVX2 build's runs Cephes' clamps: the same bits."""
    q, k, v, cu_q, positions, tables = _case(6, 2, 64, 3)
    q = 40 * q
    native = quant_attention(q, k, v, cu_q, positions, tables, BS, 0.125, num_threads=2)
    avx2 = quant_attention(q, k, v, cu_q, positions, tables, BS, 0.125, num_threads=2, lib=quant_kernels(march=AVX2_MARCH))
    assert torch.equal(native, avx2)


def test_a_verifys_rows_in_one_group_equal_rows_alone():
    """A verify of 11 drafts: one sequence's 12 rows, few enough for chunk tasks, one group past
    the old 8-row limit, each row with the bits of the row computed alone."""
    q, k, v, _, positions, tables = _case(6, 2, 64, 12)
    q, positions, cu_q = q[:12].contiguous(), positions[:12], torch.tensor([0, 12])
    together = quant_attention(q, k, v, cu_q, positions, tables[:1], BS, 0.125, num_threads=2)
    for t in range(12):
        alone = quant_attention(q[t:t + 1].contiguous(), k, v, torch.tensor([0, 1]), positions[t:t + 1], tables[:1],
                                BS, 0.125, num_threads=2)
        assert torch.equal(together[t], alone[0]), t


def test_bad_indices_are_refused():
    q, k, v, cu_q, positions, tables = _case(6, 2, 64, 3)
    bad = tables.clone()
    bad[0, 2] = BLOCKS  # a block past the cache
    with pytest.raises(IndexError, match="out of range"):
        quant_attention(q, k, v, cu_q, positions, bad, BS, 0.125)
    with pytest.raises(IndexError, match="out of range"):
        quant_attention(q, k, v, torch.tensor([0, 4, 3]), positions, tables, BS, 0.125)


def test_fp32_caches_are_refused():
    q, k, v, cu_q, positions, tables = _case(6, 2, 64, 3)
    with pytest.raises(ValueError, match="k_cache must be torch.bfloat16"):
        quant_attention(q, k.float(), v, cu_q, positions, tables, BS, 0.125)


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
def test_kv_rounding_is_torchs_bfloat16_with_tiny_values_flushed(scalar):
    """Every K/V value the decoder writes (and every query) is rounded as torch's bfloat16: ties to
    even, overflow to inf, signed zeros, infinities and NaN; magnitudes below 2^-50 become a zero
    of their sign (so that no bf16 product sum is subnormal: VDPBF16PS flushes those)."""
    lib = quant_kernels(scalar=scalar)
    bits = torch.randint(0, 2**32, (1 << 16,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    x = torch.cat([torch.tensor([0.0, -0.0, 1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, 3.4e38, -3.4e38,
                                 float("inf"), float("-inf"), KV_FLUSH, -KV_FLUSH, KV_FLUSH * (1 - 2.0**-20),
                                 -KV_FLUSH * 0.75, 1e-40, -1e-45, 6.1e-5]),
                   bits.to(torch.int32).view(torch.float32),  # every exponent, NaNs among them
                   torch.rand(4096, generator=torch.Generator().manual_seed(5)) * 2.0**-48,  # around the flush
                   torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 1000])
    x = x[~torch.isnan(x)]
    out = torch.empty(x.numel(), dtype=KV_DTYPE)
    lib.agentrt_quant_kv_store(x.data_ptr(), x.numel(), out.data_ptr())
    want = torch.where(x.abs() < KV_FLUSH, x * 0.0, x).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(out.view(torch.int16), kv_round(x).view(torch.int16))
    assert (out[x.abs() < KV_FLUSH] == 0).all() and torch.equal(out[x == -KV_FLUSH * 0.75].view(torch.int16),
                                                                  torch.tensor([-0.0], dtype=KV_DTYPE).view(torch.int16))
    nan = torch.tensor([float("nan")] * 9)
    lib.agentrt_quant_kv_store(nan.data_ptr(), 9, out.data_ptr())
    assert torch.isnan(out[:9]).all()
