"""Name or path -> a ready model and tokenizer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.models.llama import LlamaModel
from agentrt.engine.registry import ModelSource, resolve_model
from agentrt.engine.tokenizer import Tokenizer
from agentrt.engine.weights import load_state_dict
from agentrt.errors import ModelLoadError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


@dataclass
class LoadedModel:
    source: ModelSource
    model: LlamaModel
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.source.name


def load_model(name_or_path: str, dtype: str | torch.dtype = "bfloat16", device: str = "cpu", progress: bool = True) -> LoadedModel:
    dt = parse_dtype(dtype)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available")
    source = resolve_model(name_or_path, progress=progress)
    sd = load_state_dict(source.path, source.config, dt, device)
    return LoadedModel(source, LlamaModel(source.config, sd), Tokenizer.from_dir(source.path))
