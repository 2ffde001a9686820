"""The per-layer ops of LlamaModel's layer loop, one object per forward: the PyTorch path's (plain
or batch invariant) or the Triton kernels' (agentrt/kernels/triton). The loop in models/llama.py
is written once against these ops; which set runs is decided when the model is built
(`triton_support`, models/llama.py), so each op has one dispatch point: its ops class.

    add_norm(sub, h, w)   the residual add of a sublayer's output and the next norm: (normed, h)
    linear(module, x)     the model's own Linear / QuantLinear on both paths (torch matmuls)
    rotary_kv_write(...)  q/k (QK-norm) and rotary, K/V into their cache slots; returns q
    attention(...)        paged attention over each sequence's context
    gate(gate_up)         act(gate) * up from the fused projection

The Triton module is imported only when its ops are built, so a CPU process that never takes the
Triton path never imports triton.
"""
from __future__ import annotations

import torch

from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models import invariant
from agentrt.engine.models.attention import AttentionMetadata, paged_attention
from agentrt.engine.models.batch import ForwardBatch
from agentrt.engine.models.layers import apply_rotary, gemma_rms_norm, rms_norm
from agentrt.kernels.quant_decoder import KV_DTYPE, kv_round, quant_attention_reference


def activation(name: str):
    if name == "gelu_tanh":
        return lambda x: torch.nn.functional.gelu(x, approximate="tanh")
    return torch.nn.functional.silu


def triton_support(cfg, dtype: torch.dtype, quantized: bool) -> str | None:
    """Why the Triton layer ops cannot run this model, or None when they can."""
    gaps = cfg.triton_gaps()
    if gaps:
        return f"the Triton path runs Llama-layout layers; this {cfg.architecture} model has {', '.join(gaps)}"
    if quantized:
        return "GGUF quantized blocks run on the CPU's int8 kernels, not on the Triton path"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the Triton kernels take fp32, fp16 or bf16 (this model is {dtype})"
    d = cfg.head_dim
    if d < 16 or d & (d - 1):
        return f"the Triton attention and rotary kernels need a power-of-two head_dim of 16 or more (got {d})"
    return None


class TorchLayerOps:
    """The PyTorch path; batch_invariant replaces every batch-dependent op (models/invariant.py)."""

    def __init__(self, model, batch: ForwardBatch, batch_invariant: bool):
        cfg = model.cfg
        norm = gemma_rms_norm if cfg.gemma_norms else rms_norm
        eps = cfg.rms_norm_eps
        if batch_invariant:
            self.norm = lambda x, w: invariant.rms_norm(x, w, eps, norm)  # noqa: E731
            self.linear, self._attention = invariant.linear, invariant.attention
        else:
            self.norm = lambda x, w: norm(x, w, eps)  # noqa: E731
            self.linear = lambda module, x: module(x)  # noqa: E731
            self._attention = paged_attention
        self._ropes = {False: model.rope.tables(batch.positions, model.dtype)}  # [T, 1, d] cos, sin
        if model.local_rope is not None:
            self._ropes[True] = model.local_rope.tables(batch.positions, model.dtype)
        self._act = activation(cfg.hidden_act)
        self._heads = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def add_norm(self, sub: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        h = h if sub is None else h + sub
        return self.norm(h, weight), h

    def rotary_kv_write(self, layer, li: int, qkv: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        nq, nkv, d = self._heads
        T = qkv.shape[0]
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q, k = q.reshape(T, nq, d), k.reshape(T, nkv, d)
        if layer.q_norm is not None:  # over each head's vector, before rotary
            q = self.norm(q.reshape(T * nq, d), layer.q_norm).view(T, nq, d)
            k = self.norm(k.reshape(T * nkv, d), layer.k_norm).view(T, nkv, d)
        cos, sin = self._ropes[layer.local_rope]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv.write(li, batch.slot_mapping, k, v.view(T, nkv, d))
        return q

    def attention(self, q: torch.Tensor, li: int, kv: KVCache, meta: AttentionMetadata, scale: float,
                  window: int | None) -> torch.Tensor:
        # a token tree gives each node its own keys (its ancestors'): attention per query
        attend = invariant.attention if meta.tree is not None else self._attention
        if kv.k[li].dtype == KV_DTYPE and q.dtype == torch.float32:  # the quantized model's bf16 caches
            if attend is paged_attention:  # the fused decoder's roundings: bf16 queries and numerators per chunk
                return quant_attention_reference(q, kv.k[li], kv.v[li], meta.cu_q, meta.positions, meta.block_tables,
                                                 meta.block_size, scale, window)
            q = kv_round(q).float()  # the queries rounded as the fused decoder rounds them (its numerators not)
        return attend(q, kv.k[li], kv.v[li], meta, scale, window)

    def gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up


class TritonLayerOps:
    """The Triton kernels (compiled for the GPU, or interpreted on CPU tensors), for models that
    `triton_support` accepts: Llama-layout layers, so no QK-norm, window or local rotary here."""

    def __init__(self, model, batch: ForwardBatch):
        from agentrt.kernels.triton.paged_attention import paged_attention as paged_attention_kernel
        from agentrt.kernels.triton.rmsnorm import rmsnorm_residual
        from agentrt.kernels.triton.rotary_kv_write import rotary_kv_write
        from agentrt.kernels.triton.silu_gate import silu_gate

        self._attention_kernel, self._rotary = paged_attention_kernel, rotary_kv_write
        self._rmsnorm, self.gate = rmsnorm_residual, silu_gate
        self._eps = model.cfg.rms_norm_eps
        self._cos, self._sin = model.rope.cos, model.rope.sin  # [P, d/2] fp32
        self._heads = model.cfg.num_attention_heads, model.cfg.head_dim
        self.linear = lambda module, x: module(x)  # noqa: E731

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._rmsnorm(x, None, weight, self._eps)[0]

    def add_norm(self, sub: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rmsnorm(h, None, weight, self._eps) if sub is None else self._rmsnorm(sub, h, weight, self._eps)

    def rotary_kv_write(self, layer, li: int, qkv: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        nq, d = self._heads
        self._rotary(qkv, batch.positions, self._cos, self._sin, batch.slot_mapping, kv.k[li], kv.v[li], nq)
        return qkv[:, : nq * d].view(qkv.shape[0], nq, d)  # rotated in place; rows strided by the qkv width

    def attention(self, q: torch.Tensor, li: int, kv: KVCache, meta: AttentionMetadata, scale: float,
                  window: int | None) -> torch.Tensor:
        return self._attention_kernel(q, kv.k[li], kv.v[li], meta.cu_q, meta.positions, meta.block_tables,
                                      meta.block_size, scale, meta.q_max, meta.l_max)
