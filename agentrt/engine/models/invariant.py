"""The batch-invariant PyTorch path (EngineConfig.batch_invariant): each token's arithmetic is
the same whatever else is in the step, so greedy output does not change with speculation, the
batch around a request, chunked prefill or cache hits, on machines without the C kernels (which
are invariant by construction, at no cost).

Why the plain path is not: a library matmul picks its kernel, blocking and threading by the
matrix sizes (a row of a 1-row product and of a 64-row product can differ in the last bit), and
the padded attention grid reduces over the longest context in the batch, not the query's own.

How this path avoids both, using only ops whose shapes do not depend on the batch:
- linears and RMSNorm run on blocks of exactly ROWS rows (the last block zero-padded), so every
  call has one shape; within it a row's result depends on that row alone (checked for every
  linear shape of the model in tests/engine/test_batch_invariant_torch.py);
- attention runs per query over that query's own context (positions 0..p): scores, softmax and
  the weighted sum have shapes that depend on p only (computed in fp32 whatever the dtype).
The cost (measured by `agentrt bench decode --determinism --batch-invariant`): a 1-row decode step
computes ROWS rows, and queries are not batched.
"""
from __future__ import annotations

import torch

from agentrt.engine.models.attention import AttentionMetadata
from agentrt.kernels.linear import rms_norm_reference

ROWS = 16


def _blocks(x: torch.Tensor, fn) -> torch.Tensor:
    """fn over x [T, K] in blocks of exactly ROWS rows (the last one zero-padded), -> [T, N]."""
    T = x.shape[0]
    if T == 0:
        return fn(x)
    padded = (T + ROWS - 1) // ROWS * ROWS
    if padded != T:
        x = torch.cat([x, x.new_zeros(padded - T, x.shape[1])])
    return torch.cat([fn(x[i : i + ROWS]) for i in range(0, padded, ROWS)])[:T]


def linear(layer, x: torch.Tensor) -> torch.Tensor:
    """layer(x) (a layers.Linear) row-block by row-block: [T, K] -> [T, N]. A layer that is
    invariant by construction (quant_layers.QuantLinear: its kernel computes each row alone)
    runs on x as it is, without the padded rows."""
    if getattr(layer, "batch_invariant", False):
        return layer(x)
    return _blocks(x, layer)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, norm=rms_norm_reference) -> torch.Tensor:
    """norm (Llama's RMSNorm, or layers.gemma_rms_norm) row-block by row-block."""
    return _blocks(x, lambda b: norm(b, weight, eps))


def attention(
    q: torch.Tensor,  # [T, nq, d], rotary applied
    k_cache: torch.Tensor,  # [num_slots, nkv, d]
    v_cache: torch.Tensor,  # [num_slots, nkv, d]
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, nq, d]
    """Each query over its own context, positions 0..p (a sliding layer: the last `window` of
    them): shapes depend on p (and the window) alone. A token tree's node (meta.tree) reads its
    path's slots past the tree's base: the same keys, in the same layout, as its path fed as a
    chain, so its bits are the chain's."""
    T, nq, d = q.shape
    nkv = k_cache.shape[1]
    g = nq // nkv
    bs = meta.block_size
    out = torch.empty_like(q)
    cu = meta.cu_q.tolist()
    positions = meta.positions.tolist()
    tree_base = meta.tree.base.tolist() if meta.tree is not None else [p + 1 for p in positions]
    for b in range(meta.num_seqs):
        rows = range(cu[b], cu[b + 1])
        if not rows:
            continue
        length = max(min(positions[t] + 1, tree_base[t]) for t in rows)  # the table's part of the context
        offs = torch.arange(length, device=q.device)
        slots = meta.block_tables[b, offs // bs] * bs + offs % bs
        # in fp32 (exact for bf16 inputs): CPU bf16 batched matmuls of these small shapes are slow
        k = k_cache[slots].float().permute(1, 2, 0)  # [nkv, d, L]: strides independent of L
        v = v_cache[slots].float().permute(1, 0, 2)  # [nkv, L, d]
        qf = q[rows.start : rows.stop].float()
        for t in rows:
            n = positions[t] + 1
            kt, vt = k, v
            if tree_base[t] < n:  # a tree node: the table's keys up to the base, then its path's
                path = meta.tree.path_slots[t, : n - tree_base[t]].to(slots.device)
                own = torch.cat([slots[: tree_base[t]], path])
                kt, vt = k_cache[own].float().permute(1, 2, 0), v_cache[own].float().permute(1, 0, 2)
            first = max(0, n - window) if window is not None else 0
            scores = torch.bmm(qf[t - rows.start].view(nkv, g, d), kt[:, :, first:n]) * scale  # [nkv, g, n - first]
            probs = torch.softmax(scores, dim=-1)
            out[t] = torch.bmm(probs, vt[:, first:n]).view(nq, d).to(q.dtype)
    return out
