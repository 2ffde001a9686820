"""Rotary + KV-cache write and paged attention over a ragged batch, in bf16: the C kernels
(csrc/cpu_attention_bf16.c), pure-PyTorch references, and the dispatchers.

Ragged layout: sequence b owns tokens cu_q[b]..cu_q[b+1] of the flat batch and row b of
`block_tables`; cache slot of its context position l = table[l // block_size] * block_size +
l % block_size. A token at position p attends to positions 0..p of its own sequence, or in a
sliding layer (window) to p - window + 1 .. p.
"""
from __future__ import annotations

import torch

from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.linear import norm_reference

# The kernel's setting, for this module's calls and the decoder stack's (decoder.py). Decode
# reads K and V once per step, so it is bound by how fast those rows arrive: prefetch 32 context
# rows ahead, because a head's row is 2d bytes of a slot row nkv times as wide, so a walk over
# one head skips most of every slot row and the hardware prefetchers fall behind (`agentrt bench
# attention`, docs/benchmarks.md).
PREFETCH_ROWS = 32


def _lib():
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("the CPU attention kernels are not available on this machine (see agentrt.kernels.cpu_build)")
    return lib


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, d]; cos, sin [T, 1, d] in x's dtype (halves repeated: rotate-half layout)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotary_kv_write_reference(
    qkv: torch.Tensor,  # [T, (nq + 2 nkv) d], updated in place (q and k rotated)
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, d/2] fp32
    sin: torch.Tensor,  # [P, d/2] fp32
    slots: torch.Tensor,  # [T] int64; < 0: a padding row, not written
    k_cache: torch.Tensor,  # [num_slots, nkv, d]
    v_cache: torch.Tensor,  # [num_slots, nkv, d]
    nq: int,
    q_norm: torch.Tensor | None = None,  # [d]: QK-norm of each q and k head before rotary (norm_reference)
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    T = qkv.shape[0]
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    c = torch.cat([cos[positions]] * 2, dim=-1).unsqueeze(1).to(qkv.dtype)  # [T, 1, d]
    s = torch.cat([sin[positions]] * 2, dim=-1).unsqueeze(1).to(qkv.dtype)
    qk = qkv[:, : (nq + nkv) * d].view(T, nq + nkv, d)
    if q_norm is not None:
        qk[:, :nq] = norm_reference(qk[:, :nq].reshape(T * nq, d), q_norm, eps).view(T, nq, d)
        qk[:, nq:] = norm_reference(qk[:, nq:].reshape(T * nkv, d), k_norm, eps).view(T, nkv, d)
    qk.copy_(rotate_reference(qk, c, s))
    k_new, v_new = qk[:, nq:], qkv[:, (nq + nkv) * d :].reshape(T, nkv, d)
    if T and bool((slots < 0).any()):  # padding rows (a negative slot) are rotated, never written
        keep = slots >= 0
        slots, k_new, v_new = slots[keep], k_new[keep], v_new[keep]
    # a cache of another dtype (the quantized decoder's bf16) holds each value rounded once
    k_cache.index_copy_(0, slots, k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v_new.to(v_cache.dtype))


def rotary_kv_write(qkv, positions, cos, sin, slots, k_cache, v_cache, nq: int, q_norm=None, k_norm=None,
                    eps: float = 0.0, num_threads: int | None = None) -> None:
    """The kernel of rotary_kv_write_reference (same arguments, all contiguous, bf16 qkv/caches;
    q_norm and k_norm both bf16 (Llama's norm) or both fp32 (Gemma's 1 + w)); every slot >= 0
    (padding rows of slot -1 are the replayed steps', on the Triton path only)."""
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and q_norm.dtype != k_norm.dtype):
        raise ValueError("rotary_kv_write: q_norm and k_norm come together, of one dtype")
    _lib().agentrt_rotary_kv_write_bf16(
        qkv.data_ptr(), qkv.shape[0], qkv.stride(0), nq, nkv, d, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(), int(q_norm is not None and q_norm.dtype == torch.float32), eps,
        num_threads or torch.get_num_threads(),
    )


def paged_attention_reference(
    q: torch.Tensor,  # [T, nq, d], rotary applied
    k_cache: torch.Tensor,  # [num_slots, nkv, d]
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,  # [B + 1] int64
    positions: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    scale: float,
    window: int | None = None,  # a sliding layer: a query at p sees p - window + 1 .. p
) -> torch.Tensor:  # [T, nq, d]
    nq, nkv = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(cu_q.numel() - 1):
        t0, t1 = int(cu_q[b]), int(cu_q[b + 1])
        pos = positions[t0:t1]
        ctx = int(pos.max()) + 1
        offs = torch.arange(ctx)
        slots = block_tables[b, offs // block_size] * block_size + offs % block_size
        k = k_cache[slots].to(q.dtype).repeat_interleave(nq // nkv, dim=1)  # [ctx, nq, d]
        v = v_cache[slots].to(q.dtype).repeat_interleave(nq // nkv, dim=1)
        scores = torch.matmul(q[t0:t1].transpose(0, 1), k.permute(1, 2, 0)).float() * scale  # [nq, n, ctx]
        hidden = offs.view(1, 1, ctx) > pos.view(1, -1, 1)
        if window:
            hidden |= offs.view(1, 1, ctx) <= pos.view(1, -1, 1) - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[t0:t1] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)  # [n, nq, d]
    return out


def paged_attention(
    q: torch.Tensor,  # [T, nq * d] or [T, nq, d]; rows may be strided (a view into qkv)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    nq: int,
    out: torch.Tensor | None = None,  # [T, nq * d] bf16
    num_threads: int | None = None,
    prefetch_rows: int = PREFETCH_ROWS,  # 0: no software prefetch (for the attention bench)
    window: int | None = None,  # a sliding layer's window (see paged_attention_reference)
) -> torch.Tensor:  # [T, nq * d]
    """The kernel of paged_attention_reference; needs head_dim % 16 == 0 and <= 256.

    Batch-invariant: a query's output is bit-identical whether it is computed alone (decode),
    beside its sequence's drafts (verification), in any prefill chunk or beside other sequences,
    because every query runs the same AMX reductions in the same order over 16-key chunks from
    position 0 (csrc/cpu_attention_bf16.c: attend_block)."""
    T = q.shape[0]
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    if d % 16 or d > 256 or nq % nkv:
        raise ValueError(f"paged_attention kernel: head_dim {d} must be a multiple of 16 up to 256, heads {nq} a multiple of {nkv}")
    if prefetch_rows < 0:
        raise ValueError(f"paged_attention kernel: prefetch_rows must be >= 0, got {prefetch_rows}")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention kernel: a sliding window must be positive, got {window}")
    if out is None:
        out = torch.empty(T, nq * d, dtype=q.dtype, device=q.device)
    _lib().agentrt_paged_attention_bf16(
        q.data_ptr(), q.stride(0), cu_q.numel() - 1, cu_q.data_ptr(), positions.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), block_size, k_cache.data_ptr(), v_cache.data_ptr(), nq, nkv, d, scale, window or 0,
        out.data_ptr(), out.stride(0), num_threads or torch.get_num_threads(), prefetch_rows,
    )
    return out
