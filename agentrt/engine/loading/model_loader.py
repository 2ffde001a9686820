"""Name or path -> a ready model and tokenizer."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.engine.loading.gguf_convert import TENSOR_TABLE
from agentrt.engine.models.layers import onednn_bf16
from agentrt.engine.models.llama import LlamaModel
from agentrt.engine.loading.registry import ModelSource, find_model_gguf, resolve_model
from agentrt.engine.chat.tokenizer import Tokenizer
from agentrt.engine.loading.weights import load_state_dict
from agentrt.errors import ModelLoadError
from agentrt.kernels import quant_build

log = logging.getLogger(__name__)
QUANTIZED = "quantized"  # the dtype that runs a GGUF's blocks as they are

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def default_dtype(device: str = "cpu") -> torch.dtype:
    """What dtype "auto" means: bf16 where the hardware multiplies bf16 natively (a CUDA GPU with
    bf16; a CPU with AMX or AVX512 bf16 paths in oneDNN), else fp32 on CPUs (fp16 on older GPUs).
    On an AVX2-only CPU bf16 matmuls are emulated: measured on a 2-core AMD EPYC, a 1536x576
    linear took 0.13 ms (bf16) vs 0.21 ms (fp32) for one row but 30 vs 4 ms for 256 rows, and
    serving four clients ran 4x faster in fp32 (agentrt bench serve --part chat --dtype ...)."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if onednn_bf16() else torch.float32


def parse_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return default_dtype(device)
    if name == QUANTIZED:
        raise ModelLoadError("dtype 'quantized' is a way to load a GGUF (load_model), not a tensor dtype")
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; choose auto, quantized or one of {sorted(DTYPES)}") from None


@dataclass
class LoadedModel:
    source: ModelSource
    model: LlamaModel
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def weights(self) -> str:
        """What the weights are: "quantized" (the GGUF's blocks) or the float dtype's name."""
        return QUANTIZED if self.model.quantized else str(self.model.dtype).removeprefix("torch.")

    @property
    def precision(self) -> str:
        """What runs, in the words every place that shows it uses (serve's banner, `agentrt run`
        and `generate`, traces, the console, /v1/models): for a GGUF run as it is stored, its
        block formats (the loaded tensors' own types), what multiplies them, the activations'
        dtype and the KV cache's where it differs, e.g. "GGUF Q4_1/Q8_0, int8 kernels, float32
        activations, bfloat16 K/V"; for a float model, its
        dtype ("bfloat16"), and the GGUF it was dequantized from, if any."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        if self.model.quantized:
            # without the kernels, QuantLinear dequantizes the blocks at every call (quant_layers.py)
            how = "int8 kernels" if quant_build.quant_kernels() is not None else "dequantized at each call"
            kv = str(self.model.kv_dtype).removeprefix("torch.")
            return f"GGUF {gguf_formats(self.model)}, {how}, {dtype} activations" + (f", {kv} K/V" if kv != dtype else "")
        return f"{dtype} (dequantized from GGUF)" if self.source.gguf is not None else dtype


def gguf_formats(model: LlamaModel) -> str:
    """The GGUF block formats of a quantized model's weights, e.g. "Q4_1/Q8_0"."""
    return "/".join(sorted({f for formats in model.quantized.values() for f in formats}))


def runs_quantized(dtype: str | torch.dtype, device: str, gguf: Path | None, what: str) -> bool:
    """Whether `what` (a model name or path) loads as the GGUF's quantized blocks: asked for by
    dtype "quantized", and the default ("auto") for a GGUF on the CPU wherever the quantized
    kernels build (without them the blocks would be dequantized at every call)."""
    if dtype == QUANTIZED:
        if gguf is None:
            raise ModelLoadError(f"dtype 'quantized' runs a GGUF file's own weights; {what!r} is not a GGUF "
                                 "(give a known model name or a .gguf path, or a float dtype)")
        if not str(device).startswith("cpu"):
            raise ModelLoadError(f"quantized weights run on the CPU only, not on {device!r}; use --dtype bfloat16 there")
        if quant_build.quant_kernels() is None:
            log.warning("quantized kernels unavailable (%s): the blocks are dequantized at every call, slowly",
                        quant_build.unsupported_reason())
        return True
    return (dtype == "auto" and gguf is not None and str(device).startswith("cpu")
            and quant_build.quant_kernels() is not None)


def load_model(name_or_path: str, dtype: str | torch.dtype = "auto", device: str = "cpu", progress: bool = True) -> LoadedModel:
    """A known model name, a .gguf file or an HF directory, ready to run. dtype "auto": a GGUF's
    quantized blocks (see runs_quantized), else the hardware's float dtype (default_dtype);
    "quantized"; or a float dtype (a GGUF is then dequantized once into a cached HF directory)."""
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device {device!r} is not a device torch knows (cpu, cuda, cuda:N)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available")
    if runs_quantized(dtype, device, find_model_gguf(name_or_path), name_or_path):
        from agentrt.engine.loading.quantized import load_quantized_model

        source = resolve_model(name_or_path, progress=progress, weights=False)
        table = json.loads((source.path / TENSOR_TABLE).read_text())
        return LoadedModel(source, load_quantized_model(source.config, source.gguf, table),
                           Tokenizer.from_dir(source.path))
    dt = parse_dtype(dtype, device)
    source = resolve_model(name_or_path, progress=progress)
    sd = load_state_dict(source.path, source.config, dt, device)
    return LoadedModel(source, LlamaModel(source.config, sd), Tokenizer.from_dir(source.path))
