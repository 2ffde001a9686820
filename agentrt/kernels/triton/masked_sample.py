"""Grammar-masked greedy and sampled tokens, reading xgrammar's packed int32 bitmask in the kernel.

A row obeys bitmask row mask_rows[i] (bit j of word j // 32 allows token j; tokens past the
mask's words are not allowed), or no mask when mask_rows[i] == -1; no masked copy of the
vocabulary is ever written.

* `masked_argmax`: the first maximal allowed logit, a NaN above everything (torch.argmax's
  order), all-disallowed rows giving 0: exactly kernels.argmax.argmax_reference, the CPU path's
  reference, on any float dtype.
* `masked_sample`: the inverse-CDF draw with the passed-in uniform from the processed
  probabilities with disallowed tokens at 0: exactly decoding.sampling.sample_from_probs on the
  masked probabilities, bit for bit (inverse_cdf.py says how). The engine's CPU path masks the
  logits before process_logits, so its probabilities already hold those zeros and the mask is a
  no-op; for rows processed from unmasked logits (temperature only) the draw is from the same
  distribution. (The CPU sampler lives in spec, above kernels, so the tests compare with it.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.errors import SpecError
from agentrt.kernels.triton.inverse_cdf import allowed_block, sample_row

_BLOCK_V = 1024
_BIG = tl.constexpr(2**31 - 1)  # past any column: a kernel global must be a constexpr


@triton.jit
def _masked_argmax_kernel(x_ptr, x_stride, mask_ptr, mask_stride, n_words, mask_rows_ptr, out_ptr, vocab,
                          HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    mask_row, row_masked = mask_ptr, False
    if HAS_MASK:
        mr = tl.load(mask_rows_ptr + row)
        row_masked = mr >= 0
        mask_row = mask_ptr + tl.maximum(mr, 0).to(tl.int64) * mask_stride
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)  # an all -inf row's first maximum
    first_nan = tl.full([], _BIG, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        in_range = offs < vocab
        x = tl.load(x_row + offs, mask=in_range, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            x = tl.where(allowed_block(mask_row, offs, n_words, row_masked), x, float("-inf"))
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & in_range, offs, _BIG), axis=0))
        x = tl.where(is_nan, float("-inf"), x)
        block_best = tl.max(x, axis=0)
        block_idx = tl.min(tl.where((x == block_best) & in_range, offs, _BIG), axis=0)
        better = block_best > best  # strictly: an earlier block keeps a tie
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, tl.where(first_nan < _BIG, first_nan, best_idx).to(tl.int64))


@triton.jit
def _masked_sample_kernel(p_ptr, p_stride, mask_ptr, mask_stride, n_words, mask_rows_ptr, uniform_ptr, out_ptr,
                          total_ptr, vocab, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    mask_row, row_masked = mask_ptr, False
    if HAS_MASK:
        mr = tl.load(mask_rows_ptr + row)
        row_masked = mr >= 0
        mask_row = mask_ptr + tl.maximum(mr, 0).to(tl.int64) * mask_stride
    token, total = sample_row(p_ptr + row.to(tl.int64) * p_stride, p_ptr, False, -1, mask_row, n_words, row_masked,
                              vocab, tl.load(uniform_ptr + row), False, HAS_MASK, False, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(total_ptr + row, total)


def _mask_args(x: torch.Tensor, mask: torch.Tensor | None, mask_rows: torch.Tensor | None
               ) -> tuple[torch.Tensor, int, int, torch.Tensor]:
    """(mask, row stride, words, mask_rows) for the kernels; placeholders when there is no mask."""
    if mask is None:
        return x, 0, 0, x
    if mask.dim() != 2 or mask.dtype != torch.int32:
        raise SpecError(f"mask must be an int32 bitmask [rows, words], got {tuple(mask.shape)} {mask.dtype}")
    if mask_rows is None:
        if mask.shape[0] != x.shape[0]:
            raise SpecError(f"mask has {mask.shape[0]} rows for {x.shape[0]} rows; pass mask_rows to map them")
        mask_rows = torch.arange(x.shape[0], device=x.device)
    if mask_rows.shape != (x.shape[0],) or (x.shape[0] and int(mask_rows.max()) >= mask.shape[0]):
        raise SpecError(f"mask_rows must be [{x.shape[0]}] indices into the {mask.shape[0]} mask rows (-1: none)")
    mask = mask.to(x.device).contiguous()
    return mask, mask.stride(0), mask.shape[1], mask_rows.to(device=x.device, dtype=torch.int32).contiguous()


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or not x.is_floating_point() or x.shape[1] == 0:
        raise SpecError(f"{name} must be a float tensor [N, V] with V > 0, got {tuple(x.shape)} {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def masked_argmax(logits: torch.Tensor, mask: torch.Tensor | None = None,
                  mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of logits [N, V], the first maximal token its mask allows: [N] int64.
    mask [R, words] int32; mask_rows [N] (default row i obeys mask row i; -1: unmasked)."""
    logits = _rows(logits, "logits")
    mask_t, mask_stride, n_words, rows_t = _mask_args(logits, mask, mask_rows)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        _masked_argmax_kernel[(logits.shape[0],)](logits, logits.stride(0), mask_t, mask_stride, n_words, rows_t, out,
                                                 logits.shape[1], HAS_MASK=mask is not None, BLOCK=_BLOCK_V)
    return out


def masked_sample(probs: torch.Tensor, uniform: torch.Tensor, mask: torch.Tensor | None = None,
                  mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of probs [N, V] (non-negative, any total), the inverse-CDF token for uniform [N]
    in [0, 1) among the tokens its mask allows: [N] int64. Rows whose allowed tokens have no
    positive finite mass raise SpecError, as the CPU sampler does."""
    probs = _rows(probs, "probs")
    if uniform.shape != (probs.shape[0],):
        raise SpecError(f"uniform must have shape [{probs.shape[0]}], got {tuple(uniform.shape)}")
    mask_t, mask_stride, n_words, rows_t = _mask_args(probs, mask, mask_rows)
    n = probs.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=probs.device)
    total = torch.empty(n, dtype=torch.float32, device=probs.device)
    if n:
        _masked_sample_kernel[(n,)](probs, probs.stride(0), mask_t, mask_stride, n_words, rows_t,
                                    uniform.to(device=probs.device, dtype=torch.float32).contiguous(), out, total,
                                    probs.shape[1], HAS_MASK=mask is not None, BLOCK=_BLOCK_V,
                                    enable_fp_fusion=False)  # each product rounded on its own, as on the CPU
    check_sampled_mass(total)
    return out


def check_sampled_mass(total: torch.Tensor) -> None:
    """Raise SpecError naming the rows whose sampled distribution had no positive finite mass."""
    usable = (total > 0) & torch.isfinite(total)
    if not bool(usable.all()):
        raise SpecError(f"probs rows {(~usable).nonzero().flatten().tolist()} have no positive finite mass to sample from")
