"""A forward pass's input and output: a flat ragged batch in, the requested logits rows out."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.models.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    """One engine step's input. T = total new tokens, B = sequences."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot each new token's K/V is written to
    attn: AttentionMetadata  # ragged layout + block tables for attention
    logits_indices: torch.Tensor | None = None  # [n_out] rows of T to project; None = all


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [n_out, vocab] float32
    hidden: torch.Tensor | None = None  # [n_out, hidden] final-normed hidden states, when asked
