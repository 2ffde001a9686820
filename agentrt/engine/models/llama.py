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
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.attention import AttentionMetadata, paged_attention  # noqa: F401  (re-export)
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput  # noqa: F401  (re-export)
from agentrt.engine.models.kernel_forward import KernelDecoder, kernel_forward, kernel_support
from agentrt.engine.models.layer_ops import TorchLayerOps, TritonLayerOps, triton_support
from agentrt.engine.models.layers import Linear, RotaryEmbedding
from agentrt.engine.models.quant_forward import QuantDecoder, cache_supported, quant_forward, quant_support
from agentrt.engine.models.quant_layers import QuantEmbedding, QuantLinear, gather_weights
from agentrt.errors import ModelLoadError
from agentrt.kernels.backend import KernelBackend, choose_backend
from agentrt.kernels.quant_decoder import KV_DTYPE, quant_reserve
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


class LlamaModel:
    """Inference-only model. Weights come in Hugging Face names (see engine/loading/weights.py).

    use_kernels: run every batch on the C kernels (bf16 on CPUs
    with AMX; agentrt/engine/models/kernel_forward.py). None = whenever they can run here, unless
    AGENTRT_KERNELS=0; True = require them (ModelLoadError naming why not); False = PyTorch only.
    `kernels_enabled` switches between the two paths at run time (the weights stay packed).
    A quantized model runs on the fused quantized decoder wherever it can (quant_forward.py);
    `quant_fused` switches it off and on. Where the kernel backend of the model's device is
    Triton (kernels/backend.py: CUDA by default, or AGENTRT_KERNELS=triton), the layer loop runs
    on the Triton ops (models/layer_ops.py; linears stay torch matmuls): `triton_enabled`."""

    def __init__(self, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], max_positions: int | None = None,
                 use_kernels: bool | None = None):
        self.cfg = cfg
        emb = state_dict["model.embed_tokens.weight"]
        # GGUF blocks (loading/quantized.py): fp32 activations on the CPU, the C kernels off
        self.quantized = _quantized_modules(cfg, state_dict)
        if self.quantized:
            emb = QuantEmbedding(emb) if isinstance(emb, QuantWeight) else emb
            use_kernels = False
        self.device, self.dtype = emb.device, emb.dtype
        self.kernel_backend, self.triton_enabled = _kernel_backend(cfg, self.dtype, self.device, bool(self.quantized))
        kernel = _want_kernels(use_kernels, cfg, self.dtype, self.device, self.kernel_backend)
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
        if self.quantized and self.quant_decoder is None:
            log.info("%s: each layer runs on the PyTorch path (its linears on the int8 kernels)", quant_support(self))
        self.quant_fused = self.quant_decoder is not None
        # what the KV caches of this model hold: bf16 where the fused quantized decoder runs (the
        # kernels read and write only that; the PyTorch path reads it too), else the weights' dtype
        self.kv_dtype = KV_DTYPE if self.quant_decoder is not None else self.dtype

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

    def tree_attention(self, kv: KVCache) -> bool:
        """Whether a batch may carry token trees (AttentionMetadata.tree) on the path this model
        takes: the fused quantized decoder and the PyTorch attention read them; the bf16 C
        kernels and the Triton kernels do not (the engine drafts chains there)."""
        if self._quant_fused and not self._kernels_enabled and cache_supported(kv):
            return True
        return not self._kernels_enabled and not self.triton_enabled

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def reserve_step_buffers(self, tokens: int) -> None:
        """On the fused quantized path, its kernels' per-thread buffers sized and touched for a step
        of `tokens` tokens, on the calling thread (the one that runs the forwards)."""
        if self.quant_decoder is not None and self._quant_fused:
            quant_reserve(self.quant_decoder.dims, tokens)

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
        if batch.attn.tree is not None and not self.tree_attention(kv):
            raise ValueError("token trees need the fused quantized decoder or the PyTorch attention; this model runs "
                             "on the bf16 C or Triton kernels (draft chains: tree_width=1)")
        if self._quant_fused and not self._kernels_enabled and cache_supported(kv):
            # kernel calls on tensors that need no autograd: inference mode would only cost time
            return quant_forward(self, batch, kv, n_layers, return_hidden)
        return self._forward(batch, kv, n_layers, return_hidden, batch_invariant)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch, kv: KVCache, n_layers: int, return_hidden: bool,
                 batch_invariant: bool) -> ForwardOutput:
        """The layer loop over the Triton ops or the PyTorch ops (models/layer_ops.py); batch_invariant
        takes the PyTorch path with every batch-dependent op replaced (models/invariant.py)."""
        if self._kernels_enabled:
            return kernel_forward(self, batch, kv, n_layers, return_hidden)
        cfg, T = self.cfg, batch.input_ids.shape[0]
        ops = (TritonLayerOps(self, batch) if self.triton_enabled and not batch_invariant
               else TorchLayerOps(self, batch, batch_invariant))
        h = self.embed[batch.input_ids]  # [T, hidden]: the residual stream
        if self.embed_scale is not None:
            h = h * self.embed_scale.to(h.dtype)
        nq, d = cfg.num_attention_heads, cfg.head_dim
        pending = None  # the last sublayer's output, added to h by the next norm (fused there on Triton)
        for li, layer in enumerate(self.layers[:n_layers]):
            x, h = ops.add_norm(pending, h, layer.attn_norm)
            q = ops.rotary_kv_write(layer, li, ops.linear(layer.qkv, x), batch, kv)  # [T, nq, d]
            o = ops.attention(q, li, kv, batch.attn, self.scale, layer.window)  # [T, nq, d]
            o = ops.linear(layer.o, o.reshape(T, nq * d))
            x, h = ops.add_norm(o if layer.attn_out_norm is None else ops.norm(o, layer.attn_out_norm), h, layer.mlp_norm)
            m = ops.linear(layer.down, ops.gate(ops.linear(layer.gate_up, x)))
            pending = m if layer.mlp_out_norm is None else ops.norm(m, layer.mlp_out_norm)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
            pending = None if pending is None else pending[batch.logits_indices]
        h, _ = ops.add_norm(pending, h, self.norm)  # [n_out, hidden], final-normed
        logits = ops.linear(self.lm_head, h).float()  # [n_out, vocab]
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
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


def _kernel_backend(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, quantized: bool
                    ) -> tuple[KernelBackend, bool]:
    """The kernel family for this model's device (kernels/backend.py: AGENTRT_KERNELS, read now,
    when the model is built), and whether its layers run on the Triton ops. A model the Triton
    ops cannot run takes the PyTorch path, or is refused naming why when AGENTRT_KERNELS=triton."""
    try:
        choice = choose_backend(device)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if choice.backend is not KernelBackend.TRITON:
        return choice.backend, False
    reason = triton_support(cfg, dtype, quantized)
    if reason is not None and os.environ.get("AGENTRT_KERNELS", "").strip().lower() == "triton":
        raise ModelLoadError(f"AGENTRT_KERNELS=triton but {reason}")
    if reason is not None:
        log.info("%s: the PyTorch path runs it", reason)
    return choice.backend, reason is None


def _want_kernels(use_kernels: bool | None, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  backend: KernelBackend) -> bool:
    if use_kernels is False or (use_kernels is None and backend is not KernelBackend.CPU):
        return False
    reason = kernel_support(cfg, dtype, device)
    if reason is not None and use_kernels:
        raise ModelLoadError(f"use_kernels=True but {reason}")
    if reason is not None and device.type == "cpu" and dtype == torch.bfloat16:
        log.info("%s: the PyTorch path runs it", reason)
    return reason is None
