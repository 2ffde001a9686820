"""Decode and verify steps replayed from captured graphs: one launch per step instead of a few
hundred kernel launches from Python (CUDA graphs, for the Triton path on a GPU).

A step of B sequences, each feeding at most R rows (decode: 1; verification: k + 1; no token
trees), fits the bucket (b, r) with the fewest rows b x r such that b >= B and r >= R. Each bucket
is captured the first time a step fits it: the model's forward over static input buffers of
b x r rows, b sequences and the cache's whole block table width. A step that fits copies its
inputs into the buffers, pads the rest and replays:

    rows past the step's T     token 0, position 0, slot -1: rotated, never written to the cache
                               (rotary_kv_write skips a negative slot), in no sequence
    sequences past its B       no rows (cu_q stays at T) and an all-zero block table row
    logits rows past its n_out row 0, dropped

Attention reads each row's own positions (paged_attention loops to a row's position, inside the
kernel), so a bucket serves any context up to the cache's capacity; its split count is fixed by
that capacity. Every real row's result equals the eager forward's: a row's bits depend on its own
inputs only, the padding reads nothing of theirs and writes nothing they read. The logits handed
back are a copy: the buffers are overwritten by the next replay.

Without CUDA (Triton's interpreter on CPU tensors, `cuda_graphs=True`) a "capture" keeps the
forward and a replay runs it on the same buffers: the buckets, the padding and the copies
are what runs, so the tests prove them there; capturing a CUDA graph waits for a GPU.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrt.engine.models.attention import AttentionMetadata
from agentrt.engine.models.batch import ForwardBatch, ForwardOutput

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROW_BUCKETS = (1, 2, 4, 8, 16)  # decode and verification runs of k + 1 <= 16 rows


@dataclass(frozen=True)
class Bucket:
    batch: int  # sequences
    rows: int  # rows per sequence

    @property
    def tokens(self) -> int:
        return self.batch * self.rows


Replay = Callable[[], torch.Tensor]  # runs the captured step on the buffers: [bucket tokens, vocab] logits


def _capture_cuda(forward: Replay, pool: object) -> Replay:
    """A CUDA graph of `forward`, warmed up first on a side stream (Triton compiles its kernels and
    cuBLAS picks its algorithms outside the capture); a replay rewrites the logits captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay


def _capture_eager(forward: Replay, pool: object) -> Replay:
    """No CUDA: a replay runs the forward on the same buffers."""
    return forward


class StepGraphs:
    """The captured steps of one model and KV cache (module docstring). `forward(batch)` replays
    the bucket the batch fits, or runs the model's forward when it fits none (prefill, trees, more
    sequences or rows than the largest bucket)."""

    def __init__(self, model, kv, max_context: int, max_seqs: int,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, row_buckets: tuple[int, ...] = ROW_BUCKETS):
        if not getattr(model, "triton_enabled", False):
            raise ValueError("step graphs replay the Triton path's forward; this model does not run on the Triton "
                             "kernels (AGENTRT_KERNELS, models/layer_ops.triton_support)")
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.max_blocks = -(-max_context // self.block_size)  # a block table row of the whole context
        self.batch_buckets = tuple(sorted(b for b in set(batch_buckets) if b <= max_seqs)) or (1,)
        self.row_buckets = tuple(sorted(set(row_buckets)))
        # the smallest first: fewest rows, then fewest sequences
        self._buckets = sorted((Bucket(b, r) for b in self.batch_buckets for r in self.row_buckets),
                               key=lambda x: (x.tokens, x.batch))
        device = kv.k[0].device
        self._capture = _capture_cuda if device.type == "cuda" else _capture_eager
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        n, b = self.batch_buckets[-1] * self.row_buckets[-1], self.batch_buckets[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids, self.positions = torch.zeros(n, **long), torch.zeros(n, **long)
        self.slots, self.logits_indices = torch.full((n,), -1, **long), torch.zeros(n, **long)
        self.cu_q, self.block_tables = torch.zeros(b + 1, **long), torch.zeros(b, self.max_blocks, **long)
        self.graphs: dict[Bucket, Replay] = {}
        self.replays = 0  # steps served by a replay (a figure for benches and tests)

    def bucket_for(self, batch: ForwardBatch) -> Bucket | None:
        """The smallest bucket (fewest rows, then fewest sequences) this batch fits; None: none."""
        meta = batch.attn
        if meta.tree is not None or batch.logits_indices is None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        return next((x for x in self._buckets if x.batch >= meta.num_seqs and x.rows >= meta.q_max), None)

    @torch.inference_mode()  # as the model's forward: its logits are inference tensors, updated in place here
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        bucket = self.bucket_for(batch)
        if bucket is None:
            return self.model.forward(batch, self.kv)
        self._copy_in(batch, bucket)
        replay = self.graphs.get(bucket)
        if replay is None:  # a capture records the forward without running it: the replay below runs it
            replay = self.graphs[bucket] = self._capture(lambda: self._forward(bucket), self._pool)
            log.info("captured the step graph of %d sequences x %d rows", bucket.batch, bucket.rows)
        self.replays += 1
        return ForwardOutput(logits=replay()[: batch.logits_indices.numel()].clone())

    def _forward(self, bucket: Bucket) -> torch.Tensor:
        """The model's forward over the bucket's buffers: [bucket tokens, vocab] logits."""
        n = bucket.tokens
        meta = AttentionMetadata(cu_q=self.cu_q[: bucket.batch + 1], positions=self.positions[:n],
                                 block_tables=self.block_tables[: bucket.batch], block_size=self.block_size,
                                 q_max=bucket.rows, l_max=self.max_blocks * self.block_size)
        batch = ForwardBatch(self.input_ids[:n], self.positions[:n], self.slots[:n], meta, self.logits_indices[:n])
        return self.model.forward(batch, self.kv).logits

    def _copy_in(self, batch: ForwardBatch, bucket: Bucket) -> None:
        """The batch into the buffers, the rest of the bucket padded (module docstring)."""
        T, B, n = batch.input_ids.numel(), batch.attn.num_seqs, bucket.tokens
        n_out, width = batch.logits_indices.numel(), batch.attn.block_tables.shape[1]
        for buf, src, pad in ((self.input_ids, batch.input_ids, 0), (self.positions, batch.positions, 0),
                              (self.slots, batch.slot_mapping, -1)):
            buf[:T].copy_(src)
            buf[T:n].fill_(pad)
        self.logits_indices[:n_out].copy_(batch.logits_indices)
        self.logits_indices[n_out:n].zero_()
        self.cu_q[: B + 1].copy_(batch.attn.cu_q)
        self.cu_q[B + 1 : bucket.batch + 1].fill_(T)
        self.block_tables[:B, :width].copy_(batch.attn.block_tables)
        self.block_tables[:B, width:].zero_()
        self.block_tables[B : bucket.batch].zero_()
