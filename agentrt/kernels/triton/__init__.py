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
    # Set before triton is first imported: triton.language's own @jit functions (tl.sum, tl.max,
    # tl.cumsum) are decorated at that import, and decorated for a GPU they fail when an
    # interpreted kernel calls them.
    _TRITON_ALREADY_IMPORTED = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if INTERPRETED:
    triton.knobs.runtime.interpret = True
    if _TRITON_ALREADY_IMPORTED and not isinstance(tl.standard.sum, triton.runtime.interpreter.InterpretedFunction):
        raise ImportError("agentrt.kernels.triton must be imported before triton on a machine without CUDA "
                          "(or run with TRITON_INTERPRET=1): triton.language was already set up to compile for a GPU")


def kernel_device() -> torch.device:
    """Where this process's Triton kernels take their tensors: the GPU, or the CPU when interpreted."""
    return torch.device("cpu") if INTERPRETED else torch.device("cuda")
