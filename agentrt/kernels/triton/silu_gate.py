"""SiLU(gate) * up from the engine's fused gate_up projection ([T, 2I]: the gate in the first I
columns, up in the last I, as models.llama stacks gate_proj and up_proj), without splitting it.

Same arithmetic as the reference: SiLU in fp32 rounded to the model dtype, then the product in
fp32 rounded once; it differs from PyTorch's CPU SiLU only by exp's last bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_BLOCK = 1024


def silu_gate_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_gate_kernel(gate_up_ptr, in_stride, out_ptr, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < inter
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=live, other=0.0)
    up = tl.load(gate_up_ptr + row * in_stride + inter + cols, mask=live, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=live)


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> SiLU(gate_up[:, :I]) * gate_up[:, I:], [T, I] in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_gate: gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _silu_gate_kernel[(gate_up.shape[0], triton.cdiv(inter, _BLOCK))](gate_up, gate_up.stride(0), out, out.stride(0),
                                                                         inter, BLOCK=_BLOCK)
    return out
