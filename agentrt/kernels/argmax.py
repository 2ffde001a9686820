"""Row-wise argmax of float32 logits, greedy decoding's last op: the C kernel where it runs
(csrc/cpu_argmax_f32.c), torch.argmax elsewhere.

torch.argmax on CPU tracks an index per element (~0.06 ms per 49k-wide row: 2.5 ms for the 40
rows of a speculative batch step) and joins OpenMP threads, which stall when the other core is
busy (8 ms for 10 rows measured under load); the kernel takes two vector passes per row on the
kernels' own workers. Same result: the first maximal index, a NaN above everything.
"""
from __future__ import annotations

import torch

from agentrt.kernels.cpu_build import cpu_kernels


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def argmax_rows(x: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """x [rows, cols] float32 -> [rows] int64."""
    lib = cpu_kernels()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0
            or x.stride(1) != 1):
        return argmax_reference(x)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.agentrt_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                           num_threads or torch.get_num_threads())
    return out
