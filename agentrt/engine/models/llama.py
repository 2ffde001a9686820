"""Our decoder for the Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) and the families built on
its layout: RMSNorm, RoPE, GQA attention, SwiGLU, tied embeddings; Qwen3 adds QK-norm; Gemma 3
adds QK-norm, GeGLU, Gemma's (1 + weight) norms around both attention and MLP, a scaled
embedding, sliding-window layers with their own rotary base, and logit soft-capping
(engine/config.py names each feature). No Hugging Face modeling code runs in the forward pass.

The forward takes a flattened ragged batch (every sequence's new tokens concatenated, with
`cu_seqlens` offsets), writes their K/V into the paged cache and attends over each sequence's
whole context through its block table. It returns logits for the requested rows only: decode
wants one row per sequence, speculative verification wants all k+1 rows.
"""
from __future__ import annotations

import logging
import os

import torch

from agentrt.engine.config import ModelConfig
from agentrt.engine.kv_cache import KVCache
from agentrt.engine.models.attention import AttentionMetadata, paged_attention  # noqa: F401  (re-export)
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput  # noqa: F401  (re-export)
from agentrt.engine.models import invariant
from agentrt.engine.models.kernel_forward import KernelDecoder, kernel_forward, kernel_support
from agentrt.engine.models.layers import Linear, RotaryEmbedding, apply_rotary, gemma_rms_norm, rms_norm
from agentrt.engine.models.quant_forward import QuantDecoder, cache_supported, quant_forward, quant_support
from agentrt.engine.models.quant_layers import QuantEmbedding, QuantLinear, gather_weights
from agentrt.errors import ModelLoadError
from agentrt.kernels.quant_formats import QuantWeight, dequantize

log = logging.getLogger(__name__)


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
        norm = _gemma_norm_weight if cfg.gemma_norms else (lambda t: t)  # noqa: E731
        self.attn_norm = norm(w("input_layernorm.weight"))
        # Gemma names the MLP's input norm pre_feedforward_layernorm and norms the attention output
        # with post_attention_layernorm, which is Llama's name for the MLP's input norm
        self.mlp_norm = norm(w("pre_feedforward_layernorm.weight" if cfg.gemma_norms else "post_attention_layernorm.weight"))
        self.attn_out_norm = norm(w("post_attention_layernorm.weight")) if cfg.gemma_norms else None
        self.mlp_out_norm = norm(w("post_feedforward_layernorm.weight")) if cfg.gemma_norms else None
        self.q_norm = norm(w("self_attn.q_norm.weight")) if cfg.qk_norm else None
        self.k_norm = norm(w("self_attn.k_norm.weight")) if cfg.qk_norm else None
        self.window = cfg.sliding_window if cfg.is_sliding(i) else None
        self.local_rope = cfg.is_sliding(i) and cfg.rope_local_theta is not None


def _gemma_norm_weight(w: torch.Tensor) -> torch.Tensor:
    """Gemma scales by (1 + weight) in fp32 (layers.gemma_rms_norm): kept so, whatever the weights'
    dtype (1 + w in bf16 would lose w's low bits)."""
    return (1.0 + w.float()).contiguous()


class _TorchOps:
    """The batch-dependent ops of the PyTorch forward: plain, or batch invariant (invariant.py)."""

    def __init__(self, cfg: ModelConfig, batch_invariant: bool):
        norm = gemma_rms_norm if cfg.gemma_norms else rms_norm
        eps = cfg.rms_norm_eps
        if batch_invariant:
            self.norm = lambda x, w: invariant.rms_norm(x, w, eps, norm)  # noqa: E731
            self.linear, self.attention = invariant.linear, invariant.attention
        else:
            self.norm = lambda x, w: norm(x, w, eps)  # noqa: E731
            self.linear = lambda layer, x: layer(x)  # noqa: E731
            self.attention = paged_attention


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
        positions = max_positions or cfg.max_position_embeddings
        self.rope = RotaryEmbedding(cfg, positions, self.device)
        self.local_rope = RotaryEmbedding(cfg, positions, self.device, local=True) if cfg.rope_local_theta else None
        self.scale = cfg.attention_scale
        # Gemma: HF multiplies the embedding rows by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype) if cfg.gemma_norms else None
        if cfg.gemma_norms:
            self.norm = _gemma_norm_weight(self.norm)
        self._kernels_packed = kernel
        self.kernels_enabled = kernel
        self.kernel_decoder = KernelDecoder(self) if kernel else None
        self.quant_decoder = QuantDecoder(self) if self.quantized and quant_support(self) is None else None
        if self.quantized and self.quant_decoder is None and cfg.fused_kernel_gaps():
            log.info("%s: each layer runs on the PyTorch path (its linears on the int8 kernels)", quant_support(self))
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
        """The PyTorch forward; batch_invariant replaces every batch-dependent op (models/invariant.py)."""
        if self._kernels_enabled:
            return kernel_forward(self, batch, kv, n_layers, return_hidden)
        cfg, T = self.cfg, batch.input_ids.shape[0]
        ops = _TorchOps(cfg, batch_invariant)
        h = self.embed[batch.input_ids]  # [T, hidden]
        if self.embed_scale is not None:
            h = h * self.embed_scale.to(h.dtype)
        ropes = {False: self.rope.tables(batch.positions, self.dtype)}  # [T, 1, d] cos, sin
        if self.local_rope is not None:
            ropes[True] = self.local_rope.tables(batch.positions, self.dtype)
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        act = _activation(cfg.hidden_act)
        for li, layer in enumerate(self.layers[:n_layers]):
            x = ops.norm(h, layer.attn_norm)
            qkv = ops.linear(layer.qkv, x)  # [T, (nq + 2 nkv) d]
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q, k = q.reshape(T, nq, d), k.reshape(T, nkv, d)
            if layer.q_norm is not None:  # over each head's vector, before rotary
                q = ops.norm(q.reshape(T * nq, d), layer.q_norm).view(T, nq, d)
                k = ops.norm(k.reshape(T * nkv, d), layer.k_norm).view(T, nkv, d)
            cos, sin = ropes[layer.local_rope]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            kv.write(li, batch.slot_mapping, k, v.view(T, nkv, d))
            o = ops.attention(q, kv.k[li], kv.v[li], batch.attn, self.scale, layer.window)  # [T, nq, d]
            o = ops.linear(layer.o, o.reshape(T, nq * d))
            h = h + (o if layer.attn_out_norm is None else ops.norm(o, layer.attn_out_norm))
            x = ops.norm(h, layer.mlp_norm)
            gate, up = ops.linear(layer.gate_up, x).chunk(2, dim=-1)
            m = ops.linear(layer.down, act(gate) * up)
            h = h + (m if layer.mlp_out_norm is None else ops.norm(m, layer.mlp_out_norm))
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        h = ops.norm(h, self.norm)  # [n_out, hidden]
        logits = ops.linear(self.lm_head, h).float()  # [n_out, vocab]
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return ForwardOutput(logits=logits, hidden=h if return_hidden else None)


def _activation(name: str):
    if name == "gelu_tanh":
        return lambda x: torch.nn.functional.gelu(x, approximate="tanh")
    return torch.nn.functional.silu


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
    if reason is not None and cfg.fused_kernel_gaps():
        log.info("%s: the PyTorch path runs it", reason)
    return reason is None
