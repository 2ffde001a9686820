"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, linear layers.

Everything here is plain PyTorch over flat token tensors ([num_tokens, ...]); the engine batches
ragged sequences by concatenation, so no layer knows about batch padding.
"""
from __future__ import annotations

import functools

import math

import torch
import torch.nn.functional as F

from agentrt.engine.config import ModelConfig, RopeScaling
from agentrt.kernels.linear import PackedWeight, pack_weight
from agentrt.kernels.linear import gemma_rms_norm_reference as gemma_rms_norm  # noqa: F401  (Gemma's norm)
from agentrt.kernels.linear import rms_norm_reference as rms_norm  # noqa: F401  (the model's norm)
from agentrt.kernels.paged_attention import rotate_reference as apply_rotary  # noqa: F401


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position, built once; a step indexes them by position.
    local: the sliding layers' tables (their own base, no scaling: Gemma 3), else the full layers'."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, local: bool = False):
        d = cfg.head_dim
        theta = cfg.rope_local_theta if local else cfg.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        s = None if local else cfg.rope_scaling
        if s is not None:
            inv_freq = _llama3_inv_freq(inv_freq, s) if s.kind == "llama3" else inv_freq / s.factor
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [P, d/2]
        self.cos = freqs.cos().float().to(device)
        self.sin = freqs.sin().float().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # -> cos, sin [T, 1, d] (halves repeated: the rotate-half layout of HF checkpoints)
        cos = self.cos[positions]
        sin = self.sin[positions]
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(dtype)
        return cos, sin


class Linear:
    """y = x W^T (+ b), W given whole or as row blocks (q, k, v; gate, up) that it stacks.

    On CPU in bf16 the weight is pre-packed for oneDNN: PyTorch's plain CPU GEMV reads weights
    at ~10 GB/s, the packed path at 20-34 GB/s (measured on a 2-core AVX512 Xeon). With `kernel`, it is packed for
    the AMX kernel instead (agentrt/kernels/linear.py), straight from the blocks; the stacked
    weight and its oneDNN packing are then built on first use (the PyTorch path run as a
    reference with `kernels_enabled` off, a benchmark reading `weight`), which keeps ~0.3 s
    and one copy of the weights out of start-up. `gated` marks [gate; up] for the kernel."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None,
                 pack: bool = False, kernel: bool = False, gated: bool = False):
        parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        self.bias = bias
        self._parts: list[torch.Tensor] | None = parts
        self._weight: torch.Tensor | None = parts[0] if len(parts) == 1 else None
        self._pack = pack and _can_pack(parts[0])
        self._packed = None
        self.kernel: PackedWeight | None = pack_weight(parts, gated) if kernel else None
        if not kernel:
            _ = self.weight
            if self._pack:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)

    @property
    def weight(self) -> torch.Tensor:  # [N, K]
        if self._weight is None:
            self._weight = torch.cat(self._parts).contiguous()
        self._parts = None  # the blocks' memory goes with them once stacked
        return self._weight

    @property
    def packed(self) -> torch.Tensor | None:
        if self._pack and self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and onednn_bf16()
    )


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN has a bf16 path on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT). Without one
    (an AVX2-only CPU) packing a bf16 weight raises and bf16 matmuls run at a fixed ~15 GFLOP/s
    whatever the rows (a 256-row prefill linear 7x slower than fp32): see default_dtype."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True
