"""Device helpers shared by the sampling kernels: a token bitmask read in place, and inverse-CDF
sampling of one vocabulary row, bit for bit as the engine's CPU sampler does it.

The CPU sampler (decoding.sampling.sample_from_cdf over probs.float().cumsum(-1)) takes the token
i with cdf[i-1] <= u * total < cdf[i], clamped to the last token that adds mass. PyTorch's CPU
cumsum of fp32 accumulates left to right in fp64 and rounds each prefix to fp32, so that is what
`sample_row` computes: each vocabulary block is scanned in fp64 with the running fp64 sum folded
into its first element (carry + x0, then + x1, ... exactly PyTorch's order under Triton's
interpreter, whose scan is numpy's sequential cumsum), and the prefixes are rounded to fp32.
The token is then found without a search: searchsorted(cdf, u * total, right=True) over a
non-decreasing cdf is the number of entries <= u * total, and the clamp is the number of entries
< total; both are counts, so zero-probability tokens (equal neighbouring cdf values: ties) are
skipped the same way, and the result does not depend on the block size. On a GPU the in-block
scan is a tree of fp64 adds instead, which can differ from the sequential sum in fp64's last bit
and so, very rarely, move an fp32 prefix by one ulp.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def allowed_block(mask_row_ptr, offs, n_words, row_masked):
    """Which of the columns `offs` the row's packed int32 bitmask allows (bit j of word j // 32;
    columns past the mask's words are not allowed); every column when `row_masked` is false."""
    word = offs // 32
    # One comparison against a bound rather than `& row_masked`: the interpreter's masked load
    # rejects a vector mask combined with a scalar one.
    bits = tl.load(mask_row_ptr + word, mask=word < tl.where(row_masked, n_words, 0), other=0)
    return (((bits >> (offs % 32)) & 1) != 0) | (row_masked == 0)


@triton.jit
def _dist_block(p_row_ptr, q_row_ptr, offs, vocab, sub_q, zero_token, mask_row_ptr, n_words, row_masked,
                HAS_Q: tl.constexpr, HAS_MASK: tl.constexpr):
    """One block of (p, the distribution sampled): max(0, p - q) when HAS_Q (q taken as 0 unless
    sub_q), with column zero_token set to 0 and, when HAS_MASK, disallowed columns set to 0."""
    p = tl.load(p_row_ptr + offs, mask=offs < vocab, other=0.0).to(tl.float32)
    dist = p
    if HAS_Q:
        q = tl.load(q_row_ptr + offs, mask=offs < tl.where(sub_q, vocab, 0), other=0.0).to(tl.float32)
        dist = tl.maximum(p - q, 0.0)
    dist = tl.where(offs == zero_token, 0.0, dist)
    if HAS_MASK:
        dist = tl.where(allowed_block(mask_row_ptr, offs, n_words, row_masked), dist, 0.0)
    return p, dist


@triton.jit
def _scan_block(values, carry, lanes, BLOCK: tl.constexpr):
    """fp64 prefix sums of one block continuing `carry`, and the new carry (the last prefix)."""
    x = values.to(tl.float64)
    x = tl.where(lanes == 0, x + carry, x)
    prefix = tl.cumsum(x, axis=0)
    return prefix, tl.sum(tl.where(lanes == BLOCK - 1, prefix, 0.0), axis=0)


@triton.jit
def sample_row(p_row_ptr, q_row_ptr, sub_q, zero_token, mask_row_ptr, n_words, row_masked, vocab, uniform,
               HAS_Q: tl.constexpr, HAS_MASK: tl.constexpr, FALLBACK_TO_P: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse-CDF draw from one row's distribution (see `_dist_block`) with `uniform`.

    With FALLBACK_TO_P, a distribution without positive mass (the residual of p == q) is replaced
    by p itself, as spec.verify does. Returns (token, total): total is the fp32 mass sampled from,
    which the caller checks (> 0 and finite) to report rows that could not be sampled."""
    lanes = tl.arange(0, BLOCK)
    carry = tl.full([], 0.0, tl.float64)
    carry_p = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab, BLOCK):  # the totals first: whether to fall back, and u's target
        p, dist = _dist_block(p_row_ptr, q_row_ptr, start + lanes, vocab, sub_q, zero_token, mask_row_ptr, n_words,
                              row_masked, HAS_Q, HAS_MASK)
        _, carry = _scan_block(dist, carry, lanes, BLOCK)
        if FALLBACK_TO_P:
            _, carry_p = _scan_block(p, carry_p, lanes, BLOCK)
    total = carry.to(tl.float32)
    use_p = (total > 0) == 0  # also when the total is NaN, as `~(cdf[:, -1] > 0)`
    if FALLBACK_TO_P:
        total = tl.where(use_p, carry_p.to(tl.float32), total)
    target = tl.minimum(tl.maximum(uniform, 0.0), 1.0) * total
    at_or_below = tl.full([], 0, tl.int32)
    below_total = tl.full([], 0, tl.int32)
    carry = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        in_range = offs < vocab
        p, dist = _dist_block(p_row_ptr, q_row_ptr, offs, vocab, sub_q, zero_token, mask_row_ptr, n_words,
                              row_masked, HAS_Q, HAS_MASK)
        if FALLBACK_TO_P:
            dist = tl.where(use_p, p, dist)
        prefix, carry = _scan_block(dist, carry, lanes, BLOCK)
        cdf = prefix.to(tl.float32)
        at_or_below += tl.sum(((cdf <= target) & in_range).to(tl.int32), axis=0)
        below_total += tl.sum(((cdf < total) & in_range).to(tl.int32), axis=0)
    return tl.minimum(at_or_below, below_total), total
