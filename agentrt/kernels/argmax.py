"""Row-wise argmax of float32 logits, greedy decoding's last op, optionally under a token bitmask
per row: the C kernel where it runs (csrc/cpu_argmax_f32.c: AVX-512, AVX2 or scalar), torch
elsewhere.

torch.argmax on CPU tracks an index per element (~0.06 ms per 49k-wide row: 2.5 ms for the 40
rows of a speculative batch step) and joins OpenMP threads, which stall when the other core is
busy; masking a copy of a row first (xgrammar's CPU apply_token_bitmask_inplace) costs ~0.4 ms
more. The kernel takes two vector passes per row, reading the mask bits as it goes, on the
kernels' own workers. Same result as the reference: the first maximal index after disallowed
entries are set to -inf, a NaN above everything.
"""
from __future__ import annotations

import ctypes

import torch

from agentrt.kernels.cpu_build import cpu_kernels
from agentrt.kernels.quant_build import quant_kernels


def unpack_bitmask(mask: torch.Tensor, cols: int) -> torch.Tensor:
    """[R, words] int32 (bit j of word w: column 32 w + j allowed) -> [R, cols] bool; columns
    past the mask are not allowed."""
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [R, words, 32]
    allowed = bits.reshape(mask.shape[0], -1).bool()
    if allowed.shape[1] < cols:
        allowed = torch.cat([allowed, allowed.new_zeros(mask.shape[0], cols - allowed.shape[1])], dim=1)
    return allowed[:, :cols]


def argmax_reference(x: torch.Tensor, mask: torch.Tensor | None = None,
                     mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, V] float32; mask [R, words] int32 bitmask rows; mask_rows [N] int64: the mask row
    each x row obeys, -1 for none (default: row i obeys mask row i). Returns [N] int64."""
    if mask is None:
        return x.argmax(dim=-1)
    if mask_rows is None:
        mask_rows = torch.arange(x.shape[0])
    masked = x.clone()
    sel = (mask_rows >= 0).nonzero().flatten()
    if len(sel):
        allowed = unpack_bitmask(mask[mask_rows[sel]], x.shape[1])
        masked[sel] = masked[sel].masked_fill(~allowed, -float("inf"))
    return masked.argmax(dim=-1)


def argmax_rows(x: torch.Tensor, mask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None,
                num_threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """argmax_reference's result; the kernel reads x [rows, cols] float32 with contiguous rows.
    It runs in the AMX library (AVX-512) or, without it, in the quantized kernels' (AVX2 or
    scalar); `lib` picks one (tests)."""
    lib = lib if lib is not None else (cpu_kernels() or quant_kernels())
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0
            or x.stride(1) != 1):
        return argmax_reference(x, mask, mask_rows)
    out = torch.empty(x.shape[0], dtype=torch.long)
    if mask is not None:
        mask = mask.to(torch.int32).contiguous()
        mask_rows = (torch.arange(x.shape[0]) if mask_rows is None else mask_rows).to(torch.long).contiguous()
        if mask_rows.shape != (x.shape[0],) or (len(mask_rows) and int(mask_rows.max()) >= mask.shape[0]):
            raise ValueError(f"argmax_rows: mask_rows must be [{x.shape[0]}] indices into the {mask.shape[0]} mask rows")
    lib.agentrt_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                           None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[1],
                           None if mask is None else mask_rows.data_ptr(), out.data_ptr(),
                           num_threads or torch.get_num_threads())
    return out
