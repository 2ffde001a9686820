"""Attention over a paged KV cache for a ragged batch, in plain PyTorch.

Queries of each sequence are laid out as a padded [B, Qmax] grid and each sequence's context is
gathered from its blocks into a padded [B, Lmax] grid; one batched matmul pair then covers every
sequence, with an additive mask for causality and padding. Manual attention rather than SDPA:
bf16 SDPA is several times slower for one query on CPU (shared notes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    q_index: torch.Tensor  # [B, Qmax] row of T for each padded query slot (padding -> 0)
    out_index: torch.Tensor  # [T] position of each token in the flattened [B * Qmax] grid
    kv_index: torch.Tensor  # [B, Lmax] flat cache slot of each context position (padding -> 0)
    bias: torch.Tensor  # [B, 1, Qmax, 1, Lmax] float32: 0 where visible, -inf elsewhere


def build_attention_metadata(
    num_new: list[int],
    context_lens: list[int],
    positions: torch.Tensor,
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """num_new[b] new tokens of sequence b (flat order), whose context after this step is
    context_lens[b] tokens long; positions [T] are their absolute positions."""
    B = len(num_new)
    q_max, l_max = max(num_new), max(context_lens)
    q_index = torch.zeros(B, q_max, dtype=torch.long)
    out_index = torch.empty(sum(num_new), dtype=torch.long)
    q_pos = torch.zeros(B, q_max, dtype=torch.long)
    start = 0
    for b, n in enumerate(num_new):
        q_index[b, :n] = torch.arange(start, start + n)
        out_index[start : start + n] = torch.arange(b * q_max, b * q_max + n)
        q_pos[b, :n] = positions[start : start + n].cpu()
        start += n
    nb = (l_max + block_size - 1) // block_size
    tables = torch.zeros(B, nb, dtype=torch.long)
    for b, t in enumerate(block_tables):
        used = (context_lens[b] + block_size - 1) // block_size
        tables[b, :used] = torch.tensor(t[:used], dtype=torch.long)
    offs = torch.arange(l_max)
    kv_index = tables[:, offs // block_size] * block_size + offs % block_size  # [B, Lmax]
    # A query at position p sees context positions 0..p; padded queries (p = 0) see position 0.
    visible = offs.view(1, 1, l_max) <= q_pos.unsqueeze(-1)  # [B, Qmax, Lmax]
    bias = torch.zeros(B, q_max, l_max).masked_fill_(~visible, float("-inf"))
    return AttentionMetadata(
        q_index=q_index.to(device),
        out_index=out_index.to(device),
        kv_index=kv_index.to(device),
        bias=bias.view(B, 1, q_max, 1, l_max).to(device),
    )


def paged_attention(
    q: torch.Tensor,  # [T, nq, d], rotary already applied
    k_cache: torch.Tensor,  # [num_slots, nkv, d]
    v_cache: torch.Tensor,  # [num_slots, nkv, d]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, nq, d]
    B, q_max = meta.q_index.shape
    l_max = meta.kv_index.shape[1]
    nq, d = q.shape[1], q.shape[2]
    nkv = k_cache.shape[1]
    g = nq // nkv
    qp = q[meta.q_index.view(-1)].view(B, q_max, nkv, g, d)
    qp = qp.permute(0, 2, 1, 3, 4).reshape(B, nkv, q_max * g, d)
    flat = meta.kv_index.view(-1)
    k = k_cache[flat].view(B, l_max, nkv, d).permute(0, 2, 3, 1)  # [B, nkv, d, Lmax]
    v = v_cache[flat].view(B, l_max, nkv, d).permute(0, 2, 1, 3)  # [B, nkv, Lmax, d]
    scores = torch.matmul(qp, k).float().view(B, nkv, q_max, g, l_max) * scale
    probs = torch.softmax(scores + meta.bias, dim=-1).to(q.dtype).view(B, nkv, q_max * g, l_max)
    o = torch.matmul(probs, v).view(B, nkv, q_max, g, d)  # [B, nkv, Qmax, g, d]
    o = o.permute(0, 2, 1, 3, 4).reshape(B * q_max, nq, d)
    return o[meta.out_index]
