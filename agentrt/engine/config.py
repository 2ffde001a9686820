"""Model configuration: one frozen dataclass for every supported decoder family (Llama, Mistral,
Qwen2, Qwen3, Gemma 3): the Llama layout plus the features the later families add to it."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrt.errors import ModelLoadError

# Hugging Face `architectures` / `model_type` values we can run, mapped to our family tag.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "llama3" (Llama 3.1+: low frequencies divided by `factor`, a
    smooth ramp between) or "linear" (every frequency divided by `factor`; Gemma 3's global layers)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before rotary
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    # Gemma: norms scale by (1 + weight) in fp32, the attention and MLP outputs are normed too
    # (post_attention_layernorm, post_feedforward_layernorm; the MLP's input norm is
    # pre_feedforward_layernorm), and the embedding is multiplied by sqrt(hidden_size)
    gemma_norms: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    sliding_window: int | None = None  # a sliding layer's query at p sees positions p - window + 1 .. p
    layer_types: tuple[str, ...] = ()  # per layer FULL_ATTENTION or SLIDING_ATTENTION; () = all full
    rope_local_theta: float | None = None  # rotary base of the sliding layers (Gemma 3), else rope_theta
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def triton_gaps(self) -> list[str]:
        """The features of this model that the Triton layer ops do not implement: they run
        Llama-layout layers only. (The bf16 C kernels and the fused quantized decoder run every
        feature here: models/kernel_forward.py, models/quant_forward.py.)"""
        gaps = [("QK-norm", self.qk_norm), ("GeGLU", self.hidden_act != "silu"), ("Gemma norms", self.gemma_norms),
                ("sliding-window layers", SLIDING_ATTENTION in self.layer_types),
                ("a per-layer rotary base", self.rope_local_theta is not None),
                ("an attention scale other than head_dim ** -0.5", self.attention_scale != self.head_dim**-0.5),
                ("logit soft-capping", self.final_logit_softcapping is not None)]
        return [name for name, present in gaps if present]

    def num_params(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        norms = (4 if self.gemma_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + norms
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = _MODEL_TYPES.get(d.get("model_type"))
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            layers = int(d["num_hidden_layers"])
            full, local = _rope_params(d, arch)
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            gemma = arch == "gemma3"
            layer_types, window = _attention_layers(d, arch, layers, source)
            act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
            if act not in _ACTIVATIONS:
                raise ModelLoadError(f"{source}: unsupported activation {act!r} (supported: {sorted(_ACTIVATIONS)})")
            if d.get("attn_logit_softcapping") is not None:
                raise ModelLoadError(f"{source}: attention logit soft-capping is not supported (Gemma 2 models)")
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=full[0],
                rope_scaling=_rope_scaling(full[1], source),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
                attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
                qk_norm=arch in ("qwen3", "gemma3"),
                hidden_act=_ACTIVATIONS[act],
                gemma_norms=gemma,
                query_pre_attn_scalar=float(d["query_pre_attn_scalar"]) if gemma else None,
                sliding_window=window,
                layer_types=layer_types,
                rope_local_theta=local[0] if local is not None else None,
                final_logit_softcapping=(float(d["final_logit_softcapping"])
                                         if d.get("final_logit_softcapping") is not None else None),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            return cls.from_hf_dict(json.loads(Path(path).read_text()), source=str(path))
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _rope_params(d: dict[str, Any], arch: str) -> tuple[tuple[float, dict | None], tuple[float, dict | None] | None]:
    """((theta, scaling dict) of the full-attention layers, that of the sliding layers or None).

    Config files spell these three ways: `rope_theta` + `rope_scaling` (transformers 4), one
    `rope_parameters` dict (transformers 5), or, for Gemma 3, `rope_parameters` keyed by layer
    type (transformers 5) or `rope_theta` + `rope_local_base_freq` (transformers 4)."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full = params.get(FULL_ATTENTION) or {}
        local = params.get(SLIDING_ATTENTION)
        return ((float(full.get("rope_theta", 1e6)), full),
                (float(local.get("rope_theta", 1e4)), local) if local is not None else None)
    theta = d.get("rope_theta", params.get("rope_theta"))
    scaling = d.get("rope_scaling") or (params or None)
    if arch == "gemma3":
        return ((float(theta if theta is not None else 1e6), scaling),
                (float(d.get("rope_local_base_freq", 1e4)), None))
    return (float(theta if theta is not None else 10000.0), scaling), None


def _rope_scaling(rs: dict | None, source: str) -> RopeScaling | None:
    kind = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    raise ModelLoadError(f"{source}: unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


def _attention_layers(d: dict[str, Any], arch: str, layers: int, source: str) -> tuple[tuple[str, ...], int | None]:
    """(per-layer attention types, sliding window) from `layer_types`, Gemma 3's older
    `sliding_window_pattern` (every n-th layer full), or all full. Qwen2/3 configs carry a
    `sliding_window` they only use with `use_sliding_window`; Mistral's is not applied (as before)."""
    types = d.get("layer_types")
    window = d.get("sliding_window")
    if arch in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: use_sliding_window is not supported for {arch} models")
    if arch != "gemma3":
        if types and any(t != FULL_ATTENTION for t in types) and arch in ("qwen2", "qwen3"):
            raise ModelLoadError(f"{source}: layer_types other than {FULL_ATTENTION!r} are not supported for {arch}")
        return (), None
    if types is None:
        pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in types):
        raise ModelLoadError(f"{source}: layer_types must list {layers} entries of {FULL_ATTENTION!r} or "
                             f"{SLIDING_ATTENTION!r} (got {list(types)})")
    if SLIDING_ATTENTION in types and not (isinstance(window, int) and window > 0):
        raise ModelLoadError(f"{source}: sliding layers need a positive integer sliding_window (got {window!r})")
    return types, (int(window) if SLIDING_ATTENTION in types else None)
