"""GGUF block-quantized weights (Q8_0, Q4_0, Q4_1) and their pure-PyTorch references.

A quantized [N, K] weight is N rows of K/32 blocks; a block holds 32 consecutive values of a row:

    Q8_0  34 bytes: f16 d, 32 x int8 q                value = q * d
    Q4_0  18 bytes: f16 d, 16 bytes of nibbles        value = (q - 8) * d
    Q4_1  20 bytes: f16 d, f16 m, 16 bytes of nibbles value = q * d + m

Nibbles (gguf.quants, ggml's block_q4_*): byte j holds value j in its low nibble and value j + 16
in its high nibble. The references here reproduce gguf.quants bit for bit (same fp32 ops, same
order, no fused multiply-add): the tests hold them to exact equality.

The C kernel (csrc/cpu_quant_avx2.c) quantizes activations on the fly, per row, to int8 blocks
of 32 with an fp32 scale (`quantize_activations`, mirrored there exactly), so it is compared
tightly against `quant_linear_q8_reference` (same int8 activations, fp32 rounding only) and
loosely against `quant_linear_reference` (float activations).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

QK = 32  # values per block, every format here


@dataclass(frozen=True)
class QuantFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value; also the format code the C kernel takes
    block_bytes: int
    has_min: bool = False  # Q4_1: a per-block f16 offset m after d
    block_size: int = QK

    @property
    def nibbles(self) -> bool:
        return self.block_bytes < 2 + self.block_size


Q4_0 = QuantFormat("Q4_0", ggml_type=2, block_bytes=2 + 16)
Q4_1 = QuantFormat("Q4_1", ggml_type=3, block_bytes=2 + 2 + 16, has_min=True)
Q8_0 = QuantFormat("Q8_0", ggml_type=8, block_bytes=2 + 32)
FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q8_0)}
FORMAT_BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight (N output rows, K inputs) in a GGUF block format, as stored in the file."""

    format: QuantFormat
    shape: tuple[int, int]  # (N, K)
    data: torch.Tensor  # [N, K // 32 * block_bytes] uint8, rows contiguous

    def __post_init__(self):
        n, k = self.shape
        if k % self.format.block_size:
            raise ValueError(f"{self.format.name}: K ({k}) must be a multiple of {self.format.block_size}")
        want = (n, k // self.format.block_size * self.format.block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(f"{self.format.name} [{n}, {k}]: data must be contiguous uint8 {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def blocks_per_row(self) -> int:
        return self.shape[1] // self.format.block_size


def quant_weight_from_gguf(tensor) -> QuantWeight:
    """A gguf.GGUFReader tensor (2-D, Q8_0/Q4_0/Q4_1) as a QuantWeight, sharing the file's
    memory map (no copy). GGUF lists dimensions innermost first: shape [K, N]."""
    fmt = FORMAT_BY_GGML_TYPE.get(int(tensor.tensor_type))
    if fmt is None or len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: not a 2-D Q8_0/Q4_0/Q4_1 tensor ({tensor.tensor_type!r}, {list(tensor.shape)})")
    k, n = (int(d) for d in tensor.shape)
    with warnings.catch_warnings():  # a read-only map: torch warns that writes would fail; kernels only read weights
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.data)
    return QuantWeight(fmt, (n, k), data.view(n, -1))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian f16 bytes -> [..., 1] float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15: the low nibbles are values 0..15, the high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _dequantize_blocks(blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[..., block_bytes] uint8 -> [..., 32] float32, with gguf.quants' fp32 ops."""
    d = _f16(blocks[..., 0:2])
    if fmt is Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8).float() * d
    if fmt is Q4_0:
        return (_unpack_nibbles(blocks[..., 2:]).float() - 8) * d
    m = _f16(blocks[..., 2:4])
    return _unpack_nibbles(blocks[..., 4:]).float() * d + m  # a multiply, then an add: not fused


def dequantize(w: QuantWeight) -> torch.Tensor:  # [N, K] float32
    n, k = w.shape
    return _dequantize_blocks(w.data.view(n, w.blocks_per_row, w.format.block_bytes), w.format).view(n, k)


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:  # [T, K] float32
    """Rows `ids` [T] of the weight, dequantized: the embedding lookup's reference."""
    rows = w.data[ids.long()]
    return _dequantize_blocks(rows.view(len(ids), w.blocks_per_row, w.format.block_bytes), w.format).view(len(ids), -1)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (ggml's Q8_0 reference), exactly as gguf.quants.np_roundf computes it:
    floor(|v| + 0.5) would round 0.49999997 up."""
    a = v.abs()
    f = a.floor()
    return v.sign() * (f + (2 * (a - f)).floor())


def _div(a: torch.Tensor, c: float) -> torch.Tensor:
    # a / c as one IEEE division per element, as numpy and C compute it: tensor / tensor (a
    # Python number on either side may become a reciprocal and a multiply)
    return a / torch.full_like(a, c)


def _inverse(d: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """c / d, and 0 where d == 0."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), torch.full_like(d, c) / safe)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[..., 1] float32 -> [..., 2] uint8 of the nearest f16."""
    return v.half().contiguous().view(torch.uint8)


def quantize(w: torch.Tensor, fmt: QuantFormat) -> QuantWeight:
    """w [N, K] float -> the format's blocks, round-to-nearest as ggml's reference quantizers
    (quantize_row_*_ref; gguf.quants.quantize gives the same bytes). For tests."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"quantize: K ({k}) must be a multiple of {QK}")
    x = w.float().reshape(n, k // QK, QK)
    if fmt is Q8_0:
        d = _div(x.abs().amax(-1, keepdim=True), 127.0)
        q = _round_half_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        blocks = torch.cat([_f16_bytes(d), q], dim=-1)
    else:
        if fmt is Q4_0:  # the value of largest magnitude (the first such) maps to -8
            d = _div(x.gather(-1, x.abs().argmax(-1, keepdim=True)), -8.0)
            q = (x * _inverse(d) + 8.5).trunc()
            head = _f16_bytes(d)
        else:
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            d = _div(hi - lo, 15.0)
            q = ((x - lo) * _inverse(d) + 0.5).trunc()
            head = torch.cat([_f16_bytes(d), _f16_bytes(lo)], dim=-1)
        q = q.clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([head, q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    return QuantWeight(fmt, (n, k), blocks.reshape(n, -1).contiguous())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K] int8, d [M, K/32] float32), value ~ q * d: per block of 32,
    d = amax / 127 and q = round-half-even(x * (127 / amax)), as the C kernel computes them
    (llama.cpp's quantize_row_q8_1, with the scale kept in fp32). A block holding NaN or Inf gets
    d = NaN (so what it feeds is NaN, as in float arithmetic) and q = 0."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    finite = xb.isfinite().all(-1)  # a block with NaN or Inf: d NaN, q 0 (its outputs are NaN)
    amax = torch.where(finite, xb.abs().amax(-1), torch.zeros_like(xb[..., 0]))
    d = torch.where(finite, _div(amax, 127.0), torch.full_like(amax, float("nan")))
    inv = _inverse(amax, 127.0)
    inv = torch.where(inv.isfinite(), inv, torch.zeros_like(inv))  # amax < 127/FLT_MAX: zeros, as in C
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)  # torch.round: half to even, like cvtps2dq
    return q.view(m, k), d


def quant_linear_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(w).T -> [M, N] float32: float activations."""
    return x.float() @ dequantize(w).T


def quant_linear_q8_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The kernel's arithmetic up to fp32 rounding: activations first quantized to int8 blocks."""
    q, d = quantize_activations(x)
    m, k = q.shape
    xq = (q.view(m, k // QK, QK).float() * d.unsqueeze(-1)).view(m, k)
    return xq @ dequantize(w).T
