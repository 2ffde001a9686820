"""Turn a scheduled batch (plus drafts) into the model's flat ForwardBatch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.block_manager import BlockManager
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.llama import ForwardBatch
from agentrt.engine.sequence import Sequence


@dataclass
class StepPlan:
    """Per scheduled sequence: tokens fed, drafts appended, and whether it samples this step."""

    seqs: list[Sequence]
    num_new: list[int]  # real (already decided) tokens fed
    drafts: list[list[int]]  # draft tokens fed after them
    samples: list[bool]  # reaches the end of its known tokens -> needs logits

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new) + sum(len(d) for d in self.drafts)


def build_forward_batch(plan: StepPlan, blocks: BlockManager, device: torch.device) -> tuple[ForwardBatch, list[int]]:
    """Returns the batch and, per sampling sequence, its first logits row (k+1 rows follow)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    num_fed: list[int] = []
    ctx: list[int] = []
    logit_rows: list[int] = []
    first_row: list[int] = []
    for seq, n, draft, samples in zip(plan.seqs, plan.num_new, plan.drafts, plan.samples):
        start = seq.num_computed
        end = start + n + len(draft)
        fed = seq.all_ids[start : start + n] + draft
        offset = len(ids)
        ids += fed
        positions += range(start, end)
        slots += blocks.slots(seq.seq_id, start, end)
        num_fed.append(len(fed))
        ctx.append(end)
        if samples:
            first_row.append(len(logit_rows))
            logit_rows += range(offset + n - 1, offset + len(fed))
    pos = torch.tensor(positions, dtype=torch.long)
    meta = build_attention_metadata(
        num_fed, ctx, pos, [blocks.tables[s.seq_id] for s in plan.seqs], blocks.block_size, device
    )
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=pos.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        attn=meta,
        logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=device),
    )
    return batch, first_row
