"""Linear layers and embedding lookups on GGUF-quantized weights (quant_formats.FORMATS): the C
kernel (csrc/cpu_quant_avx2.c, cpu_quant_k.c) where its library loads, else the PyTorch
references of quant_formats.py.

    quant_linear(x [M, K] fp32, w) -> [M, N] fp32     ~ x @ dequantize(w).T
    quant_embedding(ids [T], w)   -> [T, K] fp32     == dequantize(w)[ids]

The kernel quantizes activations to int8 blocks (as llama.cpp): its outputs differ from the
float reference by that rounding (bounded in tests/kernels/test_quant_linear.py and
test_quant_k.py), and are batch invariant: a row's bits do not depend on the other rows, M or
the thread count. `rows8(w)` interleaves a weight's rows by 8, the layout they run fastest
on (Q4_0, Q4_1, Q8_0; 1.3-2.5x against the file's layout, batch 1 to 16). The PyTorch
fallback computes in float and makes no batch-invariance promise (torch's matmul blocks by M).
"""
from __future__ import annotations

import ctypes

import torch

from agentrt.kernels.quant_build import quant_kernels
from agentrt.kernels.quant_formats import (ROWS8_FORMATS, QuantWeight, dequantize_rows, interleave_rows8,
                                           quant_linear_reference, rows8_shape)


def _on_cpu(what: str, **tensors: torch.Tensor | None) -> None:
    """The C kernels read host memory: anything else would be read through a bad pointer."""
    for name, t in tensors.items():
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be on the CPU, got {t.device}")


def _check_rc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: the kernel returned {rc}")


def quant_linear(
    x: torch.Tensor,  # [M, K] float32, rows may be strided (last dim contiguous)
    w: QuantWeight,  # [N, K]
    *,
    out: torch.Tensor | None = None,  # [M, N] float32, row stride free, last dim contiguous
    num_threads: int | None = None,
    lib: ctypes.CDLL | None = None,  # a given build (tests: the scalar one); default: quant_kernels()
) -> torch.Tensor:  # [M, N] float32
    n, k = w.shape
    _on_cpu("quant_linear", x=x, out=out, weight=w.data)
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"quant_linear: x must be [M, {k}] float32 with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if out is not None and (out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"quant_linear: out must be [{m}, {n}] float32, got {out.dtype} {tuple(out.shape)}")
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        y = quant_linear_reference(x, w)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.agentrt_quant_linear(x.data_ptr(), x.stride(0), m, w.data.data_ptr(), w.kernel_code, n, k,
                                  out.data_ptr(), out.stride(0), num_threads or torch.get_num_threads())
    _check_rc(rc, "quant_linear")
    return out


def quant_embedding(
    ids: torch.Tensor,  # [T] integer token ids
    w: QuantWeight,  # [vocab, K]
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [T, K] float32, exactly the dequantized rows
    _on_cpu("quant_embedding", ids=ids, weight=w.data)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    n, k = w.shape
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"quant_embedding: ids must lie in [0, {n})")
        return dequantize_rows(w, ids)
    out = torch.empty(len(ids), k, dtype=torch.float32)
    rc = lib.agentrt_quant_embedding(ids.data_ptr(), len(ids), w.data.data_ptr(), w.kernel_code, n, k,
                                     out.data_ptr(), out.stride(0))
    if rc == -2:  # the kernel checks every id before it writes
        raise IndexError(f"quant_embedding: ids must lie in [0, {n})")
    _check_rc(rc, "quant_embedding")
    return out


def rows8(w: QuantWeight, *, out: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> QuantWeight:
    """w with its rows interleaved by 8 (quant_formats.interleave_rows8), the layout the kernels
    read fastest, written into `out` (uint8 [rows8_shape(w.format, w.shape)], contiguous) when
    given; w itself when it has no such layout (the K-quants) or already is."""
    if w.rows8 or w.format not in ROWS8_FORMATS:
        return w
    shape = rows8_shape(w.format, w.shape)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"rows8: out must be contiguous uint8 {shape}, got {out.dtype} {tuple(out.shape)}")
    _on_cpu("rows8", weight=w.data, out=out)
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        out.copy_(interleave_rows8(w).data)
    else:
        n, k = w.shape
        _check_rc(lib.agentrt_quant_interleave(w.data.data_ptr(), w.format.ggml_type, n, k, out.data_ptr()), "rows8")
    return QuantWeight(w.format, w.shape, out, rows8=True)


def quant_activations(x: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own int8 activation blocks for x [M, K] float32: (q [M, K] int8, d [M, K/32]
    float32). For tests: they must equal quant_formats.quantize_activations(x)."""
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available on this machine (see agentrt.kernels.quant_build)")
    _on_cpu("quant_activations", x=x)
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"quant_activations: x must be 2-D float32 with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    _check_rc(lib.agentrt_quant_activations(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr()), "quant_activations")
    return q, d
