"""Model configuration: one frozen dataclass for every supported Llama-family model."""
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
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling; `kind == "llama3"` is the only scaled kind we run."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = d.get("model_type")
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(mt)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rs = d.get("rope_scaling") or (d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None)
            scaling = None
            if rs:
                kind = rs.get("rope_type", rs.get("type", "default"))
                if kind == "llama3":
                    scaling = RopeScaling(
                        kind="llama3",
                        factor=float(rs["factor"]),
                        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
                    )
                elif kind != "default":
                    raise ModelLoadError(f"{source}: unsupported rope_scaling type {kind!r} (supported: llama3)")
            theta = d.get("rope_theta")
            if theta is None and isinstance(d.get("rope_parameters"), dict):
                theta = d["rope_parameters"].get("rope_theta")
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta if theta is not None else 10000.0),
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
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
