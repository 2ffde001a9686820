"""Helpers of the quantized-kernel tests (registered as module `quant_helpers` by tests/conftest.py)."""
from __future__ import annotations

import gguf
import torch


def qtype(fmt) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(fmt.ggml_type)


def activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:  # [m, k] float32
    """Gaussian rows with LLM-like outlier channels (x20), and row 1 zero when m > 2 (amax = 0 blocks)."""
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (max(1, k // 64),), generator=g)] *= 20
    if m > 2:
        x[1] = 0
    return x
