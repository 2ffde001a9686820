"""The bf16 CPU forward of LlamaModel on the C kernels (agentrt/kernels): all decoder layers in
one call (agentrt/kernels/decoder.py), five kernels per layer:

    qkv  = linear(h, Wqkv, norm=attn_norm)           rms-norm fused into the projection
    rotary_kv_write(qkv -> q, k_cache, v_cache)      rotary on q and k, K/V into their slots
    attn = paged_attention(q, caches, block tables)  straight from the paged cache
    h    = linear(attn, Wo, residual=h)              residual add fused, h updated in place
    act  = linear(h, Wgate_up, norm=mlp_norm, silu)  SiLU(gate) * up fused
    h    = linear(act, Wdown, residual=h)

then the final norm fused into the head. Every op rounds to bf16 where the PyTorch path's
separate ops do, so the two paths differ by float summation order only
(tests/engine/test_kernel_forward.py). Used for every batch the model runs in bf16 on CPU:
decode, verification and prefill alike. (Capping it at 64 tokens and sending larger steps to the
PyTorch path put a cliff into the step cost, 40 ms at 64 tokens and 75 ms at 65, that the
adaptive controller's roofline cannot represent; the kernel path is faster at every size
measured, up to 512 new tokens: docs/benchmarks.md.)
"""
from __future__ import annotations

import weakref

import torch

from agentrt.engine.kv_cache import KVCache
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput
from agentrt.engine.models.layers import rms_norm
from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.decoder import Dims, LayerWeights, decoder_layers, layer_table
from agentrt.kernels.linear import linear

def kernel_support(cfg, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel forward cannot run this model here, or None when it can."""
    gaps = cfg.fused_kernel_gaps()
    if gaps:
        return f"the C kernels run Llama-layout layers; this {cfg.architecture} model has {', '.join(gaps)}"
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"the C kernels run bf16 on CPU (this model is {dtype} on {device})"
    if cfg.head_dim % 16 or cfg.head_dim > 256:
        return f"the attention kernel needs head_dim a multiple of 16 up to 256 (got {cfg.head_dim})"
    if cpu_kernels() is None:
        from agentrt.kernels.cpu_build import unsupported_reason

        return f"C kernels unavailable: {unsupported_reason() or 'the build or AMX set-up failed (see the log)'}"
    return None


class KernelDecoder:
    """The model's layers as the decoder kernel reads them, with one address table per KV cache."""

    def __init__(self, model):
        cfg = model.cfg
        self.dims = Dims(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim, cfg.rms_norm_eps, model.scale)
        self.layers = [
            LayerWeights(ly.qkv.kernel, ly.qkv.bias, ly.o.kernel, ly.gate_up.kernel, ly.down.kernel, ly.attn_norm,
                         ly.mlp_norm)
            for ly in model.layers
        ]
        self._tables: weakref.WeakKeyDictionary[KVCache, torch.Tensor] = weakref.WeakKeyDictionary()

    def table(self, kv: KVCache) -> torch.Tensor:
        t = self._tables.get(kv)
        if t is None:
            t = self._tables[kv] = layer_table(self.layers, kv.k, kv.v)
        return t


def kernel_forward(model, batch: ForwardBatch, kv: KVCache, num_layers: int, return_hidden: bool) -> ForwardOutput:
    dec: KernelDecoder = model.kernel_decoder
    positions, slots, meta = batch.positions, batch.slot_mapping, batch.attn
    if positions.dtype != torch.long or slots.dtype != torch.long:
        raise ValueError(f"positions and slot_mapping must be int64, got {positions.dtype} and {slots.dtype}")
    threads = torch.get_num_threads()
    h = model.embed[batch.input_ids]  # [T, hidden], a fresh tensor: updated in place
    decoder_layers(dec.table(kv), num_layers, dec.dims, h, positions, model.rope.cos, model.rope.sin, slots,
                   meta.cu_q, meta.block_tables, meta.block_size, threads)
    if batch.logits_indices is not None:
        h = h[batch.logits_indices]
    eps = dec.dims.eps
    logits = linear(h, model.lm_head.kernel, norm_weight=model.norm, eps=eps, out_dtype=torch.float32, num_threads=threads)
    return ForwardOutput(logits=logits, hidden=rms_norm(h, model.norm, eps) if return_hidden else None)
