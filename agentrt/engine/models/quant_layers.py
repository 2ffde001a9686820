"""A model's linears and token embedding on GGUF block-quantized weights, as drop-ins for
layers.Linear and the fp32 embedding table (agentrt/kernels/quant_linear.py runs them), and
`gather_weights`, which lays them out for the kernels' speed.

QuantLinear has no fused epilogue (as layers.Linear): norm, rotary, residual and SiLU gating stay
in the model's forward. Each linear is batch invariant (a row's bits do not depend on the other
rows) and differs from the fp32 product by the kernel's int8 activation rounding.
"""
from __future__ import annotations

import math

import torch

from agentrt.kernels.quant_formats import ROWS8_FORMATS, QuantWeight, deinterleave_rows8, rows8_shape
from agentrt.kernels import quant_linear as kernels
from agentrt.kernels.quant_linear import rows8


def _stack(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Row blocks of one format and layout -> one weight (one kernel call); others stay separate."""
    if len(parts) == 1 or len({(p.format, p.rows8, p.shape[1]) for p in parts}) > 1:
        return parts
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    if parts[0].rows8 and any(p.shape[0] % 8 for p in parts[:-1]):  # groups of 8 would straddle two parts
        return [rows8(QuantWeight(parts[0].format, shape, torch.cat([deinterleave_rows8(p).data for p in parts])))]
    return [QuantWeight(parts[0].format, shape, torch.cat([p.data for p in parts]).contiguous(), parts[0].rows8)]


class QuantLinear:
    """y = x W^T (+ b) with W in GGUF blocks, for layers.Linear's callers: [..., K] -> [..., N].

    Input of any float dtype and layout (made fp32 and row-contiguous); output fp32. Several
    parts (row blocks in different formats) run one kernel call each, into one output."""

    kernel = None  # the bf16 AMX kernel's packed weight: none (a quantized model runs its own kernels)
    batch_invariant = True  # each row's bits are its own (quant_linear): models/invariant.py need not pad

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None):
        self.parts = _stack(list(parts))
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.bias = bias

    @property
    def formats(self) -> list[str]:
        return [p.format.name for p in self.parts]

    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or x2.stride(1) != 1:
            x2 = x2.float().contiguous()
        if len(self.parts) == 1:
            y = kernels.quant_linear(x2, self.parts[0])
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            n0 = 0
            for p in self.parts:
                kernels.quant_linear(x2, p, out=y[:, n0 : n0 + p.shape[0]])
                n0 += p.shape[0]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.view(*lead, self.out_features)


class QuantEmbedding:
    """The token embedding table in GGUF blocks: `embed[ids]` -> [*ids.shape, hidden] fp32, the
    dequantized rows exactly (what LlamaModel.forward does with an fp32 table)."""

    def __init__(self, weight: QuantWeight):
        self.weight = weight
        self.shape = torch.Size(weight.shape)
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        return kernels.quant_embedding(ids, self.weight).view(*ids.shape, self.shape[1])

    def nbytes(self) -> int:
        return self.weight.data.numel()


def _gathered(w: QuantWeight, out: torch.Tensor) -> QuantWeight:
    """w into out (uint8, exactly its bytes): interleaved by 8 where the format has that layout."""
    if w.format in ROWS8_FORMATS:
        return rows8(w, out=out.view(rows8_shape(w.format, w.shape)))
    return QuantWeight(w.format, w.shape, out.view(w.data.shape).copy_(w.data))


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64  # each weight starts on a cache line


def gather_weights(linears: list[QuantLinear], embedding: QuantEmbedding | None) -> torch.Tensor | None:
    """Every quantized weight of these modules copied into one buffer on transparent huge pages,
    Q4_0/Q4_1/Q8_0 with their rows interleaved by 8 (quant_linear.rows8), the modules then
    reading them there; a weight shared by two modules (a tied head and embedding) stays one.
    Returns the buffer (the weights hold views of it), or None where the C kernels do not run.

    Why: a batch-1 step streams every weight from DRAM once, and on 4 KB pages the TLB misses
    cost ~12% of the 30 layers' linears (2.8-2.9 ms against 3.1-3.3 ms, SmolLM2's Q4_1, 2-core EPYC);
    the interleaved layout runs 1.3-2.5x faster than the file's. ~0.15 s for 100 MB."""
    from agentrt.engine.kv.kv_cache import cache_buffer  # an anonymous mapping with MADV_HUGEPAGE

    if kernels.quant_kernels() is None:
        return None
    weights: dict[int, QuantWeight] = {}
    for w in [p for lin in linears for p in lin.parts] + ([embedding.weight] if embedding is not None else []):
        weights.setdefault(id(w), w)
    nbytes = {key: math.prod(rows8_shape(w.format, w.shape)) if w.format in ROWS8_FORMATS else w.data.numel()
              for key, w in weights.items()}
    buf = cache_buffer((sum(map(_aligned, nbytes.values())),), torch.uint8, "cpu")
    moved, offset = {}, 0
    for key, w in weights.items():
        moved[key] = _gathered(w, buf[offset: offset + nbytes[key]])
        offset += _aligned(nbytes[key])
    for lin in linears:
        lin.parts = [moved[id(p)] for p in lin.parts]
    if embedding is not None:
        embedding.weight = moved[id(embedding.weight)]
    return buf
