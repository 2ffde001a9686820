"""The bf16 CPU forward of LlamaModel on the C kernels (agentrt/kernels): all decoder layers in
one call (agentrt/kernels/decoder.py), five kernels per layer:

    qkv  = linear(h, Wqkv, norm=attn_norm)           rms-norm fused into the projection
    rotary_kv_write(qkv -> q, k_cache, v_cache)      (QK-norm,) rotary on q and k, K/V into their slots
    attn = paged_attention(q, caches, block tables)  straight from the paged cache (sliding window)
    h    = linear(attn, Wo, residual=h)              residual add fused, h updated in place
    act  = linear(h, Wgate_up, norm=mlp_norm, silu)  SiLU(gate) * up fused (GeGLU: gelu_tanh(gate) * up)
    h    = linear(act, Wdown, residual=h)

(Gemma 3: the attention and MLP outputs normed before their adds, every norm Gemma's (1 + w), the
sliding layers' own rotary tables; the embedding scaled before, the logits soft-capped after),
then the final norm fused into the head. Every op rounds to bf16 where the PyTorch path's
separate ops do, so the two paths differ by float summation order only
(tests/engine/test_kernel_forward.py). Used for every batch the model runs in bf16 on CPU:
decode, verification and prefill alike, with no size cap: sending larger steps to the PyTorch
path put a cliff into the step cost (40 ms at 64 tokens, 75 ms at 65 with a 64-token cap) that
the adaptive controller's roofline cannot represent, and the kernel path was the faster at every
size measured, up to 512 new tokens.
"""
from __future__ import annotations

import weakref

import torch

from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput
from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.decoder import Dims, LayerWeights, decoder_layers, layer_table
from agentrt.kernels.linear import linear, norm_reference


def kernel_support(cfg, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel forward cannot run this model here, or None when it can (every feature of
    engine/config.py's families runs on it)."""
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
        local = model.local_rope  # the sliding layers' rotary tables (Gemma 3), None: every layer the model's
        opt = lambda t: None if t is None else t.contiguous()  # noqa: E731  (held here: the table has their addresses)
        self.layers = [
            LayerWeights(ly.qkv.kernel, ly.qkv.bias, ly.o.kernel, ly.gate_up.kernel, ly.down.kernel,
                         ly.attn_norm.contiguous(), ly.mlp_norm.contiguous(), q_norm=opt(ly.q_norm),
                         k_norm=opt(ly.k_norm), attn_out_norm=opt(ly.attn_out_norm), mlp_out_norm=opt(ly.mlp_out_norm),
                         cos=local.cos if ly.local_rope else None, sin=local.sin if ly.local_rope else None,
                         window=ly.window, gelu=cfg.hidden_act == "gelu_tanh", gemma_norms=cfg.gemma_norms)
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
    if model.embed_scale is not None:  # Gemma: as the PyTorch path scales it, one bf16 multiply
        h = h * model.embed_scale.to(h.dtype)
    decoder_layers(dec.table(kv), num_layers, dec.dims, h, positions, model.rope.cos, model.rope.sin, slots,
                   meta.cu_q, meta.block_tables, meta.block_size, threads)
    if batch.logits_indices is not None:
        h = h[batch.logits_indices]
    eps, cap = dec.dims.eps, model.cfg.final_logit_softcapping
    # the final norm fused into the head: Llama's with a bf16 weight, Gemma's with its fp32 (1 + w)
    logits = linear(h, model.lm_head.kernel, norm_weight=model.norm, eps=eps, out_dtype=torch.float32, num_threads=threads)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return ForwardOutput(logits=logits, hidden=norm_reference(h, model.norm, eps) if return_hidden else None)
