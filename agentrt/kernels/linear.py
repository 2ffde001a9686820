"""bf16 linear layers with a fused input rms-norm and output epilogue: the AMX kernel
(csrc/cpu_linear_bf16.c), its pure-PyTorch reference, and the dispatcher.

    y = epilogue(rms_norm(x) @ W.T + bias)
    epilogue: none | residual (y = residual + out) | silu-gated (W = [gate; up], y = silu(gate) * up)

The reference spells out the bf16 rounding of the model's PyTorch path (one rounding per op);
the kernel reproduces it, so the two differ only in dot-product summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.kernels.cpu_build import cpu_kernels

EPI_NONE, EPI_RESIDUAL, EPI_SILU_MUL = 0, 1, 2


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] (or gated [2N, K]) bf16 weight in the kernel's layout: [units][K32/2][16][2],
    16 output rows per unit, K zero-padded to a multiple of 32. Gated: units alternate gate/up."""

    data: torch.Tensor  # [units, K32 // 2, 16, 2] bf16
    out_features: int  # N (for a gated weight, the gated width)
    in_features: int  # K
    gated: bool

    @property
    def units(self) -> int:
        return self.data.shape[0]


def _units(w: torch.Tensor, k32: int, groups: int = 1) -> torch.Tensor:
    """[groups * n, K] -> [n16 // 16, groups, K32 / 2, 16, 2]: the weight's 16-row units, the
    groups' units side by side. One copy when no padding is needed (the usual case)."""
    n, k = w.shape[0] // groups, w.shape[1]
    n16 = (n + 15) // 16 * 16
    if n16 != n or k32 != k:
        padded = w.new_zeros(groups, n16, k32)
        padded[:, :n, :k] = w.view(groups, n, k)
        w = padded
    return w.view(groups, n16 // 16, 16, k32 // 2, 2).permute(1, 0, 3, 2, 4).contiguous()


def pack_weight(w: torch.Tensor, gated: bool = False) -> PackedWeight:
    """w [N, K] bf16; gated: w is [gate; up] stacked ([2I, K]) and the layer outputs silu(gate) * up."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"pack_weight wants a 2-D bf16 weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if gated and n % 2:
        raise ValueError(f"a gated weight stacks gate and up: its rows ({n}) must be even")
    k32 = (k + 31) // 32 * 32
    groups = 2 if gated else 1  # gated: unit 2i holds gate rows, 2i+1 the matching up rows
    lib = cpu_kernels()
    if lib is None or w.stride(1) != 1:
        units = _units(w, k32, groups)
    else:  # the same layout, written by a C loop: torch's strided copy of 4-byte runs is slow
        units = torch.empty((n // groups + 15) // 16 * groups, k32 // 2, 16, 2, dtype=w.dtype)
        lib.agentrt_pack_weight_bf16(w.data_ptr(), w.stride(0), n // groups, k, groups, units.data_ptr(),
                                     torch.get_num_threads())
    return PackedWeight(units.view(-1, k32 // 2, 16, 2), n // groups, k, gated)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Accumulate in fp32 like the reference implementation; cast back before the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear_reference(
    x: torch.Tensor,  # [M, K] bf16
    weight: torch.Tensor,  # [N, K] (gated: [2N, K]) bf16
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    y = (x.float() @ weight.float().T + (bias.float() if bias is not None else 0.0)).to(x.dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


def linear(
    x: torch.Tensor,  # [M, K] bf16, rows may be strided
    w: PackedWeight,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,  # [M, N]; may be `out` itself (updated in place)
    out: torch.Tensor | None = None,  # [M, N], row stride free, last dim contiguous
    out_dtype: torch.dtype = torch.bfloat16,  # bf16, or float32 holding bf16-rounded values
    num_threads: int | None = None,
) -> torch.Tensor:  # [M, N]
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("the AMX linear kernel is not available on this machine (see agentrt.kernels.cpu_build)")
    M, K = x.shape
    if K != w.in_features or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"linear: x must be [M, {w.in_features}] bf16 with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    if out is None:
        out = torch.empty(M, w.out_features, dtype=out_dtype, device=x.device)
    if out.stride(-1) != 1 or out.shape != (M, w.out_features) or out.dtype != out_dtype:
        raise ValueError(f"linear: out must be [{M}, {w.out_features}] {out_dtype}, got {out.dtype} {tuple(out.shape)}")
    epilogue = EPI_SILU_MUL if w.gated else EPI_NONE
    if residual is not None:
        if w.gated or out_dtype != torch.bfloat16 or residual.stride(-1) != 1:
            raise ValueError("linear: a residual needs an ungated weight, bf16 output and contiguous rows")
        epilogue = EPI_RESIDUAL
    lib.agentrt_linear_bf16(
        w.data.data_ptr(), w.units, w.out_features, K, x.data_ptr(), M, x.stride(0),
        None if norm_weight is None else norm_weight.data_ptr(), eps,
        None if bias is None else bias.data_ptr(), epilogue,
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        out.data_ptr(), out.stride(0), int(out_dtype == torch.float32),
        num_threads or torch.get_num_threads(),
    )
    return out
