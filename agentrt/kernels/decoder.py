"""A stack of decoder layers in one kernel call (csrc/cpu_decoder_bf16.c), its reference
composed of the per-op references, and the table of weight and cache addresses it reads.

Per layer (h [T, hidden] updated in place):
    qkv  = linear(h, Wqkv, norm=attn_norm, bias)        rotary_kv_write(qkv -> q, caches)
    attn = paged_attention(q, caches)                    h = linear(attn, Wo, residual=h)
    act  = linear(h, Wgate_up, norm=mlp_norm, silu)      h = linear(act, Wdown, residual=h)
with, where a layer has them (LayerWeights' optional fields), the later families' features as the
fused quantized decoder has them: QK-norm in rotary_kv_write, norms of the attention and MLP
outputs before their residual adds (h = h + norm(linear(...)), each rounded to bf16), GeGLU, the
layer's own rotary tables, a sliding window, and Gemma's norms (fp32 (1 + w) weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.linear import PackedWeight, linear_reference, norm_reference
from agentrt.kernels.paged_attention import (
    PREFETCH_ROWS,
    paged_attention_reference,
    rotary_kv_write_reference,
)

LAYER_FIELDS = 22  # the row layout csrc/cpu_decoder_bf16.c reads


@dataclass(frozen=True)
class LayerWeights:
    qkv: PackedWeight
    qkv_bias: torch.Tensor | None
    o: PackedWeight
    gate_up: PackedWeight  # gated
    down: PackedWeight
    attn_norm: torch.Tensor  # [hidden]: every norm weight bf16 (Llama's norm) or, with gemma_norms, fp32 (1 + w)
    mlp_norm: torch.Tensor
    q_norm: torch.Tensor | None = None  # [head_dim]: QK-norm of each q head before rotary (with k_norm)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden]: the attention output's norm before its add
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: the MLP output's
    cos: torch.Tensor | None = None  # [P, head_dim / 2] fp32: this layer's rotary tables (None: the model's)
    sin: torch.Tensor | None = None
    window: int | None = None  # a query at p sees positions p - window + 1 .. p
    gelu: bool = False  # GeGLU: gelu_tanh(gate) * up instead of silu(gate) * up
    gemma_norms: bool = False

    def __post_init__(self):
        want = torch.float32 if self.gemma_norms else torch.bfloat16
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
            t = getattr(self, name)
            if t is not None and (t.dtype != want or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError(f"{name} must be {want} contiguous on the CPU (gemma_norms={self.gemma_norms}), "
                                 f"got {t.dtype} on {t.device}")
        for name in ("cos", "sin"):
            t = getattr(self, name)
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
                raise ValueError(f"{name} must be fp32 contiguous, got {t.dtype}")
        if (self.q_norm is None) != (self.k_norm is None) or (self.cos is None) != (self.sin is None):
            raise ValueError("q_norm and k_norm, cos and sin come in pairs")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be positive, got {self.window}")


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
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    for w, kc, vc in zip(layers, k_caches, v_caches):
        rows.append([
            w.qkv.data.data_ptr(), w.qkv.units, ptr(w.qkv_bias),
            w.o.data.data_ptr(), w.o.units, w.gate_up.data.data_ptr(), w.gate_up.units,
            w.down.data.data_ptr(), w.down.units, w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(),
            kc.data_ptr(), vc.data_ptr(), *(ptr(t) for t in (w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm,
                                                             w.cos, w.sin)),
            w.window or 0, int(w.gelu), int(w.gemma_norms),
        ])
    return torch.tensor(rows, dtype=torch.long).reshape(-1, LAYER_FIELDS)


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
    y = torch.empty(T, dims.hidden, dtype=h.dtype)  # a post-normed output before its add
    lib.agentrt_decoder_layers_bf16(
        table.data_ptr(), num_layers, h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), act.data_ptr(), y.data_ptr(), T,
        dims.hidden,
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
    nq, d, eps = dims.num_heads, dims.head_dim, dims.eps

    def add(out: torch.Tensor, out_norm: torch.Tensor | None) -> torch.Tensor:
        return h + (out if out_norm is None else norm_reference(out, out_norm, eps))

    for (w, plain), kc, vc in zip(layers, k_caches, v_caches):
        qkv = linear_reference(h, plain["qkv"], norm_weight=w.attn_norm, eps=eps, bias=w.qkv_bias)
        lcos, lsin = (cos, sin) if w.cos is None else (w.cos, w.sin)
        rotary_kv_write_reference(qkv, positions, lcos, lsin, slots, kc, vc, nq, w.q_norm, w.k_norm, eps)
        q = qkv[:, : nq * d].reshape(T, nq, d)
        attn = paged_attention_reference(q, kc, vc, cu_q, positions, block_tables, block_size, dims.scale, w.window)
        h = add(linear_reference(attn.reshape(T, nq * d), plain["o"]), w.attn_out_norm)
        act = linear_reference(h, plain["gate_up"], norm_weight=w.mlp_norm, eps=eps, gated=True,
                               act="gelu_tanh" if w.gelu else "silu")
        h = add(linear_reference(act, plain["down"]), w.mlp_out_norm)
    return h
