"""Triton kernels: the GPU engine's ops, one op per module, each beside its pure-torch reference.

`@triton.jit` decides at decoration time whether a kernel compiles for a GPU or runs in Triton's
interpreter (numpy on CPU tensors), so the choice is made here, once, before any kernel module is
imported: with no CUDA device, or with TRITON_INTERPRET=1 in the environment, the interpreter runs
them. That is how the kernels are tested on CPU-only machines: loads, stores, masks and `tl.dot`
are exact in fp32 and fp16 there (`tl.dot` on bf16 inputs is not, so interpreter tests use fp32
and fp16; bf16 is for the GPU). TRITON_INTERPRET=0 keeps the kernels compiled even without a
device, for compiling them for a named GPU target ahead of time (tests/kernels/triton).
"""
from __future__ import annotations

import os
import sys

import torch

_ENV_INTERPRET = os.environ.get("TRITON_INTERPRET", "")
INTERPRETED: bool = _ENV_INTERPRET == "1" or (_ENV_INTERPRET != "0" and not torch.cuda.is_available())
if INTERPRETED:
    # Set before triton is first imported where we can: triton.language's own @jit functions
    # (tl.sum, tl.max, tl.cumsum) are decorated at that import, and decorated for a GPU they fail
    # when an interpreted kernel calls them (_interpret_triton_language rewraps them otherwise).
    _TRITON_ALREADY_IMPORTED = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402



def _interpret_triton_language() -> None:
    """Rewrap triton.language's own @jit functions for the interpreter, wherever triton.language
    holds them: its modules' attributes (tl.sum, tl.standard.max) and the closures of the tensor
    methods that call them (x.sum()). Needed when triton was imported before this module, as
    torch._dynamo's import does (transformers imports torch._dynamo): its functions were then
    decorated for a GPU, and a GPU JITFunction refuses to be called from an interpreted kernel."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        if id(fn) not in wrapped:
            wrapped[id(fn)] = InterpretedFunction(fn.fn)
        return wrapped[id(fn)]

    modules = [m for name, m in list(sys.modules.items()) if m is not None and name.startswith("triton.language")]
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, interpreted(value))
    for value in vars(tl.core.tensor).values():
        for cell in getattr(value, "__closure__", None) or ():
            if isinstance(cell.cell_contents, JITFunction):
                cell.cell_contents = interpreted(cell.cell_contents)


if INTERPRETED:
    triton.knobs.runtime.interpret = True
    if _TRITON_ALREADY_IMPORTED:
        _interpret_triton_language()


def kernel_device() -> torch.device:
    """Where this process's Triton kernels take their tensors: the GPU, or the CPU when interpreted."""
    return torch.device("cpu") if INTERPRETED else torch.device("cuda")
