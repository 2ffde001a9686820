"""Forward passes for model drafters (agentrt.spec.drafters.model.DraftModelRunner).

LayerSkipRunner: the target's first N layers + final norm + head, over the target's own KV cache
(the first N layers' K/V of accepted tokens is identical to the target's, so nothing is kept
twice; draft positions are overwritten by the verification pass).
SeparateModelRunner: another same-tokenizer model with its own paged cache.
"""
from __future__ import annotations

import torch

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.llama import ForwardBatch, LlamaModel


def _forward_last(model: LlamaModel, kv: KVCache, blocks: BlockManager, seq_ids, starts, tokens, num_layers=None) -> torch.Tensor:
    ids, pos, slots, ends, rows = [], [], [], [], []
    for sid, start, toks in zip(seq_ids, starts, tokens):
        end = start + len(toks)
        blocks.grow(sid, end)
        ids += toks
        pos += range(start, end)
        slots += blocks.slots(sid, start, end)
        ends.append(end)
        rows.append(len(ids) - 1)
    kv.copy_blocks(blocks.pop_copies())  # copy-on-write before this forward writes into a shared block
    positions = torch.tensor(pos, dtype=torch.long)
    meta = build_attention_metadata([len(t) for t in tokens], ends, positions, [blocks.tables[s] for s in seq_ids],
                                    blocks.block_size, model.device)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=model.device),
        positions=positions.to(model.device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=model.device),
        attn=meta,
        logits_indices=torch.tensor(rows, dtype=torch.long, device=model.device),
    )
    return model.forward(batch, kv, num_layers=num_layers).logits


class LayerSkipRunner:
    def __init__(self, engine, num_layers: int):
        if not 0 < num_layers < engine.model.num_layers:
            raise ValueError(f"layerskip:N needs 0 < N < {engine.model.num_layers}, got {num_layers}")
        self.engine = engine
        self.num_layers = num_layers
        self.vocab_size = engine.model.cfg.vocab_size
        self.relative_cost = num_layers / engine.model.num_layers
        # Draft positions written past the target's computed prefix during the current step.
        # Outside that step the target's own prefix is the truth (it may have been truncated,
        # or freed by preemption, since).
        self._len: dict[int, tuple[int, int]] = {}  # seq -> (engine step, length)

    def cached_len(self, seq_id: int) -> int:
        step, n = self._len.get(seq_id, (-1, 0))
        return n if step == self.engine.step_no else self.engine.sequence(seq_id).num_computed

    def forward(self, seq_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
        starts = [self.cached_len(s) for s in seq_ids]
        e = self.engine
        logits = _forward_last(e.model, e.kv, e.blocks, seq_ids, starts, tokens, self.num_layers)
        for s, st, t in zip(seq_ids, starts, tokens):
            self._len[s] = (e.step_no, st + len(t))
        return logits

    def truncate(self, seq_id: int, length: int) -> None:
        # The engine truncates the shared blocks itself after verification.
        self._len.pop(seq_id, None)

    def release(self, seq_id: int) -> None:
        self._len.pop(seq_id, None)


class SeparateModelRunner:
    def __init__(self, model: LlamaModel, kv_cache_tokens: int, block_size: int = 16, relative_cost: float = 1.0):
        """relative_cost: the draft model's parameters as a share of the target's."""
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        self.relative_cost = relative_cost
        n = max(1, kv_cache_tokens // block_size)
        self.blocks = BlockManager(n, block_size)
        self.kv = KVCache(model.cfg, n, block_size, model.kv_dtype, model.device)

    def cached_len(self, seq_id: int) -> int:
        return self.blocks.lengths.get(seq_id, 0)

    def forward(self, seq_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
        starts = [self.cached_len(s) for s in seq_ids]
        return _forward_last(self.model, self.kv, self.blocks, seq_ids, starts, tokens)

    def truncate(self, seq_id: int, length: int) -> None:
        self.blocks.truncate(seq_id, length)

    def release(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
