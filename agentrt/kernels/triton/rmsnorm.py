"""RMSNorm fused with the residual add, one program per token row: the decoder's
`h = h + sublayer(x); x = rms_norm(h, w, eps)` in one pass over the row.

Same arithmetic as the model's norm (kernels.linear.rms_norm_reference): the residual add in the
model dtype, the mean of squares and the scaling in fp32, the cast back to the model dtype, then
the weight product (fp32, rounded once to the promoted dtype). The residual is bit for bit the
reference's; the normed row differs only by the order of the fp32 sum and rsqrt's last bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.kernels.linear import rms_norm_reference


def rmsnorm_residual_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); without a residual, (rms_norm(x), x)."""
    residual = x if residual is None else residual + x
    return rms_norm_reference(residual, weight, eps), residual


@triton.jit
def _rmsnorm_residual_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, res_out_ptr,
                             res_out_stride, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < hidden
    h = tl.load(x_ptr + row * x_stride + offs, mask=live, other=0.0)
    if HAS_RESIDUAL:
        h = h + tl.load(res_ptr + row * res_stride + offs, mask=live, other=0.0)  # in the model dtype
        tl.store(res_out_ptr + row * res_out_stride + offs, h, mask=live)
    hf = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    normed = (hf * inv_rms).to(h.dtype)
    w = tl.load(w_ptr + offs, mask=live, other=0.0)
    tl.store(out_ptr + row * out_stride + offs,
             (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=live)


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (a sublayer's output), residual [T, H] or None, weight [H] -> (normed [T, H] in
    weight * x's promoted dtype, the new residual [T, H]: residual + x, or x itself without one)."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm_residual: x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rmsnorm_residual: residual must match x {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = x if residual is None else torch.empty_like(x)
    res = x if residual is None else (residual if residual.stride(-1) == 1 else residual.contiguous())
    if x.shape[0]:
        _rmsnorm_residual_kernel[(x.shape[0],)](x, x.stride(0), res, res.stride(0), weight.contiguous(), out, out.stride(0),
                                                new_residual, new_residual.stride(0), x.shape[1], eps,
                                                HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out, new_residual
