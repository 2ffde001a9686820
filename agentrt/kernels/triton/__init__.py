"""Triton kernels: the GPU engine's ops, one op per module, each beside its pure-torch reference.

`@triton.jit` decides at decoration time whether a kernel compiles for a GPU or runs in Triton's
interpreter (numpy on CPU tensors), so the choice is made here, once, before any kernel module is
imported: with no CUDA device, or with TRITON_INTERPRET=1 in the environment, the interpreter runs
them. That is how the kernels are tested on CPU-only machines: loads, stores, masks and `tl.dot`
are exact in fp32 and fp16 there (`tl.dot` on bf16 inputs is not, so interpreter tests use fp32
and fp16; bf16 is for the GPU).
"""
from __future__ import annotations

import os

import torch
import triton

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "") == "1" or not torch.cuda.is_available()
if INTERPRETED:
    triton.knobs.runtime.interpret = True


def kernel_device() -> torch.device:
    """Where this process's Triton kernels take their tensors: the GPU, or the CPU when interpreted."""
    return torch.device("cpu") if INTERPRETED else torch.device("cuda")
