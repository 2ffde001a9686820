"""Load a GGUF's weights as they are stored: the quantized blocks run in our kernels.

`load_quantized_model(cfg, gguf_path)` builds a LlamaModel straight from the file, with no
dequantized copy of a quantized tensor in memory:
- every 2-D tensor in a format agentrt.kernels.quant_formats knows (FORMAT_BY_GGML_TYPE) stays
  in its blocks, mapped from the file: the projections become QuantLinear (quant_layers.py),
  the token embedding a QuantEmbedding (lookups give exactly the dequantized rows), and the
  output head, the embedding's own blocks when tied, a QuantLinear;
- the rest (norms, F32/F16/BF16 tensors, a quantized format without a kernel) is dequantized
  to fp32 with gguf.quants, as engine/loading/gguf_convert.py does for the float path.
Norms, rotary tables, attention and the KV cache run in fp32.

The tensors are found through the tensor table the conversion cached (gguf_convert.tensor_table),
so a start maps the file without parsing its metadata again; the table is checked against the
file's header and size.

Names follow the converter: gguf_convert.hf_tensor_name maps GGUF to HF names, and Q/K rows get
gguf_convert.unpermute_rotary, applied to the quantized rows (a block runs along K, inside a row,
so permuting whole rows of blocks is exact). The tensor set is checked against the config as the
safetensors loader checks it (engine/loading/weights.py): a missing or unknown tensor is an error that
names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrt.engine.loading.gguf_convert import ROPE_FREQS, hf_float_tensor, hf_tensor_name, unpermute_rotary
from agentrt.errors import ModelLoadError
from agentrt.kernels.quant_formats import FORMAT_BY_GGML_TYPE, QuantWeight, quant_weight_from_gguf


def gguf_arch(cfg) -> str:
    """The GGUF architecture a ModelConfig's family is stored as (Mistral and Qwen2 GGUFs convert
    to the llama layout here)."""
    return cfg.architecture if cfg.architecture in ("qwen3", "gemma3") else "llama"


def _rotary_heads(name: str, cfg) -> int | None:
    """Heads whose rows llama.cpp permuted for its rotary layout (Llama's q and k), else None."""
    if gguf_arch(cfg) != "llama":
        return None
    return {"self_attn.q_proj.weight": cfg.num_attention_heads,
            "self_attn.k_proj.weight": cfg.num_key_value_heads}.get(name.split(".", 3)[-1])


@dataclass(frozen=True)
class MappedTensor:
    """The fields of a gguf.ReaderTensor the loader reads, with the same meaning."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims innermost first
    data: np.ndarray  # a view of the file: its elements (float/int types) or bytes [..., row bytes]


def mapped_tensors(gguf_path: Path | str, table: dict) -> list[MappedTensor]:
    """The tensors `table` (gguf_convert.tensor_table of this file) lists, as views of the file
    mapped read-only, shaped as gguf.GGUFReader shapes them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    plain = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}
    mm = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    header = mm[:24].tobytes()
    entries = table["tensors"]
    if (len(header) < 24 or header[:4] != b"GGUF" or int.from_bytes(header[8:16], "little") != len(entries)
            or any(e["offset"] + e["n_bytes"] > mm.size for e in entries)):
        raise ModelLoadError(f"{gguf_path}: the file does not match its cached tensor table; delete the cached "
                             "conversion (agentrt models) to read it again")
    out = []
    for e in entries:
        ggml_type = GGMLQuantizationType(e["type"])
        np_dims = tuple(reversed(e["shape"]))
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        raw = mm[e["offset"]: e["offset"] + e["n_bytes"]]
        if ggml_type.name in plain:
            data = raw.view(plain[ggml_type.name]).reshape(np_dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
        out.append(MappedTensor(e["name"], ggml_type, np.asarray(e["shape"], dtype=np.uint32), data))
    return out


def read_gguf_weights(gguf_path: Path | str, cfg, table: dict) -> dict[str, QuantWeight | torch.Tensor]:
    """HF name -> a QuantWeight (2-D tensors in a format with a kernel: the file's blocks, mapped;
    unpermuted Q/K rows are a copy) or an fp32 tensor (everything else, dequantized)."""
    from gguf.quants import dequantize

    out: dict[str, QuantWeight | torch.Tensor] = {}
    arch = gguf_arch(cfg)
    for t in mapped_tensors(gguf_path, table):
        if t.name == ROPE_FREQS:  # read into the configuration (rope_scaling)
            continue
        name = hf_tensor_name(t.name, arch)
        heads = _rotary_heads(name, cfg)
        if int(t.tensor_type) in FORMAT_BY_GGML_TYPE and len(t.shape) == 2:
            w = quant_weight_from_gguf(t)
            if heads is not None:
                w = QuantWeight(w.format, w.shape, torch.from_numpy(unpermute_rotary(w.data.numpy(), heads)))
            out[name] = w
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        a = hf_float_tensor(name, a, arch, cfg.num_attention_heads, cfg.num_key_value_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    return out


def load_quantized_model(cfg, gguf_path: Path | str, table: dict, max_positions: int | None = None):
    """A CPU LlamaModel on the GGUF's own weights (see the module docstring). `model.quantized`
    maps each quantized module ("layers.3.qkv", "embed", "lm_head") to its formats."""
    from agentrt.engine.models.llama import LlamaModel
    from agentrt.engine.loading.weights import check_tensor_set

    weights = read_gguf_weights(gguf_path, cfg, table)
    check_tensor_set(gguf_path, {name: tuple(w.shape) for name, w in weights.items()}, cfg)
    return LlamaModel(cfg, weights, max_positions=max_positions, use_kernels=False)
