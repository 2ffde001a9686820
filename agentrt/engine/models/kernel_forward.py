"""The bf16 CPU forward of LlamaModel on the C kernels (agentrt/kernels): five calls per layer.

    qkv  = linear(h, Wqkv, norm=attn_norm)           rms-norm fused into the projection
    rotary_kv_write(qkv -> q, k_cache, v_cache)      rotary on q and k, K/V into their slots
    attn = paged_attention(q, caches, block tables)  straight from the paged cache
    h    = linear(attn, Wo, residual=h)              residual add fused, h updated in place
    act  = linear(h, Wgate_up, norm=mlp_norm, silu)  SiLU(gate) * up fused
    h    = linear(act, Wdown, residual=h)

Every op rounds to bf16 where the PyTorch path's separate ops do, so the two paths differ by
float summation order only (tests/engine/test_kernel_forward.py). Used for batches of at most
KERNEL_MAX_TOKENS tokens (decode, verification, small prefill chunks); larger prefill chunks
take the PyTorch path, whose oneDNN GEMMs are faster there.
"""
from __future__ import annotations

import torch

from agentrt.engine.kv_cache import KVCache
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput
from agentrt.engine.models.layers import rms_norm
from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.linear import linear
from agentrt.kernels.paged_attention import paged_attention, rotary_kv_write

# Measured (bench notes in docs/benchmarks.md): the AMX kernel matches oneDNN near 64 rows and
# falls behind above, while below it reads weights ~1.5x faster and costs far less per call.
KERNEL_MAX_TOKENS = 64


def kernel_support(cfg, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel forward cannot run this model here, or None when it can."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"the C kernels run bf16 on CPU (this model is {dtype} on {device})"
    if cfg.head_dim % 16 or cfg.head_dim > 256:
        return f"the attention kernel needs head_dim a multiple of 16 up to 256 (got {cfg.head_dim})"
    if cpu_kernels() is None:
        from agentrt.kernels.cpu_build import unsupported_reason

        return f"C kernels unavailable: {unsupported_reason() or 'the build or AMX set-up failed (see the log)'}"
    return None


def kernel_forward(model, batch: ForwardBatch, kv: KVCache, num_layers: int, return_hidden: bool) -> ForwardOutput:
    cfg = model.cfg
    nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    T = batch.input_ids.shape[0]
    meta, positions, slots = batch.attn, batch.positions, batch.slot_mapping
    if positions.dtype != torch.long or slots.dtype != torch.long:
        raise ValueError(f"positions and slot_mapping must be int64, got {positions.dtype} and {slots.dtype}")
    threads = torch.get_num_threads()
    dt = model.dtype
    h = model.embed[batch.input_ids]  # [T, hidden], a fresh tensor: updated in place below
    qkv = torch.empty(T, (nq + 2 * nkv) * d, dtype=dt)
    attn = torch.empty(T, nq * d, dtype=dt)
    act = torch.empty(T, cfg.intermediate_size, dtype=dt)
    cos, sin = model.rope.cos, model.rope.sin
    for li, layer in enumerate(model.layers[:num_layers]):
        kc, vc = kv.k[li], kv.v[li]
        linear(h, layer.qkv.kernel, norm_weight=layer.attn_norm, eps=eps, bias=layer.qkv.bias, out=qkv, num_threads=threads)
        rotary_kv_write(qkv, positions, cos, sin, slots, kc, vc, nq, threads)
        paged_attention(qkv, kc, vc, meta.cu_q, positions, meta.block_tables, meta.block_size, model.scale, nq,
                        out=attn, num_threads=threads)
        linear(attn, layer.o.kernel, residual=h, out=h, num_threads=threads)
        linear(h, layer.gate_up.kernel, norm_weight=layer.mlp_norm, eps=eps, out=act, num_threads=threads)
        linear(act, layer.down.kernel, residual=h, out=h, num_threads=threads)
    if batch.logits_indices is not None:
        h = h[batch.logits_indices]
    logits = linear(h, model.lm_head.kernel, norm_weight=model.norm, eps=eps, out_dtype=torch.float32, num_threads=threads)
    return ForwardOutput(logits=logits, hidden=rms_norm(h, model.norm, eps) if return_hidden else None)
