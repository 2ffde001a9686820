"""Paged attention over a ragged batch in Triton (flash-attention style online softmax), with a
split-KV variant for long contexts; the reference is the CPU module's `paged_attention_reference`.

Ragged layout (the engine's AttentionMetadata, agentrt/kernels/paged_attention.py): sequence b owns
query rows cu_q[b]..cu_q[b+1] of the flat batch (a prefill chunk, one decode row, or the k+1 rows
of a verification run) and row b of `block_tables`; its context position l lives in cache slot
table[l // block_size] * block_size + l % block_size. A row at position p attends to positions
0..p of its own sequence.

One program takes a tile of BLOCK_Q query rows of one sequence and one KV head, with that head's
GROUP query heads packed into the tile's rows (row m = query BLOCK_Q-index m // GROUP_P, head
m % GROUP_P; GROUP_P is GROUP rounded up to a power of two, the extra rows masked), so a KV tile
is read once for its whole group and `tl.dot` gets the 16+ rows it needs even for one decode row.
The program walks the context in BLOCK_N-position tiles from position 0 up to its last row's
position, gathering each tile's slots through the block table.

Split-KV: with few query rows and a long context, (sequences x KV heads) programs leave most of
a GPU idle while each walks thousands of positions. The split variant gives each program one
slice of split_len positions and writes its unnormalised partial (running max, sum, accumulator)
in fp32; a second kernel combines the slices of each row. Which one runs is `choose_num_splits`.
"""
from __future__ import annotations

from agentrt.kernels import triton as _backend  # noqa: F401  (first: picks the interpreter before any @triton.jit)

import torch
import triton
import triton.language as tl

from agentrt.kernels.paged_attention import paged_attention_reference

__all__ = ["BLOCK_N", "choose_num_splits", "paged_attention", "paged_attention_reference"]

LOG2E = 1.4426950408889634
BLOCK_N = 32  # context positions per tile: >= 16 for tl.dot
MAX_TILE_ROWS = 64  # BLOCK_Q * GROUP_P at most: the accumulator is that many rows x head_dim fp32
# The split rule's numbers (reasoned, not yet timed on a GPU): an H100 has 132 SMs, so a grid
# under ~128 programs leaves SMs idle; a slice shorter than 256 positions costs more in the
# combine than it gains; more than 64 slices only grows the partial buffers.
SPLIT_TARGET_PROGRAMS = 128
SPLIT_MIN_LEN = 256
SPLIT_MAX = 64
SPLIT_MAX_QUERY_ROWS = 16  # decode and verification runs (k + 1 <= 16); prefill chunks fill the GPU unsplit


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    cu_q_ptr, pos_ptr, table_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
    num_rows, num_q_heads, q_tiles_per_seq, split_len, qk_scale,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = pid // q_tiles_per_seq
    q_begin = tl.load(cu_q_ptr + seq)
    q_end = tl.load(cu_q_ptr + seq + 1)
    m = tl.arange(0, BLOCK_Q * GROUP_P)
    rows = q_begin + (pid % q_tiles_per_seq) * BLOCK_Q + m // GROUP_P  # [M] flat query rows
    group_index = m % GROUP_P
    row_ok = (rows < q_end) & (group_index < GROUP)
    heads = kv_head * GROUP + group_index  # [M] query heads
    d = tl.arange(0, HEAD_DIM)
    # A masked row gets position -1: it sees nothing, and a tile past its sequence's rows walks no context.
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)  # [M]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [M, D]
    kv_end = tl.max(pos, axis=0) + 1
    kv_begin = 0
    if SPLIT:
        kv_begin = tl.program_id(2) * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)  # running max, in log2 units
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM], tl.float32)
    table_row = table_ptr + seq * stride_table
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block * BLOCK_SIZE + n % BLOCK_SIZE  # [N]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps max -inf; subtract 0 instead so no -inf - -inf appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # partials [num_splits, num_rows, num_q_heads(, D)], fp32; a slice past a row's position leaves (-inf, 0, 0)
        part = tl.program_id(2) * num_rows * num_q_heads + rows * num_q_heads + heads
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh, num_rows, num_splits,
    NUM_Q_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.arange(0, HEADS_P)
    h_ok = h < NUM_Q_HEADS
    d = tl.arange(0, HEAD_DIM)
    split_stride = num_rows * NUM_Q_HEADS
    base = row * NUM_Q_HEADS + h  # [H]
    m_max = tl.full([HEADS_P], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + s * split_stride + base, mask=h_ok, other=float("-inf")))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([HEADS_P], tl.float32)
    acc = tl.zeros([HEADS_P, HEAD_DIM], tl.float32)
    for s in range(num_splits):
        w = tl.math.exp2(tl.load(part_m_ptr + s * split_stride + base, mask=h_ok, other=float("-inf")) - m_safe)
        l_sum += w * tl.load(part_l_ptr + s * split_stride + base, mask=h_ok, other=0.0)
        part_acc = tl.load(part_acc_ptr + (s * split_stride + base)[:, None] * HEAD_DIM + d[None, :],
                           mask=h_ok[:, None], other=0.0)
        acc += w[:, None] * part_acc
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(out_ptr + row * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None])


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_context_len: int) -> int:
    """How many context slices each (query tile, KV head) program is split into; 1: no split.

    Split only decode and verification steps (at most SPLIT_MAX_QUERY_ROWS rows a sequence), whose
    unsplit grid of num_seqs x num_kv_heads programs is under SPLIT_TARGET_PROGRAMS, and only into
    slices of at least SPLIT_MIN_LEN positions: enough slices to fill the target, no more."""
    programs = num_seqs * num_kv_heads
    if max_query_len > SPLIT_MAX_QUERY_ROWS or programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    by_length = max_context_len // SPLIT_MIN_LEN
    return max(1, min(by_length, triton.cdiv(SPLIT_TARGET_PROGRAMS, programs), SPLIT_MAX))


def _check(q, k_cache, v_cache, cu_q, positions, block_tables, block_size, out) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q must be [T, nq, d] and both caches [num_slots, nkv, d], got "
                         f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    T, nq, d = q.shape
    nkv = k_cache.shape[1]
    if k_cache.shape[2] != d or nq % nkv:
        raise ValueError(f"paged_attention: q's {nq} heads of {d} must be a multiple of the caches' {nkv} heads of {k_cache.shape[2]}")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"paged_attention: head_dim {d} must be a power of two from 16 to 256")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention: q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("paged_attention: q and the caches need contiguous head vectors (stride 1 in the last dim)")
    if block_size < 1:
        raise ValueError(f"paged_attention: block_size must be >= 1, got {block_size}")
    for name, t in (("cu_q", cu_q), ("positions", positions), ("block_tables", block_tables)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention: {name} must be int32 or int64, got {t.dtype}")
    if positions.shape != (T,) or block_tables.dim() != 2 or cu_q.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"paged_attention: positions must be [T={T}], block_tables [B, max_blocks] and cu_q [B + 1]; got "
                         f"{tuple(positions.shape)}, {tuple(block_tables.shape)}, {tuple(cu_q.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_attention: block_tables rows must be contiguous")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"paged_attention: out must be {tuple(q.shape)} {q.dtype} with contiguous head vectors")


def paged_attention(
    q: torch.Tensor,  # [T, nq, d], rotary applied; rows may be strided (a view into qkv)
    k_cache: torch.Tensor,  # [num_slots, nkv, d], q's dtype
    v_cache: torch.Tensor,  # [num_slots, nkv, d]
    cu_q: torch.Tensor,  # [B + 1] int64: sequence b owns rows cu_q[b]..cu_q[b+1]
    positions: torch.Tensor,  # [T] int64: each row's absolute position
    block_tables: torch.Tensor,  # [B, max_blocks] int64: row b maps sequence b's blocks to cache blocks
    block_size: int,
    scale: float,
    max_query_len: int,  # most rows of one sequence (AttentionMetadata.q_max)
    max_context_len: int,  # longest context, max position + 1 (AttentionMetadata.l_max)
    out: torch.Tensor | None = None,  # [T, nq, d], q's dtype
    num_splits: int | None = None,  # None: choose_num_splits; 1: no split
) -> torch.Tensor:  # [T, nq, d]
    """Causal paged attention of each row over its own sequence's context positions 0..p (the
    module docstring has the layout); equals `paged_attention_reference(q, k_cache, v_cache, cu_q,
    positions, block_tables, block_size, scale)` up to fp32 summation order. Softmax and the
    accumulator are fp32; scores and P @ V use q's dtype for the dot inputs (IEEE fp32 dots for fp32)."""
    _check(q, k_cache, v_cache, cu_q, positions, block_tables, block_size, out)
    T, nq, d = q.shape
    nkv = k_cache.shape[1]
    B = block_tables.shape[0]
    if out is None:  # zeros: a row of no sequence (a replayed step's padding, past cu_q[-1]) is never written
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if T == 0 or B == 0:
        return out
    group = nq // nkv
    group_p = triton.next_power_of_2(group)
    if group_p > MAX_TILE_ROWS:
        raise ValueError(f"paged_attention: {group} query heads per KV head is more than a tile's {MAX_TILE_ROWS} rows")
    # enough query rows for tl.dot's 16, no more than the longest run needs or a tile holds
    block_q = max(16 // group_p, min(triton.next_power_of_2(max(max_query_len, 1)), MAX_TILE_ROWS // group_p))
    q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    if num_splits is None:
        num_splits = choose_num_splits(B, nkv, max_query_len, max_context_len)
    if num_splits < 1:
        raise ValueError(f"paged_attention: num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), BLOCK_N) * BLOCK_N  # whole tiles
    num_splits = triton.cdiv(max(max_context_len, 1), split_len)  # no slice starts past the longest context
    split = num_splits > 1
    if split:
        part_m = torch.empty(num_splits, T, nq, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_splits, T, nq, d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused: the SPLIT=False kernel never touches them
    _paged_attention_kernel[(B * q_tiles, nkv, num_splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, cu_q, positions, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        T, nq, q_tiles, split_len, scale * LOG2E,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, HEAD_DIM=d, BLOCK_SIZE=block_size,
        SPLIT=split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if split:
        _combine_splits_kernel[(T,)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), T, num_splits,
            NUM_Q_HEADS=nq, HEADS_P=triton.next_power_of_2(nq), HEAD_DIM=d,
        )
    return out
