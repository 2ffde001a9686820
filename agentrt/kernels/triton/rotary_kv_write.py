"""Rotary embedding of q and k and the paged KV write, in one Triton kernel; the reference is the
CPU module's `rotary_kv_write_reference`.

Layout: qkv [T, (nq + 2 nkv) d] holds each token's q heads, then its k heads, then its v heads,
each d wide. Rotate-half rotary: a head's first half x1 and second half x2 become
x1 cos - x2 sin and x2 cos + x1 sin, with cos/sin [P, d/2] indexed by the token's position.
q and k are rotated in place in qkv; the rotated k and the v of token t are copied into row
slots[t] of the caches [num_slots, nkv, d], unless slots[t] is negative (a padding row: the
engine's replayed steps pad their batch to a captured shape, engine/models/step_graphs.py).

The arithmetic repeats the reference's roundings op by op (cos and sin rounded to qkv's dtype,
each product rounded, then the sum), so the result is bit-identical to it: an fp32 intermediate
holds a product of two fp16 or bf16 values exactly and rounding a sum of two of them once to
the narrow type gives the correctly rounded result (24 >= 2 x 11 + 2 bits).
"""
from __future__ import annotations

from agentrt.kernels import triton as _backend  # noqa: F401  (first: picks the interpreter before any @triton.jit)

import torch
import triton
import triton.language as tl

from agentrt.kernels.paged_attention import rotary_kv_write_reference

__all__ = ["rotary_kv_write", "rotary_kv_write_reference"]


@triton.jit
def _rotary_kv_write_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_cos, stride_sin, stride_kt, stride_kh, stride_vt, stride_vh,
    NQ: tl.constexpr, NKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    QK_HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr,
):
    t = tl.program_id(0)
    position = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    dtype = qkv_ptr.dtype.element_ty
    half = tl.arange(0, HEAD_DIM // 2)
    c = tl.load(cos_ptr + position * stride_cos + half).to(dtype).to(tl.float32)  # [d/2], rounded as the reference's
    s = tl.load(sin_ptr + position * stride_sin + half).to(dtype).to(tl.float32)

    h = tl.arange(0, QK_HEADS_P)  # q heads, then k heads
    h_ok = h < NQ + NKV
    first = qkv_ptr + t * stride_qkv + h[:, None] * HEAD_DIM + half[None, :]  # [H, d/2]
    x1 = tl.load(first, mask=h_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(first + HEAD_DIM // 2, mask=h_ok[:, None], other=0.0).to(tl.float32)
    y1 = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, y1, mask=h_ok[:, None])
    tl.store(first + HEAD_DIM // 2, y2, mask=h_ok[:, None])

    # a negative slot (a padded row of a replayed step) is rotated, never written (as vectors: the
    # interpreter takes no scalar in a mask)
    is_k = h_ok & (h >= NQ) & (h * 0 + slot >= 0)
    k_dst = k_cache_ptr + slot * stride_kt + tl.where(is_k, h - NQ, 0)[:, None] * stride_kh + half[None, :]
    tl.store(k_dst, y1, mask=is_k[:, None])
    tl.store(k_dst + HEAD_DIM // 2, y2, mask=is_k[:, None])

    kv = tl.arange(0, KV_HEADS_P)
    kv_ok = (kv < NKV) & (kv * 0 + slot >= 0)
    d = tl.arange(0, HEAD_DIM)
    v = tl.load(qkv_ptr + t * stride_qkv + (NQ + NKV) * HEAD_DIM + kv[:, None] * HEAD_DIM + d[None, :],
                mask=kv_ok[:, None], other=0.0)
    tl.store(v_cache_ptr + slot * stride_vt + kv[:, None] * stride_vh + d[None, :], v, mask=kv_ok[:, None])


def rotary_kv_write(
    qkv: torch.Tensor,  # [T, (nq + 2 nkv) d]: q, k, v heads; q and k rotated in place; rows may be strided
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, d/2] fp32, P > max position
    sin: torch.Tensor,  # [P, d/2] fp32
    slots: torch.Tensor,  # [T] int64: the cache row each token's k and v go to; < 0: none
    k_cache: torch.Tensor,  # [num_slots, nkv, d], qkv's dtype
    v_cache: torch.Tensor,  # [num_slots, nkv, d]
    nq: int,
) -> None:
    """Rotary on q and k of every token (rotate-half layout, in place) and k, v into their cache
    slots; bit-identical to `rotary_kv_write_reference` with the same arguments."""
    if qkv.dim() != 2 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"rotary_kv_write: qkv must be [T, (nq + 2 nkv) d] and both caches [num_slots, nkv, d], got "
                         f"qkv {tuple(qkv.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    T = qkv.shape[0]
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    if qkv.shape[1] != (nq + 2 * nkv) * d:
        raise ValueError(f"rotary_kv_write: qkv rows hold {qkv.shape[1]} values, not (nq={nq} + 2 x nkv={nkv}) x d={d}")
    if d < 2 or d & (d - 1):
        raise ValueError(f"rotary_kv_write: head_dim {d} must be a power of two")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2:
        raise ValueError(f"rotary_kv_write: cos and sin must both be [P, d/2={d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if positions.shape != (T,) or slots.shape != (T,):
        raise ValueError(f"rotary_kv_write: positions and slots must be [T={T}], got {tuple(positions.shape)}, {tuple(slots.shape)}")
    if qkv.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"rotary_kv_write: qkv ({qkv.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("rotary_kv_write: qkv rows, cos/sin rows and cache head vectors must be contiguous")
    if T == 0:
        return
    _rotary_kv_write_kernel[(T,)](
        qkv, positions, cos, sin, slots, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NQ=nq, NKV=nkv, HEAD_DIM=d,
        QK_HEADS_P=triton.next_power_of_2(nq + nkv), KV_HEADS_P=triton.next_power_of_2(nkv),
    )
