"""The forward of a quantized LlamaModel (GGUF blocks, fp32 activations) on the fused C decoder
(agentrt/kernels/quant_decoder.py):

    h      = embed[input_ids]                                    [T, hidden]
    h      = layers(h)             norms, quantized linears, rotary, K/V writes, attention, SiLU
                                   (Qwen3, Gemma 3: QK-norm; Gemma 3: post-norms, GeGLU, sliding
                                   layers with their own rotary base; embedding scale, soft-cap)
    hidden = rms_norm(h[logits_indices], norm)                   [n_out, hidden]
    logits = lm_head(hidden)                                     [n_out, vocab]

all in one kernel call when the embedding and the head are quantized weights (the Python between
three calls cost ~0.3 ms of a ~5 ms batch-1 step: its caches are cold after the weights went
past); otherwise the layers and the norm in one call, the embedding and head around it.

It computes the PyTorch path's model (same weights, same int8 activation blocks before every
linear, K/V kept in bf16 caches: model.kv_dtype; the queries and the softmax numerators rounded
to bf16 as the decoder's attention rounds them, quant_attention_reference, where the
batch-invariant variant rounds the queries only); the two differ by fp32 summation order and
exp() rounding, which can flip an int8 rounding of a later linear's activations
(tests/engine/test_quant_forward.py bounds it). Unlike
the PyTorch path it is batch invariant: a token's logits do not depend on the rest of the batch,
so greedy output is the same with and without speculation, with or without `batch_invariant`.
Used for every batch of a quantized model whose weights and cache it supports; `model.quant_fused
= False` (or AGENTRT_KERNELS=0) runs the PyTorch path instead.
"""
from __future__ import annotations

import weakref

import torch

from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput
from agentrt.engine.models.quant_layers import QuantEmbedding, QuantLinear
from agentrt.kernels.decoder import Dims
from agentrt.kernels.quant_build import quant_kernels, unsupported_reason
from agentrt.kernels.quant_decoder import (KV_DTYPE, QuantLayerWeights, QuantModelTable, quant_decoder_layers,
                                           quant_layer_table, quant_model_forward, quant_model_table)
from agentrt.kernels.quant_formats import FORMAT_BY_GGML_TYPE


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def quant_support(model) -> str | None:
    """Why the fused decoder cannot run this model, or None when it can."""
    cfg = model.cfg
    if not model.quantized:
        return "the model has no quantized weights"
    if model.device.type != "cpu":
        return f"the quantized decoder runs on the CPU (this model is on {model.device})"
    if cfg.head_dim % 16 or cfg.num_attention_heads % cfg.num_key_value_heads:
        return f"head_dim must be a multiple of 16 and heads a multiple of kv heads (got {cfg.head_dim})"
    nq, nkv, d, hidden, inter = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                                 cfg.intermediate_size)
    want = {"qkv": ((nq + 2 * nkv) * d, hidden), "o": (hidden, nq * d), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}
    for i, layer in enumerate(model.layers):
        for name, shape in want.items():
            lin = getattr(layer, name)
            most = 3 if name == "qkv" else 1  # q, k and v may come in formats of their own
            if not isinstance(lin, QuantLinear) or len(lin.parts) > most:
                return f"layers.{i}.{name} is not {'one to three' if most == 3 else 'one'} quantized block matrix"
            rows = sum(w.shape[0] for w in lin.parts)
            for w in lin.parts:
                if w.format.ggml_type not in FORMAT_BY_GGML_TYPE or (rows, w.shape[1]) != shape:
                    return f"layers.{i}.{name}: {lin.formats} {(rows, w.shape[1])}, expected {shape}"
            if lin.bias is not None and name != "qkv":
                return f"layers.{i}.{name} has a bias"
    if quant_kernels() is None:
        return f"quantized kernels unavailable: {unsupported_reason() or 'the build failed (see the log)'}"
    return None


def cache_supported(kv: KVCache) -> bool:
    """The fused decoder reads and writes contiguous bf16 caches in host memory."""
    c = kv.k[0]
    return c.dtype == KV_DTYPE and c.device.type == "cpu" and c.is_contiguous()


class QuantDecoder:
    """The model's layers as the fused decoder reads them, with one address table per KV cache."""

    def __init__(self, model):
        cfg = model.cfg
        self.dims = Dims(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                              cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale)
        local = model.local_rope  # the sliding layers' rotary tables (Gemma 3), None: every layer the model's
        self.local_cos, self.local_sin = (_f32(local.cos), _f32(local.sin)) if local is not None else (None, None)
        opt = lambda t: None if t is None else _f32(t)  # noqa: E731
        self.layers = [  # fp32 copies of norms and bias are kept here: the table holds their addresses
            QuantLayerWeights(tuple(ly.qkv.parts), opt(ly.qkv.bias), ly.o.parts[0], ly.gate_up.parts[0], ly.down.parts[0],
                              _f32(ly.attn_norm), _f32(ly.mlp_norm), q_norm=opt(ly.q_norm), k_norm=opt(ly.k_norm),
                              attn_out_norm=opt(ly.attn_out_norm), mlp_out_norm=opt(ly.mlp_out_norm),
                              cos=self.local_cos if ly.local_rope else None,
                              sin=self.local_sin if ly.local_rope else None,
                              window=ly.window, gelu=cfg.hidden_act == "gelu_tanh")
            for ly in model.layers
        ]
        self.embed_scale = None if model.embed_scale is None else float(model.embed_scale)
        self.softcap = cfg.final_logit_softcapping
        self.final_norm = _f32(model.norm)
        self.cos, self.sin = _f32(model.rope.cos), _f32(model.rope.sin)
        head, embed = model.lm_head, model.embed
        whole = (isinstance(embed, QuantEmbedding) and isinstance(head, QuantLinear) and len(head.parts) == 1
                 and head.bias is None and head.parts[0].format.ggml_type in FORMAT_BY_GGML_TYPE)
        self.embedding, self.head = (embed.weight, head.parts[0]) if whole else (None, None)
        self._tables: weakref.WeakKeyDictionary[KVCache, torch.Tensor] = weakref.WeakKeyDictionary()
        self._models: weakref.WeakKeyDictionary[KVCache, QuantModelTable] = weakref.WeakKeyDictionary()

    def table(self, kv: KVCache) -> torch.Tensor:
        t = self._tables.get(kv)
        if t is None:
            t = self._tables[kv] = quant_layer_table(self.layers, kv.k, kv.v)
        return t

    def model_table(self, kv: KVCache) -> QuantModelTable | None:
        """The whole model's table for one-call forwards, None when its embedding or head is not
        a quantized weight."""
        if self.embedding is None:
            return None
        t = self._models.get(kv)
        if t is None:
            t = self._models[kv] = quant_model_table(self.table(kv), self.dims, self.cos, self.sin, kv.k[0].shape[0],
                                                     kv.block_size, self.final_norm, self.embedding, self.head,
                                                     embed_scale=self.embed_scale, softcap=self.softcap)
        return t


def quant_forward(model, batch: ForwardBatch, kv: KVCache, num_layers: int, return_hidden: bool) -> ForwardOutput:
    dec: QuantDecoder = model.quant_decoder
    meta = batch.attn
    whole = dec.model_table(kv)
    if whole is not None:
        if meta.block_size != kv.block_size:  # the table holds the cache's: a batch for another cache
            raise ValueError(f"the batch's block size {meta.block_size} is not its KV cache's ({kv.block_size})")
        hidden, logits = quant_model_forward(whole, num_layers, batch.input_ids, batch.positions, batch.slot_mapping,
                                             meta.cu_q, meta.block_tables, batch.logits_indices, tree=meta.tree)
        return ForwardOutput(logits=logits, hidden=hidden if return_hidden else None)
    h = model.embed[batch.input_ids]  # [T, hidden], fresh: updated in place
    h = h if h.dtype == torch.float32 and h.is_contiguous() else h.float().contiguous()
    if dec.embed_scale is not None:
        h = h * dec.embed_scale
    hidden = quant_decoder_layers(
        dec.table(kv), num_layers, dec.dims, h, batch.positions, dec.cos, dec.sin, batch.slot_mapping,
        kv.k[0].shape[0], meta.cu_q, meta.block_tables, meta.block_size, final_norm=dec.final_norm,
        rows=batch.logits_indices, tree=meta.tree,
    )
    logits = model.lm_head(hidden).float()  # [n_out, vocab]
    if dec.softcap is not None:
        logits = torch.tanh(logits / dec.softcap) * dec.softcap
    return ForwardOutput(logits=logits, hidden=hidden if return_hidden else None)
