"""The Triton paged attention (run by Triton's interpreter where there is no GPU) against the
pure-torch reference, on ragged batches that mix prefill chunks, decode rows and verification
runs of k + 1 rows, with scattered block tables.

Tolerances: fp32 1e-5 (both sides compute in fp32; only the summation order differs: the
kernel's online softmax over 32-position tiles against one softmax). fp16 2e-3 absolute and
relative: the reference rounds the scores q.k (|q.k| ~ 8 here, half an fp16 ulp 4e-3, x scale
1/8 or 1/11) and its probabilities to fp16, the kernel keeps scores in fp32 and rounds only the
probabilities fed to P @ V and the output; both are within a few 1e-4 of exact for outputs of
size ~1.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from agentrt.kernels.triton.paged_attention import (
    SPLIT_MIN_LEN,
    SPLIT_TARGET_PROGRAMS,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@dataclass(frozen=True)
class RaggedBatch:
    q: torch.Tensor  # [T, nq, d], a strided view into a wider qkv-like buffer
    k_cache: torch.Tensor  # [num_slots, nkv, d]
    v_cache: torch.Tensor
    cu_q: torch.Tensor  # [B + 1]
    positions: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max_blocks]
    block_size: int
    max_query_len: int
    max_context_len: int

    def reference(self, scale: float) -> torch.Tensor:
        return paged_attention_reference(self.q, self.k_cache, self.v_cache, self.cu_q, self.positions,
                                         self.block_tables, self.block_size, scale)

    def kernel(self, scale: float, **kwargs) -> torch.Tensor:
        return paged_attention(self.q, self.k_cache, self.v_cache, self.cu_q, self.positions, self.block_tables,
                               self.block_size, scale, self.max_query_len, self.max_context_len, **kwargs)


def ragged_batch(runs: list[tuple[int, int]], nq: int, nkv: int, d: int, block_size: int, dtype: torch.dtype,
                 seed: int) -> RaggedBatch:
    """runs[b] = (new rows, context length after them): sequence b's rows sit at the last
    positions of its context. Blocks come from a shuffled pool, so tables are scattered and a
    sequence's blocks are neither contiguous nor in order; unused table entries point at block 0."""
    g = torch.Generator().manual_seed(seed)
    blocks_of = [-(-ctx // block_size) for _, ctx in runs]
    pool = torch.randperm(sum(blocks_of) + 3, generator=g)  # 3 blocks nobody owns
    tables = torch.zeros(len(runs), max(blocks_of), dtype=torch.long)
    used = 0
    for b, n in enumerate(blocks_of):
        tables[b, :n] = pool[used:used + n]
        used += n
    num_slots = (sum(blocks_of) + 3) * block_size
    k_cache = torch.randn(num_slots, nkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, nkv, d, generator=g).to(dtype)
    positions = torch.cat([torch.arange(ctx - n, ctx) for n, ctx in runs])
    cu_q = torch.tensor([0] + [n for n, _ in runs]).cumsum(0)
    T = positions.numel()
    qkv = torch.randn(T, (nq + 2 * nkv) * d, generator=g).to(dtype)
    q = qkv[:, : nq * d].view(T, nq, d)
    return RaggedBatch(q, k_cache, v_cache, cu_q, positions, tables, block_size,
                       max(n for n, _ in runs), max(ctx for _, ctx in runs))


def mixed_runs(k: int) -> list[tuple[int, int]]:
    """A first prefill chunk of odd length, a later chunk whose rows cross block boundaries, a
    decode row, a verification run of k + 1 rows, another decode row right after a block edge."""
    return [(21, 21), (13, 50), (1, 33), (k + 1, 40 + k), (1, 65)]


@pytest.mark.parametrize("nq,nkv,d,block_size,dtype,k", [
    (9, 3, 64, 16, torch.float32, 0),
    (9, 3, 64, 32, torch.float16, 15),
    (32, 8, 128, 16, torch.float16, 4),
    (32, 8, 128, 32, torch.float32, 9),
])
def test_paged_attention_matches_reference_on_mixed_ragged_batches(nq, nkv, d, block_size, dtype, k):
    batch = ragged_batch(mixed_runs(k), nq, nkv, d, block_size, dtype, seed=nq + d + k)
    scale = d**-0.5
    out = batch.kernel(scale, num_splits=1)
    assert out.shape == batch.q.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, batch.reference(scale), atol=tol, rtol=tol)


def test_paged_attention_writes_into_a_given_out_and_handles_one_sequence():
    batch = ragged_batch([(1, 17)], 9, 3, 64, 16, torch.float32, seed=3)
    out = torch.full_like(batch.q, float("nan"))
    result = batch.kernel(0.125, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, batch.reference(0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nq,nkv,d,block_size,dtype", [(9, 3, 64, 16, torch.float32), (32, 8, 128, 32, torch.float16)])
def test_split_kv_equals_unsplit(nq, nkv, d, block_size, dtype):
    """Decode and verification rows over contexts of several slices, beside a short sequence whose
    every position falls in the first slice (its later slices contribute nothing)."""
    runs = [(1, 150), (4, 97), (1, 9), (16, 130)]
    batch = ragged_batch(runs, nq, nkv, d, block_size, dtype, seed=7)
    scale = d**-0.5
    unsplit = batch.kernel(scale, num_splits=1)
    tol = TOLERANCE[dtype]
    # 3 slices of 64 positions: the short sequence's last two and the 97-long one's last are empty
    torch.testing.assert_close(batch.kernel(scale, num_splits=3), unsplit, atol=tol, rtol=tol)
    torch.testing.assert_close(unsplit, batch.reference(scale), atol=tol, rtol=tol)


def test_the_split_rule_splits_only_few_rows_over_long_contexts():
    long = 8 * SPLIT_MIN_LEN
    decode_splits = choose_num_splits(num_seqs=2, num_kv_heads=3, max_query_len=1, max_context_len=long)
    assert decode_splits == 8  # one slice per SPLIT_MIN_LEN positions, under the program target
    assert choose_num_splits(2, 3, 16, long) == 8  # a verification run of k + 1 = 16 rows
    assert choose_num_splits(2, 3, 17, long) == 1  # a prefill chunk
    assert choose_num_splits(2, 3, 1, SPLIT_MIN_LEN) == 1  # a short context
    assert choose_num_splits(SPLIT_TARGET_PROGRAMS, 1, 1, long) == 1  # the unsplit grid already fills the GPU
    assert choose_num_splits(16, 4, 1, 100 * SPLIT_MIN_LEN) == 2  # enough slices to reach the target, no more


def test_paged_attention_picks_the_split_kernel_by_the_rule_and_stays_exact():
    runs = [(1, 2 * SPLIT_MIN_LEN + 5)]
    batch = ragged_batch(runs, 9, 3, 64, 16, torch.float32, seed=11)
    assert choose_num_splits(1, 3, 1, batch.max_context_len) == 2
    torch.testing.assert_close(batch.kernel(0.125), batch.reference(0.125), atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_what_is_wrong():
    batch = ragged_batch([(2, 20)], 8, 4, 64, 16, torch.float32, seed=1)
    args = (batch.cu_q, batch.positions, batch.block_tables, 16, 0.125, 2, 20)
    with pytest.raises(ValueError, match="multiple of the caches' 3 heads"):
        paged_attention(batch.q, batch.k_cache[:, :3], batch.v_cache[:, :3], *args)
    with pytest.raises(ValueError, match="head_dim 48"):
        paged_attention(batch.q[..., :48], batch.k_cache[..., :48], batch.v_cache[..., :48], *args)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(batch.q.half(), batch.k_cache, batch.v_cache, *args)
    with pytest.raises(ValueError, match="positions must be"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.cu_q, batch.positions[:1], *args[2:])
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, *args, num_splits=0)
