"""A plain streaming read of a buffer on the kernels' threads (csrc/cpu_stream_read.c): the read
floor that `agentrt bench decode` sets a memory-bound decode step against, measured on the same
threads and the same kind of memory (huge pages) as the step's weights."""
from __future__ import annotations

import ctypes
import time

import torch

from agentrt.kernels.quant_build import quant_kernels


def stream_read_reference(buf: torch.Tensor) -> int:
    """The sum of buf's bytes, mod 2^64."""
    return int(buf.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) % (1 << 64)


def stream_read(buf: torch.Tensor, num_threads: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """stream_read_reference(buf), read by the C kernel where it runs (buf contiguous, on CPU)."""
    lib = lib if lib is not None else quant_kernels()
    if lib is None or buf.device.type != "cpu" or not buf.is_contiguous():
        return stream_read_reference(buf)
    return int(lib.agentrt_stream_read(buf.data_ptr(), buf.numel() * buf.element_size(),
                                       num_threads or torch.get_num_threads()))


def stream_read_seconds(buf: torch.Tensor, num_threads: int | None = None) -> float:
    """Wall time of one plain read of buf's bytes: stream_read where the kernel runs, else torch's
    fp32 sum over them (the fastest torch read, but it sums the bytes as floats: give it a buffer
    of normal floats, since denormal adds are slow on some CPUs)."""
    lib = quant_kernels()
    flat = buf.reshape(-1).view(torch.uint8)
    t0 = time.perf_counter()
    if lib is not None and buf.device.type == "cpu":
        lib.agentrt_stream_read(flat.data_ptr(), flat.numel(), num_threads or torch.get_num_threads())
    else:
        flat[: flat.numel() // 4 * 4].view(torch.float32).sum()
    return time.perf_counter() - t0
