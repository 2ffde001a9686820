"""Our Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2): RMSNorm, RoPE, GQA attention,
SwiGLU, tied embeddings. No Hugging Face modeling code runs in the forward pass.

The forward takes a flattened ragged batch (every sequence's new tokens concatenated, with
`cu_seqlens` offsets), writes their K/V into the paged cache and attends over each sequence's
whole context through its block table. It returns logits for the requested rows only: decode
wants one row per sequence, speculative verification wants all k+1 rows.
"""
from __future__ import annotations

import os

import torch

from agentrt.engine.config import ModelConfig
from agentrt.engine.kv_cache import KVCache
from agentrt.engine.models.attention import AttentionMetadata, paged_attention  # noqa: F401  (re-export)
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput  # noqa: F401  (re-export)
from agentrt.engine.models import invariant
from agentrt.engine.models.kernel_forward import KernelDecoder, kernel_forward, kernel_support
from agentrt.engine.models.layers import Linear, RotaryEmbedding, apply_rotary, rms_norm
from agentrt.engine.models.quant_forward import QuantDecoder, cache_supported, quant_forward, quant_support
from agentrt.engine.models.quant_layers import QuantEmbedding, QuantLinear, gather_weights
from agentrt.errors import ModelLoadError
from agentrt.kernels.quant_formats import QuantWeight, dequantize


def _linear(weights, bias, pack: bool, kernel: bool, gated: bool = False):
    """A Linear over fp32/bf16 row blocks, or a QuantLinear when every block is GGUF-quantized
    (a mix of both, which no GGUF writer produces, runs in float)."""
    parts = list(weights) if isinstance(weights, (list, tuple)) else [weights]
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantLinear(parts, bias)
    parts = [dequantize(p) if isinstance(p, QuantWeight) else p for p in parts]
    return Linear(parts, bias, pack, kernel, gated=gated)


class _Layer:
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], i: int, pack: bool, kernel: bool):
        p = f"model.layers.{i}."
        w = lambda name: sd[p + name]  # noqa: E731
        qkv_w = [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]
        qkv_b = None
        if cfg.attention_bias:
            qkv_b = torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
        self.qkv = _linear(qkv_w, qkv_b, pack, kernel)
        self.o = _linear(w("self_attn.o_proj.weight"), None, pack, kernel)
        self.gate_up = _linear([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], None, pack, kernel, gated=True)
        self.down = _linear(w("mlp.down_proj.weight"), None, pack, kernel)
        self.attn_norm = w("input_layernorm.weight")
        self.mlp_norm = w("post_attention_layernorm.weight")


class LlamaModel:
    """Inference-only model. Weights come in Hugging Face names (see engine/weights.py).

    use_kernels: run every batch on the C kernels (bf16 on CPUs
    with AMX; agentrt/engine/models/kernel_forward.py). None = whenever they can run here, unless
    AGENTRT_KERNELS=0; True = require them (ModelLoadError naming why not); False = PyTorch only.
    `kernels_enabled` switches between the two paths at run time (the weights stay packed).
    A quantized model runs on the fused quantized decoder wherever it can (quant_forward.py);
    `quant_fused` switches it off and on."""

    def __init__(self, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], max_positions: int | None = None,
                 use_kernels: bool | None = None):
        self.cfg = cfg
        emb = state_dict["model.embed_tokens.weight"]
        # GGUF blocks (models/quantized.py): fp32 activations on the CPU, the C kernels off
        self.quantized = _quantized_modules(cfg, state_dict)
        if self.quantized:
            emb = QuantEmbedding(emb) if isinstance(emb, QuantWeight) else emb
            use_kernels = False
        self.device, self.dtype = emb.device, emb.dtype
        kernel = _want_kernels(use_kernels, cfg, self.dtype, self.device)
        pack = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.embed = emb
        self.layers = [_Layer(cfg, state_dict, i, pack, kernel) for i in range(cfg.num_hidden_layers)]
        self.norm = state_dict["model.norm.weight"]
        head = state_dict["model.embed_tokens.weight"] if cfg.tie_word_embeddings else state_dict["lm_head.weight"]
        self.lm_head = _linear(head, None, pack, kernel)
        if self.quantized:  # one huge-page buffer, rows interleaved by 8 (the kernels' layout); None without them
            quant = [m for ly in self.layers for m in (ly.qkv, ly.o, ly.gate_up, ly.down)] + [self.lm_head]
            self.quant_weights = gather_weights([m for m in quant if isinstance(m, QuantLinear)],
                                                emb if isinstance(emb, QuantEmbedding) else None)
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings, self.device)
        self.scale = cfg.head_dim**-0.5
        self._kernels_packed = kernel
        self.kernels_enabled = kernel
        self.kernel_decoder = KernelDecoder(self) if kernel else None
        self.quant_decoder = QuantDecoder(self) if self.quantized and quant_support(self) is None else None
        self.quant_fused = self.quant_decoder is not None

    @property
    def quant_fused(self) -> bool:
        return self._quant_fused

    @quant_fused.setter
    def quant_fused(self, on: bool) -> None:
        if on and self.quant_decoder is None:
            raise ValueError(f"the fused quantized decoder cannot run this model: {quant_support(self)}")
        self._quant_fused = bool(on)

    @property
    def kernels_enabled(self) -> bool:
        return self._kernels_enabled

    @kernels_enabled.setter
    def kernels_enabled(self, on: bool) -> None:
        if on and not self._kernels_packed:
            raise ValueError("this model was built without the C kernels (use_kernels=False or unsupported here)")
        self._kernels_enabled = bool(on)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self, batch: ForwardBatch, kv: KVCache, num_layers: int | None = None, return_hidden: bool = False,
        batch_invariant: bool = False,
    ) -> ForwardOutput:
        """num_layers < all runs the first layers only (a layer-skip self-draft): their K/V at
        accepted positions equal the full model's, so the draft shares the target's cache.
        batch_invariant: on the PyTorch path, each token's result does not depend on the rest of
        the batch (models/invariant.py; slower); the C kernels and the fused quantized decoder
        are invariant anyway."""
        n_layers = num_layers or len(self.layers)
        if self._quant_fused and not self._kernels_enabled and cache_supported(kv):
            # kernel calls on tensors that need no autograd: inference mode would only cost time
            return quant_forward(self, batch, kv, n_layers, return_hidden)
        return self._forward(batch, kv, n_layers, return_hidden, batch_invariant)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch, kv: KVCache, n_layers: int, return_hidden: bool,
                 batch_invariant: bool) -> ForwardOutput:
        T = batch.input_ids.shape[0]
        if self._kernels_enabled:
            return kernel_forward(self, batch, kv, n_layers, return_hidden)
        if batch_invariant:
            return self._forward_invariant(batch, kv, n_layers, return_hidden)
        cfg = self.cfg
        h = self.embed[batch.input_ids]  # [T, hidden]
        cos, sin = self.rope.tables(batch.positions, self.dtype)  # [T, 1, d]
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for li, layer in enumerate(self.layers[:n_layers]):
            x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)  # [T, (nq + 2 nkv) d]
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q = apply_rotary(q.view(T, nq, d), cos, sin)
            k = apply_rotary(k.view(T, nkv, d), cos, sin)
            kv.write(li, batch.slot_mapping, k, v.view(T, nkv, d))
            o = paged_attention(q, kv.k[li], kv.v[li], batch.attn, self.scale)  # [T, nq, d]
            h = h + layer.o(o.reshape(T, nq * d))
            x = rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(torch.nn.functional.silu(gate) * up)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        h = rms_norm(h, self.norm, cfg.rms_norm_eps)  # [n_out, hidden]
        logits = self.lm_head(h).float()  # [n_out, vocab]
        return ForwardOutput(logits=logits, hidden=h if return_hidden else None)

    def _forward_invariant(self, batch: ForwardBatch, kv: KVCache, n_layers: int, return_hidden: bool) -> ForwardOutput:
        """The PyTorch forward with every batch-dependent op replaced (models/invariant.py)."""
        cfg, T = self.cfg, batch.input_ids.shape[0]
        h = self.embed[batch.input_ids]  # [T, hidden]
        cos, sin = self.rope.tables(batch.positions, self.dtype)  # [T, 1, d]
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for li, layer in enumerate(self.layers[:n_layers]):
            x = invariant.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
            qkv = invariant.linear(layer.qkv, x)  # [T, (nq + 2 nkv) d]
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q = apply_rotary(q.view(T, nq, d), cos, sin)
            k = apply_rotary(k.view(T, nkv, d), cos, sin)
            kv.write(li, batch.slot_mapping, k, v.view(T, nkv, d))
            o = invariant.attention(q, kv.k[li], kv.v[li], batch.attn, self.scale)  # [T, nq, d]
            h = h + invariant.linear(layer.o, o.reshape(T, nq * d))
            x = invariant.rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
            gate, up = invariant.linear(layer.gate_up, x).chunk(2, dim=-1)
            h = h + invariant.linear(layer.down, torch.nn.functional.silu(gate) * up)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        h = invariant.rms_norm(h, self.norm, cfg.rms_norm_eps)  # [n_out, hidden]
        logits = invariant.linear(self.lm_head, h).float()  # [n_out, vocab]
        return ForwardOutput(logits=logits, hidden=h if return_hidden else None)


def _quantized_modules(cfg: ModelConfig, sd: dict) -> dict[str, list[str]]:
    """{module: its GGUF formats} for the modules whose weights are all quantized blocks."""
    groups = {"embed": ["model.embed_tokens.weight"],
              "lm_head": ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        groups |= {f"layers.{i}.qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                   f"layers.{i}.o": [p + "self_attn.o_proj.weight"],
                   f"layers.{i}.gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                   f"layers.{i}.down": [p + "mlp.down_proj.weight"]}
    out = {}
    for module, names in groups.items():
        ws = [sd[n] for n in names]
        if all(isinstance(w, QuantWeight) for w in ws):
            out[module] = list(dict.fromkeys(w.format.name for w in ws))
    return out


def _want_kernels(use_kernels: bool | None, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    if use_kernels is False or (use_kernels is None and os.environ.get("AGENTRT_KERNELS", "1") == "0"):
        return False
    reason = kernel_support(cfg, dtype, device)
    if reason is not None and use_kernels:
        raise ModelLoadError(f"use_kernels=True but {reason}")
    return reason is None
