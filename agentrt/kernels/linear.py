"""bf16 linear layers with a fused input rms-norm and output epilogue: the AMX kernel
(csrc/cpu_linear_bf16.c), its pure-PyTorch reference, and the dispatcher.

    y = epilogue(rms_norm(x) @ W.T + bias)
    epilogue: none | residual (y = residual + out) | gated (W = [gate; up], y = act(gate) * up,
              act silu (SwiGLU) or gelu_tanh (GeGLU))
    rms_norm: Llama's with a bf16 weight, Gemma's with an fp32 (1 + weight) (gemma_rms_norm_reference)

The reference spells out the bf16 rounding of the model's PyTorch path (one rounding per op);
the kernel reproduces it, so the two differ only in dot-product summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.kernels.cpu_build import cpu_kernels

EPI_NONE, EPI_RESIDUAL, EPI_SILU_MUL, EPI_GELU_MUL = 0, 1, 2, 3
_GATES = {"silu": EPI_SILU_MUL, "gelu_tanh": EPI_GELU_MUL}


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


def pack_weight(w: torch.Tensor | list[torch.Tensor], gated: bool = False) -> PackedWeight:
    """w [N, K] bf16, or its row blocks [w1, w2, ...] (e.g. q, k, v: packed without stacking them
    first). gated: the rows are [gate; up] (or the blocks are [gate, up]) and the layer outputs
    silu(gate) * up."""
    parts = list(w) if isinstance(w, (list, tuple)) else [w]
    if any(p.dtype != torch.bfloat16 or p.dim() != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"pack_weight wants 2-D bf16 weights of one width, got {[(p.dtype, tuple(p.shape)) for p in parts]}")
    if gated and len(parts) == 1:
        if parts[0].shape[0] % 2:
            raise ValueError(f"a gated weight stacks gate and up: its rows ({parts[0].shape[0]}) must be even")
        parts = list(parts[0].chunk(2))
    if gated and (len(parts) != 2 or parts[0].shape != parts[1].shape):
        raise ValueError("a gated weight has two blocks of equal shape: gate and up")
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    k32 = (k + 31) // 32 * 32
    lib = cpu_kernels()
    aligned = all(p.shape[0] % 16 == 0 for p in parts[:-1]) and all(p.stride(1) == 1 for p in parts)
    if lib is None or not (aligned or gated):
        units = _units(torch.cat(parts), k32, 2 if gated else 1)
    else:  # a C loop writes the layout: torch's strided copy of 4-byte runs is slow
        units_per = [(p.shape[0] + 15) // 16 for p in parts]
        units = torch.empty(sum(units_per), k32 // 2, 16, 2, dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        for i, p in enumerate(parts):
            # gated: gate -> units 0, 2, 4, ..., up -> 1, 3, 5, ...; else block i after block i-1
            first, stride = (i, 2) if gated else (sum(units_per[:i]), 1)
            lib.agentrt_pack_weight_bf16(p.data_ptr(), p.stride(0), p.shape[0], k,
                                         units[first].data_ptr(), stride, threads)
    return PackedWeight(units.view(-1, k32 // 2, 16, 2), n // 2 if gated else n, k, gated)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Accumulate in fp32 like the reference implementation; cast back before the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm_reference(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the scale (1 + weight, fp32) applied in fp32 before the cast back, where
    Llama's casts first (rms_norm_reference)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one).to(x.dtype)


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernels' norm of bf16 rows: Gemma's for an fp32 weight (1 + w), else Llama's."""
    gemma = weight.dtype == torch.float32 and x.dtype != torch.float32
    return (gemma_rms_norm_reference if gemma else rms_norm_reference)(x, weight, eps)


def linear_reference(
    x: torch.Tensor,  # [M, K] bf16
    weight: torch.Tensor,  # [N, K] (gated: [2N, K]) bf16
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    act: str = "silu",  # the gate's activation: silu or gelu_tanh
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if norm_weight is not None:
        x = norm_reference(x, norm_weight, eps)
    y = (x.float() @ weight.float().T + (bias.float() if bias is not None else 0.0)).to(x.dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = (F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)) * up
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


def linear(
    x: torch.Tensor,  # [M, K] bf16, rows may be strided
    w: PackedWeight,
    *,
    norm_weight: torch.Tensor | None = None,  # bf16: Llama's norm, fp32 (1 + w): Gemma's
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    act: str = "silu",  # a gated weight's activation: silu or gelu_tanh
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
    if act not in _GATES:
        raise ValueError(f"linear: the gate's activation is one of {sorted(_GATES)}, got {act!r}")
    if norm_weight is not None and norm_weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear: the norm weight is bf16 or fp32 (Gemma's 1 + w), got {norm_weight.dtype}")
    epilogue = _GATES[act] if w.gated else EPI_NONE
    if residual is not None:
        if w.gated or out_dtype != torch.bfloat16 or residual.stride(-1) != 1:
            raise ValueError("linear: a residual needs an ungated weight, bf16 output and contiguous rows")
        epilogue = EPI_RESIDUAL
    lib.agentrt_linear_bf16(
        w.data.data_ptr(), w.units, w.out_features, K, x.data_ptr(), M, x.stride(0),
        None if norm_weight is None else norm_weight.data_ptr(),
        int(norm_weight is not None and norm_weight.dtype == torch.float32), eps,
        None if bias is None else bias.data_ptr(), epilogue,
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        out.data_ptr(), out.stride(0), int(out_dtype == torch.float32),
        num_threads or torch.get_num_threads(),
    )
    return out
