"""The K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256): references and kernel
(agentrt/kernels/quant_formats.py, csrc/cpu_quant_k.c; the blocks of 32: test_quant_linear.py).

Blocks are random bytes with finite f16 scale fields of varied magnitude (gguf.quants cannot
quantize to K-quants): every sub-block scale, min and quant value occurs.
- The references equal gguf.quants.dequantize exactly, and survive a GGUF file round trip.
- The kernel (its AVX2 path, and the scalar fallback built on purpose) against the reference on
  the same int8 activations: only fp32 rounding differs. Both sum the same K products, the
  kernel as one term per sub-block, (d sc) dx sum(q qx), and one per min, (dmin m) xs, whose
  magnitudes sum to at most sum_k |xq_k| (|w_k| + 2 |o_k|), o_k = -dmin m the weight's offset
  (0 for Q6_K, whose - 32 is integer): |err| <= ~K * 2^-24 times that at worst (K = 1536:
  9e-5), tested at 1e-4 times it. Against the float reference each activation moves by at
  most half its block's step, amax / 254: |err| <= sum_blocks amax / 254 * sum_block |w| plus
  the fp32 term.
- A row's output bits do not depend on M, on the other rows, or on the thread count.
"""
from __future__ import annotations

import gguf
import pytest
import torch
from quant_helpers import activations, qtype

from agentrt.kernels.quant_formats import (
    FORMAT_BY_GGML_TYPE,
    FORMATS,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    QuantWeight,
    dequantize,
    dequantize_rows,
    quant_linear_q8_reference,
    quant_linear_reference,
    quant_weight_from_gguf,
    quantize,
    quantize_activations,
)
from agentrt.kernels.quant_linear import quant_embedding, quant_linear

KFMTS = [Q4_K, Q5_K, Q6_K]
F16_FIELDS = {Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}  # d (and dmin): byte offsets in a block
QUANT_BYTES = {Q4_K: slice(16, 144), Q5_K: slice(16, 176)}  # qh and nibbles; zeroed, w = -dmin * m



def _random_weight(fmt, n: int, k: int, g: torch.Generator) -> QuantWeight:
    """Random bytes, with f16 d (and dmin) of varied magnitude and sign (subnormal f16 included)."""
    nb = k // fmt.block_size
    data = torch.randint(0, 256, (n, nb, fmt.block_bytes), generator=g, dtype=torch.uint8)
    for o in F16_FIELDS[fmt]:
        d = torch.exp(torch.empty(n, nb, 1).uniform_(-19, -6, generator=g)) * torch.randn(n, nb, 1, generator=g).sign()
        data[..., o:o + 2] = d.half().view(torch.uint8)
    return QuantWeight(fmt, (n, k), data.view(n, -1).contiguous())



def _offsets(w: QuantWeight) -> torch.Tensor:  # [N, K] float32
    """The weight's offsets -dmin * m per value (zeros for Q6_K): the blocks with their quants zeroed."""
    if w.format not in QUANT_BYTES:
        return torch.zeros(w.shape)
    n = w.shape[0]
    data = w.data.view(n, w.blocks_per_row, w.format.block_bytes).clone()
    data[..., QUANT_BYTES[w.format]] = 0
    return dequantize(QuantWeight(w.format, w.shape, data.view(n, -1)))


def _check_against_references(y: torch.Tensor, x: torch.Tensor, w: QuantWeight) -> None:
    """The module docstring's bounds, for the kernel's y [M, N] on x [M, K]."""
    wd = dequantize(w)
    mag = wd.abs() + 2 * _offsets(w).abs()  # [N, K]: bounds |d sc q| + |dmin m|
    q, d = quantize_activations(x)
    m, k = x.shape
    xq = (q.view(m, k // 32, 32).float() * d.unsqueeze(-1)).view(m, k)
    assert (y - quant_linear_q8_reference(x, w)).abs().le(1e-4 * (xq.abs() @ mag.T) + 1e-30).all()
    half_step = (x.view(m, k // 32, 32).abs().amax(-1) / 254).repeat_interleave(32, dim=1)  # [M, K]
    bound = half_step @ wd.abs().T * 1.001 + 1e-4 * (x.abs() @ mag.T)
    assert (y - quant_linear_reference(x, w)).abs().le(bound).all()


# ---- the formats ----


@pytest.mark.parametrize("fmt", KFMTS, ids=lambda f: f.name)
def test_block_layouts_are_ggufs(fmt):
    assert gguf.GGML_QUANT_SIZES[qtype(fmt)] == (fmt.block_size, fmt.block_bytes) == (256, fmt.block_bytes)
    assert qtype(fmt).name == fmt.name and FORMATS[fmt.name] is fmt and FORMAT_BY_GGML_TYPE[fmt.ggml_type] is fmt


@pytest.mark.parametrize("fmt", KFMTS, ids=lambda f: f.name)
def test_dequantize_equals_gguf_on_random_blocks(fmt):
    w = _random_weight(fmt, 37, 768, torch.Generator().manual_seed(fmt.ggml_type))
    ref = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), qtype(fmt)))
    assert ref.isfinite().all() and torch.equal(dequantize(w), ref)
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(dequantize_rows(w, ids), ref[ids])


def test_k_quant_offsets_are_the_mins():
    """The tests' bound helper: zeroed quants leave -dmin * m, constant over each 32 values."""
    o = _offsets(_random_weight(Q4_K, 3, 512, torch.Generator().manual_seed(1)))
    assert (o.view(3, 16, 32) == o.view(3, 16, 32)[..., :1]).all() and o.abs().gt(0).any()


def test_gguf_files_with_k_quants_map_as_weights(tmp_path):
    """A GGUF holding K-quant (and Q5_0) tensors: read back as QuantWeights of the file's bytes."""
    g = torch.Generator().manual_seed(4)
    weights = {"a": _random_weight(Q4_K, 48, 512, g), "b": _random_weight(Q6_K, 3, 256, g),
               "c": _random_weight(Q5_K, 5, 1536, g),
               "d": quantize(torch.randn(7, 576, generator=g), Q5_0)}  # a Q4_K_M file's rows of 576
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    for name, w in weights.items():
        writer.add_tensor(name, w.data.numpy(), raw_dtype=qtype(w.format))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for t in gguf.GGUFReader(tmp_path / "k.gguf").tensors:
        w, want = quant_weight_from_gguf(t), weights[t.name]
        assert w.format is want.format and w.shape == want.shape and torch.equal(w.data, want.data)
        assert torch.equal(dequantize(w), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))


def test_rows_not_a_multiple_of_256_are_refused(lib):
    with pytest.raises(ValueError, match="Q4_K: K \\(576\\) must be a multiple of 256"):
        QuantWeight(Q4_K, (8, 576), torch.zeros(8, 2 * 144 + 72, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be contiguous uint8"):
        QuantWeight(Q6_K, (8, 512), torch.zeros(8, 2 * 144, dtype=torch.uint8))  # Q4_K's bytes
    with pytest.raises(NotImplementedError, match="Q5_K"):
        quantize(torch.randn(4, 256), Q5_K)
    x, out, w = torch.randn(2, 288), torch.empty(2, 4), torch.zeros(4 * 210 * 2, dtype=torch.uint8)
    for fmt in KFMTS:  # the C entry points check too (-1: bad format or K)
        assert lib.agentrt_quant_linear(x.data_ptr(), 288, 2, w.data_ptr(), fmt.ggml_type, 4, 288,
                                        out.data_ptr(), 4, 1) == -1
        ids = torch.tensor([0], dtype=torch.int64)
        assert lib.agentrt_quant_embedding(ids.data_ptr(), 1, w.data_ptr(), fmt.ggml_type, 4, 288,
                                           out.data_ptr(), 4) == -1


# ---- the kernel ----


@pytest.mark.parametrize("fmt", KFMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("N,K", [(1, 256), (3, 512), (17, 768), (37, 1536), (70, 256)])
def test_kernel_matches_references(lib, fmt, N, K):
    g = torch.Generator().manual_seed(N * 7 + K + fmt.ggml_type)
    w = _random_weight(fmt, N, K, g)
    x = activations(64, K, g)
    ms = (1, 2, 3, 4, 5, 8, 17, 33, 64)
    ys = [quant_linear(x[:M], w, num_threads=2, lib=lib) for M in ms]
    for M, y in zip(ms, ys):
        assert y.shape == (M, N) and y.dtype == torch.float32
    _check_against_references(torch.cat(ys), torch.cat([x[:M] for M in ms]), w)  # the references once


@pytest.mark.parametrize("fmt", KFMTS, ids=lambda f: f.name)
def test_rows_do_not_depend_on_the_batch(lib, fmt):
    g = torch.Generator().manual_seed(fmt.ggml_type)
    w = _random_weight(fmt, 37, 512, g)  # 37 rows: chunks of 16 and a tail of 5 (a pair, a single)
    x = activations(64, 512, g)
    full = quant_linear(x, w, num_threads=2, lib=lib)
    for M in (*range(1, 10), 16, 17, 31, 33, 63, 64):
        assert torch.equal(quant_linear(x[:M], w, num_threads=2, lib=lib), full[:M]), M
    for i in (0, 1, 5, 63):  # alone, beside other rows, in another order, on one thread or three
        assert torch.equal(quant_linear(x[i:i + 1], w, num_threads=1, lib=lib)[0], full[i])
        assert torch.equal(quant_linear(x[i:i + 3], w, num_threads=3, lib=lib)[0], full[i])
    perm = torch.randperm(64, generator=g)
    assert torch.equal(quant_linear(x[perm], w, num_threads=2, lib=lib), full[perm])
    assert torch.equal(quant_linear(x, w, num_threads=1, lib=lib), full)
    assert torch.equal(quant_linear(x, w, num_threads=3, lib=lib), full)
    wide = torch.full((64, 50), 7.0)  # strided rows in, a strided out
    y = quant_linear(torch.cat([x, x], 1)[:, :512], w, out=wide[:, 6:43], lib=lib)
    assert torch.equal(y, full) and (wide[:, :6] == 7).all() and (wide[:, 43:] == 7).all()


@pytest.mark.parametrize("fmt", KFMTS, ids=lambda f: f.name)
def test_embedding_is_exactly_the_dequantized_rows(lib, fmt):
    w = _random_weight(fmt, 300, 768, torch.Generator().manual_seed(fmt.ggml_type))
    ids = torch.tensor([0, 299, 5, 5, 17, 128, 0])
    ref = torch.from_numpy(gguf.quants.dequantize(w.data.numpy()[ids.numpy()], qtype(fmt)))
    assert torch.equal(quant_embedding(ids, w, lib=lib), ref)
    assert torch.equal(quant_embedding(ids.int(), w, lib=lib), dequantize_rows(w, ids))
    assert quant_embedding(torch.tensor([], dtype=torch.long), w, lib=lib).shape == (0, 768)
    with pytest.raises(IndexError):
        quant_embedding(torch.tensor([300]), w, lib=lib)


@pytest.mark.parametrize("fmt", KFMTS, ids=lambda f: f.name)
def test_nan_and_inf_activations_give_nan_not_numbers(lib, fmt):
    """A NaN or Inf in an activation block makes every output it feeds NaN; other rows untouched."""
    g = torch.Generator().manual_seed(5)
    w = _random_weight(fmt, 17, 512, g)
    x = activations(4, 512, g)
    x[1, 300], x[2, 3] = float("nan"), float("-inf")
    x[3, 256:288] = 1e-38  # amax < 127 / FLT_MAX: 127 / amax overflows, the block is zeros
    y = quant_linear(x, w, lib=lib)
    assert y[1].isnan().all() and y[2].isnan().all() and y[3].isfinite().all()
    assert torch.equal(y[0], quant_linear(x[:1], w, lib=lib)[0])


def test_without_the_library_the_references_run(monkeypatch):
    import agentrt.kernels.quant_linear as ql

    monkeypatch.setattr(ql, "quant_kernels", lambda: None)
    g = torch.Generator().manual_seed(2)
    w = _random_weight(Q5_K, 20, 256, g)
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(ql.quant_linear(x, w), quant_linear_reference(x, w))
    assert torch.equal(ql.quant_embedding(torch.tensor([3, 1]), w), dequantize(w)[[3, 1]])

