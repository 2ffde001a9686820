"""A model's linears and token embedding on GGUF block-quantized weights, as drop-ins for
layers.Linear and the fp32 embedding table (agentrt/kernels/quant_linear.py runs them).

QuantLinear has no fused epilogue (as layers.Linear): norm, rotary, residual and SiLU gating stay
in the model's forward. Each linear is batch invariant (a row's bits do not depend on the other
rows) and differs from the fp32 product by the kernel's int8 activation rounding.
"""
from __future__ import annotations

import torch

from agentrt.kernels.quant_formats import QuantWeight
from agentrt.kernels import quant_linear as kernels


def _stack(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Row blocks of one format -> one weight (one kernel call); mixed formats stay separate."""
    if len(parts) == 1 or len({p.format for p in parts}) > 1 or len({p.shape[1] for p in parts}) > 1:
        return parts
    data = torch.cat([p.data for p in parts]).contiguous()
    return [QuantWeight(parts[0].format, (sum(p.shape[0] for p in parts), parts[0].shape[1]), data)]


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
