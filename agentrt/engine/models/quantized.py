"""Load a GGUF's weights as they are stored: the quantized blocks run in our kernels (#24).

`load_quantized_model(cfg, gguf_path)` builds a LlamaModel straight from the file, with no
dequantized copy of a quantized tensor in memory:
- every 2-D tensor in a format agentrt.kernels.quant_formats knows (FORMAT_BY_GGML_TYPE) stays
  in its blocks, mapped from the file: the projections become QuantLinear (quant_layers.py),
  the token embedding a QuantEmbedding (lookups give exactly the dequantized rows), and the
  output head, the embedding's own blocks when tied, a QuantLinear;
- the rest (norms, F32/F16/BF16 tensors, a quantized format without a kernel) is dequantized
  to fp32 with gguf.quants, as engine/gguf_convert.py does for the float path.
Norms, rotary tables, attention and the KV cache run in fp32.

Names follow the converter: gguf_convert.hf_tensor_name maps GGUF to HF names, and Q/K rows get
gguf_convert.unpermute_rotary, applied to the quantized rows (a block runs along K, inside a row,
so permuting whole rows of blocks is exact). The tensor set is checked against the config as the
safetensors loader checks it (engine/weights.py): a missing or unknown tensor is an error that
names it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from agentrt.engine.gguf_convert import hf_tensor_name, unpermute_rotary
from agentrt.errors import ModelLoadError
from agentrt.kernels.quant_formats import FORMAT_BY_GGML_TYPE, QuantWeight, quant_weight_from_gguf


def _rotary_heads(name: str, cfg) -> int | None:
    """Heads whose rows llama.cpp permuted for its rotary layout (q and k), else None."""
    return {"self_attn.q_proj.weight": cfg.num_attention_heads,
            "self_attn.k_proj.weight": cfg.num_key_value_heads}.get(name.split(".", 3)[-1])


def read_gguf_weights(gguf_path: Path | str, cfg) -> dict[str, QuantWeight | torch.Tensor]:
    """HF name -> a QuantWeight (2-D tensors in a format with a kernel: the file's blocks, mapped;
    unpermuted Q/K rows are a copy) or an fp32 tensor (everything else, dequantized)."""
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - the gguf package raises plain ValueError/struct errors
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    out: dict[str, QuantWeight | torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        heads = _rotary_heads(name, cfg)
        if int(t.tensor_type) in FORMAT_BY_GGML_TYPE and len(t.shape) == 2:
            w = quant_weight_from_gguf(t)
            if heads is not None:
                w = QuantWeight(w.format, w.shape, torch.from_numpy(unpermute_rotary(w.data.numpy(), heads)))
            out[name] = w
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if heads is not None:
            a = unpermute_rotary(a, heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    return out


def load_quantized_model(cfg, gguf_path: Path | str, max_positions: int | None = None):
    """A CPU LlamaModel on the GGUF's own weights (see the module docstring). `model.quantized`
    maps each quantized module ("layers.3.qkv", "embed", "lm_head") to its formats."""
    from agentrt.engine.models.llama import LlamaModel
    from agentrt.engine.weights import check_tensor_set

    weights = read_gguf_weights(gguf_path, cfg)
    check_tensor_set(gguf_path, {name: tuple(w.shape) for name, w in weights.items()}, cfg)
    return LlamaModel(cfg, weights, max_positions=max_positions, use_kernels=False)
