"""Command-line options every command that loads a model shares, and the engine's typed config
(EngineConfig) made from them (no torch import until a config is made: `--help` stays fast)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from agentrt.structured.tool_formats import FORMATS

if TYPE_CHECKING:  # torch loads only when a config is made
    from agentrt.engine.llm_engine import EngineConfig

DTYPE_CHOICES = ("auto", "quantized", "bfloat16", "float32")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--dtype, --batch-invariant, --device and --no-cuda-graphs."""
    add_dtype_argument(p)
    p.add_argument("--batch-invariant", action="store_true",
                   help="greedy output independent of the batch and of speculation. The bf16 AMX kernels and "
                        "the quantized decoder are invariant anyway; on the PyTorch path (fp32, bf16 without AMX) "
                        "every op is made so, several times slower")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="launch every step's kernels from Python: no decode or verify step replayed from a captured "
                        "CUDA graph (by default they are, where a CUDA model runs the Triton kernels)")


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: a GGUF model (the embedded one, a .gguf path) runs its quantized blocks in our "
                        "int8 kernels; other models bf16 where the hardware multiplies bf16 natively, else fp32. "
                        "quantized: require the GGUF's blocks. bfloat16/float32: dequantize a GGUF once, run in float")


def add_tool_format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-format", default="auto", choices=("auto", *FORMATS),
                   help="the syntax tool calls are described, constrained and parsed in: auto reads it from the "
                        "model's chat template and architecture (Qwen <tool_call> blocks, Llama 3 JSON, Gemma 3's "
                        "JSON prompt, Mistral [TOOL_CALLS]; templates without tools: the house JSON format)")


def engine_config(args: argparse.Namespace, spec: dict[str, Any] | None = None, **engine: Any) -> EngineConfig:
    """The EngineConfig of a command's --model, --dtype, --device, --spec, --batch-invariant,
    --no-cuda-graphs and --tool-format (the last three where the command has them); `spec` and `engine`: further
    SpecConfig and EngineConfig fields."""
    from agentrt.engine import EngineConfig, SpecConfig

    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        spec=SpecConfig(drafter=getattr(args, "spec", "none"), **(spec or {})),
                        batch_invariant=getattr(args, "batch_invariant", False),
                        cuda_graphs=getattr(args, "cuda_graphs", None),
                        tool_format=getattr(args, "tool_format", "auto"), **engine)
