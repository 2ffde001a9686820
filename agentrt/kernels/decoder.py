"""A stack of Llama decoder layers in one kernel call (csrc/cpu_decoder_bf16.c), its reference
composed of the per-op references, and the table of weight and cache addresses it reads.

Per layer (h [T, hidden] updated in place):
    qkv  = linear(h, Wqkv, norm=attn_norm, bias)        rotary_kv_write(qkv -> q, caches)
    attn = paged_attention(q, caches)                    h = linear(attn, Wo, residual=h)
    act  = linear(h, Wgate_up, norm=mlp_norm, silu)      h = linear(act, Wdown, residual=h)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.linear import PackedWeight, linear_reference
from agentrt.kernels.paged_attention import (
    PREFETCH_ROWS,
    paged_attention_reference,
    rotary_kv_write_reference,
)

LAYER_FIELDS = 13  # the row layout csrc/cpu_decoder_bf16.c reads


@dataclass(frozen=True)
class LayerWeights:
    qkv: PackedWeight
    qkv_bias: torch.Tensor | None
    o: PackedWeight
    gate_up: PackedWeight  # gated
    down: PackedWeight
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


def layer_table(layers: list[LayerWeights], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
    """[L, LAYER_FIELDS] int64 of addresses: valid while the weights and caches live."""
    rows = []
    for w, kc, vc in zip(layers, k_caches, v_caches):
        rows.append([
            w.qkv.data.data_ptr(), w.qkv.units, 0 if w.qkv_bias is None else w.qkv_bias.data_ptr(),
            w.o.data.data_ptr(), w.o.units, w.gate_up.data.data_ptr(), w.gate_up.units,
            w.down.data.data_ptr(), w.down.units, w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(),
            kc.data_ptr(), vc.data_ptr(),
        ])
    return torch.tensor(rows, dtype=torch.long)


def decoder_layers(
    table: torch.Tensor,  # layer_table(...), first num_layers rows used
    num_layers: int,
    dims: Dims,
    h: torch.Tensor,  # [T, hidden] bf16, updated in place
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, d/2] fp32
    sin: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    cu_q: torch.Tensor,  # [B + 1] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    num_threads: int | None = None,
) -> torch.Tensor:
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("the decoder kernel is not available on this machine (see agentrt.kernels.cpu_build)")
    T = h.shape[0]
    nq, nkv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    qkv = torch.empty(T, (nq + 2 * nkv) * d, dtype=h.dtype)
    attn = torch.empty(T, nq * d, dtype=h.dtype)
    act = torch.empty(T, dims.intermediate, dtype=h.dtype)
    lib.agentrt_decoder_layers_bf16(
        table.data_ptr(), num_layers, h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), act.data_ptr(), T, dims.hidden,
        dims.intermediate, nq, nkv, d, dims.eps, dims.scale, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), cu_q.numel() - 1, cu_q.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        block_size, num_threads or torch.get_num_threads(), PREFETCH_ROWS,
    )
    return h


def decoder_layers_reference(
    layers: list[tuple[LayerWeights, dict[str, torch.Tensor]]],  # packed weights + plain: qkv, o, gate_up, down
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    dims: Dims,
    h: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    cu_q: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """The same stack from the per-op PyTorch references (plain [N, K] weights)."""
    T = h.shape[0]
    nq, d = dims.num_heads, dims.head_dim
    for (w, plain), kc, vc in zip(layers, k_caches, v_caches):
        qkv = linear_reference(h, plain["qkv"], norm_weight=w.attn_norm, eps=dims.eps, bias=w.qkv_bias)
        rotary_kv_write_reference(qkv, positions, cos, sin, slots, kc, vc, nq)
        q = qkv[:, : nq * d].reshape(T, nq, d)
        attn = paged_attention_reference(q, kc, vc, cu_q, positions, block_tables, block_size, dims.scale)
        h = linear_reference(attn.reshape(T, nq * d), plain["o"], residual=h)
        act = linear_reference(h, plain["gate_up"], norm_weight=w.mlp_norm, eps=dims.eps, gated=True)
        h = linear_reference(act, plain["down"], residual=h)
    return h
