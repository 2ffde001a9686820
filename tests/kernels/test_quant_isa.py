"""The quantized linears' instruction-set paths (csrc/cpu_quant_avx2.c, cpu_quant_avx512.c) on
weights with rows interleaved by 8: AVX2, AVX512-VNNI and AMX-INT8 give the same bits for every
row, whatever M, the tile of rows a row lands in, the number of weight rows (groups of 8 and 16,
a last partial one) or the thread count, so the path can be chosen per call without changing a
token. Each path is tested where the CPU has its instructions and skipped, naming the missing
flag, elsewhere; AVX2 runs on every machine with the fast path."""
from __future__ import annotations

import pytest
import torch
from quant_helpers import activations

from agentrt.kernels.quant_build import ISAS, cap_isa, isa, missing_isa_flags, quant_kernels, unsupported_reason
from agentrt.kernels.quant_formats import ROWS8_FORMATS, Q4_1, quant_linear_q8_reference, quantize
from agentrt.kernels.quant_linear import quant_linear, rows8

pytestmark = pytest.mark.skipif(unsupported_reason() is not None,
                                reason=f"quantized kernels cannot run here: {unsupported_reason()}")

FAST_ISAS = ISAS[1:]  # the scalar path is a build of its own (tests/kernels/test_quant_linear.py)
MS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 40)


def _needs(name: str):
    missing = missing_isa_flags(name)
    return pytest.mark.skipif(bool(missing), reason=f"{name}: this CPU lacks {', '.join(missing)}")


@pytest.fixture
def lib():
    lib = quant_kernels()
    best = isa(lib)
    yield lib
    cap_isa(lib, best)  # the other tests run on the best path again


def _weight(fmt, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return rows8(quantize(torch.randn(n, k, generator=g) * 0.05, fmt)), activations(max(MS), k, g)


@pytest.mark.parametrize("name", FAST_ISAS[1:], ids=str)
@pytest.mark.parametrize("fmt", ROWS8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("N,K", [(8, 32), (24, 96), (17, 160), (40, 576), (96, 1536)])
def test_every_path_gives_the_avx2_bits(lib, name, fmt, N, K):
    if missing_isa_flags(name):
        pytest.skip(f"{name}: this CPU lacks {', '.join(missing_isa_flags(name))}")
    w, x = _weight(fmt, N, K, N * K + fmt.ggml_type)
    assert cap_isa(lib, "avx2") == "avx2"
    want = [quant_linear(x[:m], w, num_threads=2) for m in MS]
    assert cap_isa(lib, name) == name
    for m, y in zip(MS, want):
        assert torch.equal(quant_linear(x[:m], w, num_threads=2), y), f"{name} M={m}"
    # the same rows are the references' (the integer sums are exact; only fp32 order differs)
    ref = quant_linear_q8_reference(x, w)
    assert (want[-1] - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-30


@pytest.mark.parametrize("name", FAST_ISAS, ids=str)
def test_a_row_does_not_depend_on_the_batch_or_the_threads(lib, name):
    if missing_isa_flags(name):
        pytest.skip(f"{name}: this CPU lacks {', '.join(missing_isa_flags(name))}")
    w, x = _weight(Q4_1, 200, 576, 7)
    cap_isa(lib, name)
    full = quant_linear(x, w, num_threads=2)
    for m in MS:
        assert torch.equal(quant_linear(x[:m], w, num_threads=2), full[:m]), m
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(quant_linear(x[perm], w, num_threads=3), full[perm])
    for i in (0, 1, 16, 39):  # alone, on one thread
        assert torch.equal(quant_linear(x[i:i + 1], w, num_threads=1)[0], full[i])


@pytest.mark.parametrize("name", FAST_ISAS[1:], ids=str)
def test_nan_and_inf_activations_give_nan_on_every_path(lib, name):
    if missing_isa_flags(name):
        pytest.skip(f"{name}: this CPU lacks {', '.join(missing_isa_flags(name))}")
    for fmt in ROWS8_FORMATS:
        w, x = _weight(fmt, 40, 96, 3)
        x = x[:20].clone()
        x[1, 40], x[2, 3] = float("nan"), float("inf")
        cap_isa(lib, "avx2")
        want = quant_linear(x, w)
        cap_isa(lib, name)
        y = quant_linear(x, w)
        assert y[1].isnan().all() and y[2].isnan().all()
        assert torch.equal(y.nan_to_num(), want.nan_to_num()) and torch.equal(y.isnan(), want.isnan())


def test_the_best_path_is_the_cpus(lib):
    best = [n for n in FAST_ISAS if not missing_isa_flags(n)][-1]
    assert isa(lib) == best
    with pytest.raises(ValueError, match="unknown instruction set"):
        cap_isa(lib, "avx9")
    with pytest.raises(ValueError, match="scalar"):
        cap_isa(lib, "scalar")  # built apart, not chosen at run time
    for name in FAST_ISAS:
        if missing_isa_flags(name):
            with pytest.raises(ValueError, match=missing_isa_flags(name)[0]):
                cap_isa(lib, name)


@_needs("amx-int8")
def test_prefill_sized_calls_on_amx(lib):
    """More than 16 rows: tiles of 16 activation rows, the last one partial, against weight tiles
    unpacked once per chunk."""
    w, x = _weight(Q4_1, 48, 1536, 11)
    x = torch.cat([x] * 3)[:100]
    cap_isa(lib, "avx2")
    want = quant_linear(x, w, num_threads=2)
    cap_isa(lib, "amx-int8")
    assert torch.equal(quant_linear(x, w, num_threads=2), want)


def test_built_for_switches_the_default_build_and_back():
    """quant_build.built_for(AVX2_MARCH): inside, quant_kernels() is the AVX2-only build (what a
    bench runs a loaded model on to measure a CPU without AVX-512), after it the default build
    again; a linear gives the same bits through either."""
    from agentrt.kernels.quant_build import AVX2_MARCH, built_for, has_fast_path

    if not has_fast_path():
        pytest.skip("the AVX2 build needs avx2, fma and f16c")
    native = quant_kernels()
    w, x = _weight(Q4_1, 40, 576, 7)
    want = quant_linear(x[:9], w)
    with built_for(AVX2_MARCH) as avx2:
        assert avx2 is quant_kernels(march=AVX2_MARCH) and quant_kernels() is avx2 and isa(avx2) == "avx2"
        assert torch.equal(quant_linear(x[:9], w), want)
    assert quant_kernels() is native
