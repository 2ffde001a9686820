"""GGUF block-quantized weights and their pure-PyTorch references.

A quantized [N, K] weight is N rows of K/block_size blocks, each holding block_size consecutive
values of a row. Blocks of 32:

    Q8_0  34 bytes: f16 d, 32 x int8 q                         value = q * d
    Q4_0  18 bytes: f16 d, 16 bytes of nibbles                 value = (q - 8) * d
    Q4_1  20 bytes: f16 d, f16 m, 16 bytes of nibbles          value = q * d + m
    Q5_0  22 bytes: f16 d, 4 bytes qh, 16 bytes of nibbles     value = (q - 16) * d
    Q5_1  24 bytes: f16 d, f16 m, 4 bytes qh, 16 of nibbles    value = q * d + m

Nibbles (gguf.quants, ggml's block_q4_*, block_q5_*): byte j holds value j in its low nibble and
value j + 16 in its high nibble; Q5's fifth bit of value j is bit j of the little-endian uint32 qh.

K-quants, super-blocks of 256 (llama.cpp's Q4_K_M and kin), in sub-blocks of 32 (Q6_K: 16). A
row's length must be a multiple of 256: llama.cpp's mixes store the tensors whose rows are not
(SmolLM2's 576) in a format with blocks of 32, such as Q5_0.

    Q4_K  144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit sc[8], m[8], 128 bytes of nibbles
    Q5_K  176 bytes: as Q4_K with 32 bytes qh before the nibbles
          value = (d * sc[s]) * q - (dmin * m[s]),  s = sub-block (32 values)
    Q6_K  210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 sc[16], f16 d
          value = (d * sc[s]) * (q - 32),  s = sub-block (16 values)

Q4_K/Q5_K: the 32-byte group c of nibbles holds sub-block 2c (low nibbles) and 2c + 1 (high);
Q5_K's fifth bit of value l of sub-block s is bit s of qh[l]. sc and m: bytes 0..3 hold sc[0..3]
and 4..7 m[0..3] in their low 6 bits; byte 8 + j holds the low 4 bits of sc[4 + j] (low nibble)
and m[4 + j] (high), whose top 2 bits are the top 2 bits of bytes j and 4 + j. Q6_K: each half
h of 128 values has 64 bytes of ql and 32 of qh; value 32t + l (t < 4, l < 32) of the half takes
nibble t >> 1 of ql[32 (t & 1) + l] and bits 2t, 2t + 1 of qh[l].

Rows interleaved by 8 (`interleave_rows8`; Q4_0, Q4_1, Q8_0): the layout the C kernel reads
fastest. Rows 8g .. 8g+7 form group g, and block b of the group is 8 x block_bytes: the 8 rows'
f16 d, Q4_1's 8 f16 m, then the value bytes in 32-byte chunks, chunk c holding bytes 4c .. 4c+3
of row 0's values, then of row 1's, ... row 7's. A partial last group is padded with zero rows.
Same bytes, same values: only the order changes (`deinterleave_rows8` undoes it).

The references here reproduce gguf.quants bit for bit (same fp32 ops, same order, no fused
multiply-add): the tests hold them to exact equality.

The C kernel (csrc/cpu_quant_avx2.c, csrc/cpu_quant_k.c) quantizes activations on the fly, per
row, to int8 blocks of 32 with an fp32 scale (`quantize_activations`, mirrored there exactly), so
it is compared tightly against `quant_linear_q8_reference` (same int8 activations, fp32 rounding
only) and loosely against `quant_linear_reference` (float activations).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

QK = 32  # values per block of the small formats, and per block of quantized activations
QK_K = 256  # values per K-quant super-block


@dataclass(frozen=True)
class QuantFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value; also the format code the C kernel takes
    block_bytes: int
    has_min: bool = False  # Q4_1, Q5_1: a per-block f16 offset m after d; Q4_K, Q5_K: dmin * m[s]
    block_size: int = QK

    @property
    def nibbles(self) -> bool:
        return self.block_bytes < 2 + self.block_size


Q4_0 = QuantFormat("Q4_0", ggml_type=2, block_bytes=2 + 16)
Q4_1 = QuantFormat("Q4_1", ggml_type=3, block_bytes=2 + 2 + 16, has_min=True)
Q5_0 = QuantFormat("Q5_0", ggml_type=6, block_bytes=2 + 4 + 16)
Q5_1 = QuantFormat("Q5_1", ggml_type=7, block_bytes=2 + 2 + 4 + 16, has_min=True)
Q8_0 = QuantFormat("Q8_0", ggml_type=8, block_bytes=2 + 32)
Q4_K = QuantFormat("Q4_K", ggml_type=12, block_bytes=2 + 2 + 12 + 128, has_min=True, block_size=QK_K)
Q5_K = QuantFormat("Q5_K", ggml_type=13, block_bytes=2 + 2 + 12 + 32 + 128, has_min=True, block_size=QK_K)
Q6_K = QuantFormat("Q6_K", ggml_type=14, block_bytes=128 + 64 + 16 + 2, block_size=QK_K)
FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)}
FORMAT_BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}
ROWS8_FORMATS = (Q4_0, Q4_1, Q8_0)  # the formats interleave_rows8 lays out
ROWS8 = 0x100  # added to a format code: rows interleaved by 8 (csrc/cpu_quant.h)


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight (N output rows, K inputs) in a GGUF block format, as stored in the file."""

    format: QuantFormat
    shape: tuple[int, int]  # (N, K)
    data: torch.Tensor  # [N, K // block_size * block_bytes] uint8, rows contiguous; rows8: [ceil(N / 8), 8 x that]
    rows8: bool = False  # rows interleaved by 8 (interleave_rows8), else the file's layout

    def __post_init__(self):
        n, k = self.shape
        if k % self.format.block_size:
            raise ValueError(f"{self.format.name}: K ({k}) must be a multiple of {self.format.block_size}, "
                             f"its block size")
        if self.rows8 and self.format not in ROWS8_FORMATS:
            raise ValueError(f"{self.format.name}: no rows-by-8 layout (only {'/'.join(f.name for f in ROWS8_FORMATS)})")
        row = k // self.format.block_size * self.format.block_bytes
        want = rows8_shape(self.format, self.shape) if self.rows8 else (n, row)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(f"{self.format.name} [{n}, {k}]: data must be contiguous uint8 {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def blocks_per_row(self) -> int:
        return self.shape[1] // self.format.block_size

    @property
    def kernel_code(self) -> int:
        """The format code the C kernels take: the GGML type, plus ROWS8 for interleaved rows."""
        return self.format.ggml_type | (ROWS8 if self.rows8 else 0)


def quant_weight_from_gguf(tensor) -> QuantWeight:
    """A gguf.GGUFReader tensor (2-D, in one of FORMATS) as a QuantWeight, sharing the file's
    memory map (no copy). GGUF lists dimensions innermost first: shape [K, N]."""
    fmt = FORMAT_BY_GGML_TYPE.get(int(tensor.tensor_type))
    if fmt is None or len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: not a 2-D tensor in one of {'/'.join(FORMATS)} "
                         f"({tensor.tensor_type!r}, {list(tensor.shape)})")
    k, n = (int(d) for d in tensor.shape)
    with warnings.catch_warnings():  # a read-only map: torch warns that writes would fail; kernels only read weights
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.data)
    return QuantWeight(fmt, (n, k), data.view(n, -1))


def rows8_shape(fmt: QuantFormat, shape: tuple[int, int]) -> tuple[int, int]:
    """The data shape of an [N, K] weight in `fmt` with its rows interleaved by 8: [ceil(N / 8),
    8 rows' bytes]."""
    n, k = shape
    return (n + 7) // 8, 8 * (k // fmt.block_size) * fmt.block_bytes


def _rows8_parts(fmt: QuantFormat) -> tuple[int, int]:
    """(bytes of scales per row's block: d, and Q4_1's m; value bytes per row's block)"""
    head = 4 if fmt is Q4_1 else 2
    return head, fmt.block_bytes - head


def interleave_rows8(w: QuantWeight) -> QuantWeight:
    """w's rows interleaved by 8 (see the module docstring): a copy, the same bytes reordered."""
    if w.rows8:
        return w
    if w.format not in ROWS8_FORMATS:
        raise ValueError(f"{w.format.name}: no rows-by-8 layout (only {'/'.join(f.name for f in ROWS8_FORMATS)})")
    (n, _), nb, bb = w.shape, w.blocks_per_row, w.format.block_bytes
    head, vb = _rows8_parts(w.format)
    g = (n + 7) // 8
    blocks = torch.zeros(g * 8, nb, bb, dtype=torch.uint8)
    blocks[:n] = w.data.view(n, nb, bb)
    blocks = blocks.view(g, 8, nb, bb).transpose(1, 2)  # [G, nb, 8 rows, bb]
    scales = [blocks[..., i: i + 2].reshape(g, nb, 16) for i in range(0, head, 2)]  # 8 rows' d, then m
    values = blocks[..., head:].reshape(g, nb, 8, vb // 4, 4).transpose(2, 3).reshape(g, nb, 8 * vb)
    return QuantWeight(w.format, w.shape, torch.cat([*scales, values], dim=-1).reshape(g, -1), rows8=True)


def _rows8_blocks(data: torch.Tensor, fmt: QuantFormat, nb: int) -> torch.Tensor:
    """Groups [G, nb * 8 * block_bytes] of the rows-by-8 layout -> [G, 8, nb, block_bytes] file blocks."""
    g, bb = data.shape[0], fmt.block_bytes
    head, vb = _rows8_parts(fmt)
    gb = data.view(g, nb, 8 * bb)
    scales = [gb[..., 16 * i: 16 * i + 16].reshape(g, nb, 8, 2) for i in range(head // 2)]
    values = gb[..., 8 * head:].reshape(g, nb, vb // 4, 8, 4).transpose(2, 3).reshape(g, nb, 8, vb)
    return torch.cat([*scales, values], dim=-1).transpose(1, 2)


def deinterleave_rows8(w: QuantWeight) -> QuantWeight:
    """w in the file's layout (a copy when w.rows8)."""
    if not w.rows8:
        return w
    n = w.shape[0]
    blocks = _rows8_blocks(w.data, w.format, w.blocks_per_row).reshape(-1, w.blocks_per_row * w.format.block_bytes)
    return QuantWeight(w.format, w.shape, blocks[:n].contiguous())


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian f16 bytes -> [..., 1] float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15: the low nibbles are values 0..15, the high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: qh [..., 4], qs [..., 16] bytes -> [..., 32] values 0..31 (bit j of qh is value j's
    fifth bit)."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., 4, 8]
    return _unpack_nibbles(qs) | (bits.flatten(-2) << 4)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 12 scale bytes [..., 12] -> (sc, m), each [..., 8] float32 values 0..63."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _dequantize_k(blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[..., block_bytes] uint8 -> [..., 256] float32 (K-quant super-blocks), with gguf.quants' fp32 ops."""
    lead = blocks.shape[:-1]
    if fmt is Q6_K:
        ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
        ql = (ql & 0x0F).reshape(*lead, 8, 32)  # [..., half, nibble, 64] -> 32-value groups in order
        qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        qh = (qh & 0x03).reshape(*lead, 8, 32)
        q = ((ql | (qh << 4)).float() - 32).reshape(*lead, 16, 16)
        d = _f16(blocks[..., 208:210]).unsqueeze(-1) * blocks[..., 192:208].view(torch.int8).float().unsqueeze(-1)
        return (d * q).reshape(*lead, QK_K)  # d * sc first, as gguf.quants: [..., 16, 1] * [..., 16, 16]
    d, dmin = _f16(blocks[..., 0:2]).unsqueeze(-1), _f16(blocks[..., 2:4]).unsqueeze(-1)  # [..., 1, 1]
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(*lead, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    q = (qs & 0x0F).reshape(*lead, 8, 32)  # sub-block 2c: low nibbles of group c, 2c + 1: high
    if fmt is Q5_K:
        qh = blocks[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)  # [..., 8, 32]
        q = q | ((qh & 1) << 4)
    dl = d * sc.unsqueeze(-1)  # [..., 8, 1]
    dm = dmin * mn.unsqueeze(-1)
    return (dl * q.float() - dm).reshape(*lead, QK_K)  # a multiply, then a subtraction: not fused


def _dequantize_blocks(blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[..., block_bytes] uint8 -> [..., block_size] float32, with gguf.quants' fp32 ops."""
    if fmt.block_size == QK_K:
        return _dequantize_k(blocks, fmt)
    d = _f16(blocks[..., 0:2])
    if fmt is Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8).float() * d
    if fmt is Q4_0:
        return (_unpack_nibbles(blocks[..., 2:]).float() - 8) * d
    if fmt is Q5_0:
        return (_q5_values(blocks[..., 2:6], blocks[..., 6:]).float() - 16) * d
    m = _f16(blocks[..., 2:4])
    q = _unpack_nibbles(blocks[..., 4:]) if fmt is Q4_1 else _q5_values(blocks[..., 4:8], blocks[..., 8:])
    return q.float() * d + m  # a multiply, then an add: not fused


def dequantize(w: QuantWeight) -> torch.Tensor:  # [N, K] float32
    w = deinterleave_rows8(w)
    n, k = w.shape
    return _dequantize_blocks(w.data.view(n, w.blocks_per_row, w.format.block_bytes), w.format).view(n, k)


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:  # [T, K] float32
    """Rows `ids` [T] of the weight, dequantized: the embedding lookup's reference."""
    ids = ids.long()
    if w.rows8:
        rows = _rows8_blocks(w.data[ids // 8], w.format, w.blocks_per_row)[torch.arange(len(ids)), ids % 8]
    else:
        rows = w.data[ids]
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
    (quantize_row_*_ref; gguf.quants.quantize gives the same bytes). For tests; blocks of 32 only
    (the K-quants' quantizers search their scales, and the tests build their blocks from bytes)."""
    n, k = w.shape
    if fmt.block_size != QK:
        raise NotImplementedError(f"quantize: {fmt.name} is not supported (blocks of 32 only)")
    if k % QK:
        raise ValueError(f"quantize: K ({k}) must be a multiple of {QK}")
    x = w.float().reshape(n, k // QK, QK)
    if fmt is Q8_0:
        d = _div(x.abs().amax(-1, keepdim=True), 127.0)
        q = _round_half_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        blocks = torch.cat([_f16_bytes(d), q], dim=-1)
    else:
        levels = 32 if fmt in (Q5_0, Q5_1) else 16
        if not fmt.has_min:  # the value of largest magnitude (the first such) maps to -levels/2
            d = _div(x.gather(-1, x.abs().argmax(-1, keepdim=True)), -levels / 2)
            q = (x * _inverse(d) + (levels / 2 + 0.5)).trunc()
            head = _f16_bytes(d)
        else:
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            d = _div(hi - lo, levels - 1.0)
            q = ((x - lo) * _inverse(d) + 0.5).trunc()
            head = torch.cat([_f16_bytes(d), _f16_bytes(lo)], dim=-1)
        q = q.clamp(0, levels - 1).to(torch.uint8)
        if levels == 32:  # bit j of qh: value j's fifth bit
            bits = (q >> 4).view(n, k // QK, 4, 8) << torch.arange(8, dtype=torch.uint8)
            head = torch.cat([head, bits.sum(-1).to(torch.uint8)], dim=-1)
        blocks = torch.cat([head, (q[..., :16] & 0x0F) | (q[..., 16:] << 4)], dim=-1)
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
