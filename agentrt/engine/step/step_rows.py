"""One engine step as a list of rows: a StepRow per scheduled sequence, with the drafts the
step's draft plan gave it (engine.step.draft_plan: frozen once planned), and the flat forward batch
built from them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.llama import ForwardBatch
from agentrt.engine.step.sequence import Sequence
from agentrt.engine.step.step_tree import tree_keys, tree_positions


@dataclass(frozen=True)
class RowDraft:
    """The drafts one row feeds after its fed tokens, as the draft plan decided them."""

    tokens: tuple[int, ...] = ()
    # a token tree instead of a chain: each draft token's parent (-1: the fed token), parents
    # first (engine/step/step_tree.py); None: the drafts are a chain
    parents: tuple[int, ...] | None = None
    q: torch.Tensor | None = None  # [k, V] the draft was drawn from; None: deterministic drafts
    forced: tuple[bool, ...] = ()  # per draft token: the grammar forced it
    expected_accepted: float = 0.0  # spec.arithmetic.expected_accepted of its acceptance probabilities


NO_DRAFT = RowDraft()


@dataclass(frozen=True, eq=False)  # rows are compared and hashed by identity
class StepRow:
    """One scheduled sequence in one step."""

    seq: Sequence
    start: int  # seq.num_computed when the step began: where its fed tokens go in the cache
    num_new: int  # tokens of seq.all_ids fed: a prompt chunk, or the last sampled token
    samples: bool  # feeds up to its last known token: k + 1 logits rows, emits tokens
    plan: RowDraft = NO_DRAFT
    first_row: int = -1  # its first logits row, when it samples (rows in order, k + 1 each)
    failed: str | None = None  # its grammar raised while the step was planned: the request ends

    @property
    def draft(self) -> list[int]:
        return list(self.plan.tokens)

    @property
    def parents(self) -> tuple[int, ...] | None:
        return self.plan.parents

    @property
    def q(self) -> torch.Tensor | None:
        return self.plan.q

    @property
    def forced(self) -> tuple[bool, ...]:
        return self.plan.forced

    @property
    def expected_accepted(self) -> float:
        return self.plan.expected_accepted

    @property
    def k(self) -> int:
        return len(self.plan.tokens)

    @property
    def num_rows(self) -> int:
        """Logits rows: the next token's and one after each draft token."""
        return self.k + 1 if self.samples else 0

    @property
    def end(self) -> int:
        """The sequence's cached length once this step's tokens are written."""
        return self.start + self.num_new + self.k


def rows_of(seqs: list[Sequence], num_new: list[int]) -> list[StepRow]:
    return [StepRow(s, s.num_computed, n, samples=s.num_computed + n == s.num_tokens and not s.prefill_only)
            for s, n in zip(seqs, num_new)]


def build_forward_batch(rows: list[StepRow], blocks: BlockManager, device: torch.device) -> ForwardBatch:
    """The flat ragged batch of every row's fed tokens; each sampling row's k + 1 logits rows
    follow in order from its first_row."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    for r in rows:
        offset = len(ids)
        ids += r.seq.all_ids[r.start : r.start + r.num_new] + r.draft
        row_slots = blocks.slots(r.seq.seq_id, r.start, r.end)
        positions += tree_positions(r) if r.parents is not None else range(r.start, r.end)
        slots += row_slots
        if r.samples:  # from r.first_row on, as the plan numbered them
            logit_rows += range(offset + r.num_new - 1, len(ids))
    pos = torch.tensor(positions, dtype=torch.long)
    meta = build_attention_metadata([r.num_new + r.k for r in rows], [r.end for r in rows], pos,
                                    [blocks.tables[r.seq.seq_id] for r in rows], blocks.block_size, device)
    if any(r.parents is not None for r in rows):
        meta.tree = tree_keys(rows, blocks)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=pos.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        attn=meta,
        logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=device),
    )
