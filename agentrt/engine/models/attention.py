"""Attention over a paged KV cache for a ragged batch: the step's layout (AttentionMetadata) and
the plain-PyTorch attention used for fp32, prefill-sized batches and machines without the C
kernels (agentrt/kernels/paged_attention.py has the kernel).

The PyTorch path lays the queries of each sequence out as a padded [B, Qmax] grid and gathers
each sequence's context from its blocks into a padded [B, Lmax] grid; one batched matmul pair
then covers every sequence, with an additive mask for causality and padding. Manual attention
rather than SDPA: bf16 SDPA is several times slower for one query on CPU
(122 vs 77 us a layer at batch 1, 830 vs 145 us at batch 8, SmolLM2-135M on a 2-core Xeon).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentrt.kernels.quant_decoder import TreeKeys


@dataclass
class AttentionGrid:
    """The padded layout of the PyTorch path, built on first use (the kernel path needs none)."""

    q_index: torch.Tensor  # [B, Qmax] row of T for each padded query slot (padding -> 0)
    out_index: torch.Tensor  # [T] position of each token in the flattened [B * Qmax] grid
    kv_index: torch.Tensor  # [B, Lmax] flat cache slot of each context position (padding -> 0)
    bias: torch.Tensor  # [B, 1, Qmax, 1, Lmax] float32: 0 where visible, -inf elsewhere
    q_pos: torch.Tensor  # [B, Qmax] position of each padded query slot (padding -> 0)
    context_lens: torch.Tensor  # [B] each sequence's context after this step
    block_tables: torch.Tensor  # [B, ceil(Lmax / block_size)]
    block_size: int
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # built on first use

    def layout(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_index [B, L], bias [B, 1, Qmax, 1, L]) of a layer that sees each query's last
        `window` positions (p - window + 1 .. p), or its whole causal context with window None.
        A sliding layer gathers from each sequence's first visible position on, so its L is at
        most window + Qmax - 1 however long the context (Gemma 3: 5 of 6 layers)."""
        if window is None:
            return self.kv_index, self.bias
        if window not in self.windows:
            self.windows[window] = self._window_layout(window)
        return self.windows[window]

    def _window_layout(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        device, bs = self.q_pos.device, self.block_size
        B, q_max = self.q_pos.shape
        first = (self.q_pos[:, 0] - window + 1).clamp(min=0)  # [B] the first position any query sees
        width = max(1, int((self.context_lens - first).max()))
        offs = first.view(-1, 1) + torch.arange(width, device=device)  # [B, L] absolute positions
        inside = offs < self.context_lens.view(-1, 1)
        safe = torch.where(inside, offs, 0)
        kv_index = self.block_tables.gather(1, safe // bs) * bs + safe % bs
        p = self.q_pos.unsqueeze(-1)  # [B, Qmax, 1]
        o = offs.unsqueeze(1)  # [B, 1, L]
        visible = inside.unsqueeze(1) & (o <= p) & (o > p - window)
        visible[:, :, 0] |= ~visible.any(-1)  # a padded query slot sees one position (its row is dropped)
        bias = torch.zeros(B, q_max, width, device=device).masked_fill_(~visible, float("-inf"))
        return kv_index, bias.view(B, 1, q_max, 1, width)


@dataclass
class AttentionMetadata:
    """Sequence b owns tokens cu_q[b]..cu_q[b+1] of the flat batch and blocks block_tables[b];
    a token at position p sees its sequence's positions 0..p. With `tree`, a token tree's node
    sees its path's own slots past the tree's base position instead of the table's (TreeKeys);
    the fused quantized decoder and the per-query PyTorch attention read it, and the padded
    path hands such a batch to the per-query one."""

    cu_q: torch.Tensor  # [B + 1] int64
    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, ceil(Lmax / block_size)] int64 (padding -> block 0)
    block_size: int
    q_max: int  # most new tokens of one sequence
    l_max: int  # longest context after this step
    tree: TreeKeys | None = None  # token trees' key paths; None: every token reads its block table
    _grid: AttentionGrid | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.cu_q.numel() - 1

    @property
    def grid(self) -> AttentionGrid:
        if self._grid is None:
            self._grid = _build_grid(self)
        return self._grid


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
    l_max = max(context_lens)
    nb = (l_max + block_size - 1) // block_size
    rows = []
    for t, n in zip(block_tables, context_lens):
        used = (n + block_size - 1) // block_size
        rows.append(t[:used] + [0] * (nb - used))
    cu = [0]
    for n in num_new:
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        cu_q=torch.tensor(cu, dtype=torch.long, device=device),
        positions=positions.to(device),
        block_tables=torch.tensor(rows, dtype=torch.long, device=device),
        block_size=block_size,
        q_max=max(num_new),
        l_max=l_max,
    )


def _build_grid(meta: AttentionMetadata) -> AttentionGrid:
    B, q_max, l_max, bs = meta.num_seqs, meta.q_max, meta.l_max, meta.block_size
    device = meta.cu_q.device
    starts, n = meta.cu_q[:-1], meta.cu_q[1:] - meta.cu_q[:-1]  # [B]
    j = torch.arange(q_max, device=device)
    valid = j.view(1, -1) < n.view(-1, 1)  # [B, Qmax]
    q_index = torch.where(valid, starts.view(-1, 1) + j, 0)
    T = meta.positions.numel()
    first = starts.repeat_interleave(n, output_size=T)  # [T] first row of each token's sequence
    seq_base = (torch.arange(B, device=device) * q_max).repeat_interleave(n, output_size=T)
    out_index = seq_base + torch.arange(T, device=device) - first
    q_pos = torch.where(valid, meta.positions[q_index], 0)  # [B, Qmax]
    offs = torch.arange(l_max, device=device)
    kv_index = meta.block_tables[:, offs // bs] * bs + offs % bs  # [B, Lmax]
    # A query at position p sees context positions 0..p; padded queries (p = 0) see position 0.
    visible = offs.view(1, 1, l_max) <= q_pos.unsqueeze(-1)  # [B, Qmax, Lmax]
    bias = torch.zeros(B, q_max, l_max, device=device).masked_fill_(~visible, float("-inf"))
    last = meta.cu_q[1:] - 1  # [B] each sequence's last new token
    return AttentionGrid(q_index, out_index, kv_index, bias.view(B, 1, q_max, 1, l_max), q_pos,
                         meta.positions[last] + 1, meta.block_tables, bs)


def paged_attention(
    q: torch.Tensor,  # [T, nq, d], rotary already applied
    k_cache: torch.Tensor,  # [num_slots, nkv, d]
    v_cache: torch.Tensor,  # [num_slots, nkv, d]
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # a sliding layer's window (see AttentionGrid.layout); None = causal
) -> torch.Tensor:  # [T, nq, d]
    assert meta.tree is None, "a token tree's attention is per query (invariant.attention)"
    grid = meta.grid
    kv_index, bias = grid.layout(window)
    B, q_max = grid.q_index.shape
    l_max = kv_index.shape[1]
    nq, d = q.shape[1], q.shape[2]
    nkv = k_cache.shape[1]
    g = nq // nkv
    qp = q[grid.q_index.view(-1)].view(B, q_max, nkv, g, d)
    qp = qp.permute(0, 2, 1, 3, 4).reshape(B, nkv, q_max * g, d)
    flat = kv_index.reshape(-1)
    # .to: a cache may hold another dtype than q (the quantized model's bf16 K/V)
    k = k_cache[flat].to(q.dtype).view(B, l_max, nkv, d).permute(0, 2, 3, 1)  # [B, nkv, d, Lmax]
    v = v_cache[flat].to(q.dtype).view(B, l_max, nkv, d).permute(0, 2, 1, 3)  # [B, nkv, Lmax, d]
    scores = torch.matmul(qp, k).float().view(B, nkv, q_max, g, l_max) * scale
    probs = torch.softmax(scores + bias, dim=-1).to(q.dtype).view(B, nkv, q_max * g, l_max)
    o = torch.matmul(probs, v).view(B, nkv, q_max, g, d)  # [B, nkv, Qmax, g, d]
    o = o.permute(0, 2, 1, 3, 4).reshape(B * q_max, nq, d)
    return o[grid.out_index]
