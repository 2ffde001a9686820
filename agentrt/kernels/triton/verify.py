"""Exact speculative verification in one kernel per step, one program per sequence: the GPU
engine's spec.verify, with the same ragged layout, the same rule and the same uniforms.

The rule and the layout are spec/verify.py's (that module is the pure-torch reference; it sits
above kernels, so the tests compare with it): sequence i has k_i = cu[i+1] - cu[i] drafts (0 is
allowed) at draft_tokens[cu[i]:cu[i+1]] and k_i + 1 target rows from row cu[i] + i. A program
reads its drafts' p(x) and q(x) (q = 1 for point-mass drafts), stops at the first draft with
not u * q(x) < p(x) (fp32, as on the CPU), and draws the one more token from the residual
max(0, p - q) at that position (p with the draft zeroed for point masses; p itself when the
residual has no mass) or from the bonus row, by inverse CDF (inverse_cdf.py: the CPU's fp64
left-to-right cumsum rounded to fp32, and searchsorted's tie rule, so equal inputs and uniforms
give equal tokens, bit for bit). The residual is never written to memory.

* `verify_drafts`: spec.verify.verify_drafts.
* `verify_greedy`: spec.verify.verify_greedy (accept while the draft equals its row's argmax).
* `verify_coupled`: the engine's coupling of point-mass drafts at any temperature (each row's
  own inverse-CDF draw with its position's uniform, then verify_greedy), as engine.step.step_sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agentrt.errors import SpecError
from agentrt.kernels.triton.inverse_cdf import sample_row
from agentrt.kernels.triton.masked_sample import check_sampled_mass, masked_sample

_BLOCK_V = 1024


@dataclass(frozen=True)
class VerifyOutput:
    """spec.verify.VerifyResult's fields, as the kernels return them."""

    num_accepted: torch.Tensor  # [B] int64, accepted drafts per sequence
    output_tokens: torch.Tensor  # [B, max_k + 1] int64: accepted drafts, then the recovered/bonus token, -1 pad
    num_emitted: torch.Tensor  # [B] int64, num_accepted + 1


@triton.jit
def _sequence_drafts(cu_ptr, draft_ptr, BLOCK_K: tl.constexpr):
    """This program's sequence: (first draft, k, first target row, lanes j, j < k, drafts x_j)."""
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    k = tl.load(cu_ptr + seq + 1) - first
    j = tl.arange(0, BLOCK_K)
    live = j < k
    return first, k, first + seq, j, live, tl.load(draft_ptr + first + j, mask=live, other=0)


@triton.jit
def _verify_kernel(target_ptr, t_stride, draft_ptr, cu_ptr, q_ptr, q_stride, u_accept_ptr, u_sample_ptr,
                   out_ptr, out_stride, num_accepted_ptr, total_ptr, vocab,
                   HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    first, k, row0, j, live, x = _sequence_drafts(cu_ptr, draft_ptr, BLOCK_K)
    p_at = tl.load(target_ptr + (row0 + j).to(tl.int64) * t_stride + x, mask=live, other=0.0).to(tl.float32)
    u = tl.load(u_accept_ptr + first + j, mask=live, other=0.0)
    if HAS_Q:
        q_at = tl.load(q_ptr + (first + j).to(tl.int64) * q_stride + x, mask=live, other=0.0).to(tl.float32)
        accepted = u * q_at < p_at
    else:
        accepted = u < p_at  # u * 1 < p
    n = tl.min(tl.where(live & (accepted == 0), j, k), axis=0)  # the first rejection, or k
    out_row = out_ptr + seq.to(tl.int64) * out_stride
    tl.store(out_row + j, x.to(tl.int64), mask=j < n)
    rejected = n < k
    # A point-mass residual is p without the rejected draft; a bonus row zeroes nothing (-1).
    zero_token = -1
    if not HAS_Q:
        zero_token = tl.load(draft_ptr + first + n, mask=rejected, other=-1)
    token, total = sample_row(target_ptr + (row0 + n).to(tl.int64) * t_stride, q_ptr + (first + n).to(tl.int64) * q_stride,
                              rejected, zero_token, target_ptr, 0, False, vocab, tl.load(u_sample_ptr + seq),
                              HAS_Q, False, True, BLOCK_V)
    tl.store(out_row + n, token.to(tl.int64))
    tl.store(num_accepted_ptr + seq, n.to(tl.int64))
    tl.store(total_ptr + seq, total)


@triton.jit
def _verify_greedy_kernel(best_ptr, draft_ptr, cu_ptr, out_ptr, out_stride, num_accepted_ptr, BLOCK_K: tl.constexpr):
    seq = tl.program_id(0)
    first, k, row0, j, live, x = _sequence_drafts(cu_ptr, draft_ptr, BLOCK_K)
    best = tl.load(best_ptr + row0 + j, mask=live, other=0)
    n = tl.min(tl.where(live & (x != best), j, k), axis=0)  # the first mismatch, or k
    out_row = out_ptr + seq.to(tl.int64) * out_stride
    tl.store(out_row + j, x.to(tl.int64), mask=j < n)
    tl.store(out_row + n, tl.load(best_ptr + row0 + n).to(tl.int64))
    tl.store(num_accepted_ptr + seq, n.to(tl.int64))


def _layout(draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor, num_rows: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check the ragged layout; (drafts int32, cu int32 on device, max k)."""
    if cu_num_draft.dim() != 1 or cu_num_draft.numel() < 1 or cu_num_draft.is_floating_point():
        raise SpecError(f"cu_num_draft must be an int tensor [B+1], got {tuple(cu_num_draft.shape)} {cu_num_draft.dtype}")
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
        raise SpecError(f"draft_tokens must be an int tensor [sum k_i], got {tuple(draft_tokens.shape)} {draft_tokens.dtype}")
    cu = cu_num_draft.tolist()
    num_seqs, num_drafts = len(cu) - 1, draft_tokens.numel()
    if cu[0] != 0 or cu[-1] != num_drafts or any(b < a for a, b in zip(cu, cu[1:])):
        raise SpecError(f"cu_num_draft must rise from 0 to len(draft_tokens)={num_drafts}, got {cu}")
    if num_rows != num_drafts + num_seqs:
        raise SpecError(f"the target has {num_rows} rows, expected sum(k_i+1) = {num_drafts + num_seqs}")
    max_k = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    return (draft_tokens.to(device=device, dtype=torch.int32).contiguous(),
            torch.tensor(cu, dtype=torch.int32, device=device), max_k)


def _outputs(num_seqs: int, max_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((num_seqs, max_k + 1), -1, dtype=torch.int64, device=device),
            torch.empty(num_seqs, dtype=torch.int64, device=device))


def verify_drafts(target_probs: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor,
                  draft_probs: torch.Tensor | None, uniform_accept: torch.Tensor, uniform_sample: torch.Tensor
                  ) -> VerifyOutput:
    """spec.verify.verify_drafts in one kernel launch: target_probs [sum(k_i+1), V] processed p;
    draft_tokens [sum k_i]; cu_num_draft [B+1]; draft_probs [sum k_i, V] processed q, or None
    for point-mass drafts; uniform_accept [sum k_i] and uniform_sample [B] in [0, 1)."""
    if target_probs.dim() != 2 or not target_probs.is_floating_point():
        raise SpecError(f"target_probs must be a float tensor [sum(k_i+1), V], got {tuple(target_probs.shape)}")
    device, vocab = target_probs.device, target_probs.shape[1]
    drafts, cu, max_k = _layout(draft_tokens, cu_num_draft, target_probs.shape[0], device)
    num_seqs, num_drafts = cu.numel() - 1, drafts.numel()
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab):
        raise SpecError(f"draft_probs must have shape [{num_drafts}, {vocab}], got {tuple(draft_probs.shape)}")
    if uniform_accept.shape != (num_drafts,) or uniform_sample.shape != (num_seqs,):
        raise SpecError(f"uniform_accept and uniform_sample must have shapes [{num_drafts}] and [{num_seqs}], got "
                        f"{tuple(uniform_accept.shape)} and {tuple(uniform_sample.shape)}")
    if num_drafts and not (0 <= int(drafts.min()) and int(drafts.max()) < vocab):
        raise SpecError(f"draft_tokens must lie in [0, {vocab}), got min {int(drafts.min())} max {int(drafts.max())}")
    target_probs = target_probs if target_probs.stride(1) == 1 else target_probs.contiguous()
    has_q = draft_probs is not None and num_drafts > 0  # without drafts every row is a bonus row: p as is
    q = draft_probs.to(device).contiguous() if has_q else target_probs
    output_tokens, num_accepted = _outputs(num_seqs, max_k, device)
    total = torch.empty(num_seqs, dtype=torch.float32, device=device)
    if num_seqs:
        _verify_kernel[(num_seqs,)](
            target_probs, target_probs.stride(0), drafts, cu, q, q.stride(0),
            uniform_accept.to(device=device, dtype=torch.float32).contiguous(),
            uniform_sample.to(device=device, dtype=torch.float32).contiguous(),
            output_tokens, output_tokens.stride(0), num_accepted, total, vocab,
            HAS_Q=has_q, BLOCK_K=triton.next_power_of_2(max(max_k, 1)), BLOCK_V=_BLOCK_V,
            enable_fp_fusion=False)  # each product rounded on its own, as on the CPU
    check_sampled_mass(total)
    return VerifyOutput(num_accepted=num_accepted, output_tokens=output_tokens, num_emitted=num_accepted + 1)


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor) -> VerifyOutput:
    """spec.verify.verify_greedy: accept drafts while each equals its row's token in
    target_argmax [sum(k_i+1)] int, then emit the row's token at the first mismatch (or the bonus)."""
    if target_argmax.dim() != 1 or target_argmax.is_floating_point():
        raise SpecError(f"target_argmax must be an int tensor [sum(k_i+1)], got {tuple(target_argmax.shape)} {target_argmax.dtype}")
    device = target_argmax.device
    drafts, cu, max_k = _layout(draft_tokens, cu_num_draft, target_argmax.numel(), device)
    num_seqs = cu.numel() - 1
    output_tokens, num_accepted = _outputs(num_seqs, max_k, device)
    if num_seqs:
        _verify_greedy_kernel[(num_seqs,)](target_argmax.contiguous(), drafts, cu, output_tokens, output_tokens.stride(0),
                                           num_accepted, BLOCK_K=triton.next_power_of_2(max(max_k, 1)))
    return VerifyOutput(num_accepted=num_accepted, output_tokens=output_tokens, num_emitted=num_accepted + 1)


def verify_coupled(target_probs: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor,
                   uniform_rows: torch.Tensor) -> VerifyOutput:
    """Point-mass drafts verified by coupling: each target row's own inverse-CDF token with its
    uniform (uniform_rows [sum(k_i+1)], the uniforms of the rows' output positions), then
    verify_greedy on those tokens. The tokens equal plain sampling with the same uniforms."""
    return verify_greedy(masked_sample(target_probs, uniform_rows), draft_tokens, cu_num_draft)
