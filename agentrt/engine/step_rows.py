"""One engine step as a list of rows: a StepRow per scheduled sequence, filled in as the step
decides (drafts, masks' place, emitted tokens), and the flat forward batch built from them.

The KV side of drafting lives here too: how many drafts a row may feed (`limit_drafts`), cutting
drafts to the blocks that are free in turn (`fit_drafts_to_kv`), and growing the tables before
the forward writes them (`reserve_draft_kv`). Drafts never preempt anyone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentrt.engine.block_manager import BlockManager
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.llama import ForwardBatch
from agentrt.engine.outputs import TokenLogprob
from agentrt.engine.sequence import Sequence
from agentrt.engine.step_tree import tree_keys, tree_positions


@dataclass(eq=False)  # rows are compared and hashed by identity
class StepRow:
    """One scheduled sequence in one step."""

    seq: Sequence
    start: int  # seq.num_computed when the step began: where its fed tokens go in the cache
    num_new: int  # tokens of seq.all_ids fed: a prompt chunk, or the last sampled token
    samples: bool  # feeds up to its last known token: k + 1 logits rows, emits tokens
    max_draft: int = 0  # drafts it may feed (output and context left, KV it can take)
    draft: list[int] = field(default_factory=list)  # draft tokens fed after the num_new
    # a token tree instead of a chain: each draft token's parent (-1: the fed token), parents
    # first (engine/step_tree.py); None: the drafts are a chain
    parents: list[int] | None = None
    accepted_nodes: tuple[int, ...] = ()  # a tree's accepted path (draft indices), set at verification
    q: torch.Tensor | None = None  # [k, V] the draft was drawn from; None: deterministic drafts
    forced: list[bool] = field(default_factory=list)  # per draft token: the grammar forced it
    expected_accepted: float = 0.0  # the k controller's expectation for this draft
    first_row: int = -1  # its first logits row, when it samples
    emitted: list[int] = field(default_factory=list)  # what the step decided ([] while prefilling)
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the request asks
    failed: str | None = None  # this request's own error in this step (its grammar raised): it ends
    verified: int | None = None  # drafts accepted at verification, when the budget then cut the run
    raw_logprobs: torch.Tensor | None = None  # [k + 1, vocab] log-softmax, when the request asks for logprobs

    @property
    def k(self) -> int:
        return len(self.draft)

    @property
    def num_rows(self) -> int:
        """Logits rows: the next token's and one after each draft token."""
        return self.k + 1 if self.samples else 0

    @property
    def end(self) -> int:
        """The sequence's cached length once this step's tokens are written."""
        return self.start + self.num_new + self.k

    @property
    def accepted(self) -> int:
        """Drafts the target accepted (a cut by the budget, engine.budget, does not reject them)."""
        if self.verified is not None:
            return self.verified
        return max(0, len(self.emitted) - 1) if self.draft else 0

    def cut(self, k: int) -> None:
        """Keep only the first k drafts."""
        self.draft, self.forced = self.draft[:k], self.forced[:k]
        if self.parents is not None:  # parents come first: the first k nodes are a tree
            self.parents = self.parents[:k]
        if self.q is not None:
            self.q = self.q[:k]


def rows_of(seqs: list[Sequence], num_new: list[int]) -> list[StepRow]:
    return [StepRow(s, s.num_computed, n, samples=s.num_computed + n == s.num_tokens and not s.prefill_only)
            for s, n in zip(seqs, num_new)]


def limit_drafts(rows: list[StepRow], blocks: BlockManager, max_model_len: int) -> None:
    """Each sampling row's max_draft: drafts past max_tokens or the context could never be
    emitted (the token after the last draft is emitted too, hence - 1), and drafts need KV
    slots: those its blocks already reserve plus an even share of the free blocks."""
    sampling = [r for r in rows if r.samples]
    share = blocks.num_free * blocks.block_size // max(1, len(sampling))
    for r in sampling:
        seq = r.seq
        reserved = len(blocks.tables.get(seq.seq_id, ())) * blocks.block_size - seq.num_tokens
        r.max_draft = max(0, min(seq.params.max_tokens - len(seq.output_ids) - 1,
                                 max_model_len - seq.num_tokens - 1, reserved + share))


def fit_drafts_to_kv(rows: list[StepRow], blocks: BlockManager) -> None:
    """Cut drafts to the blocks free in turn (the share in limit_drafts is a first guess: the
    controller may give one row more than its share when others draft less)."""
    free = blocks.num_free
    for r in rows:
        base, k = r.start + r.num_new, r.k
        while k and blocks.blocks_needed(r.seq.seq_id, base + k) > free:
            k -= 1
        if k < r.k:
            r.cut(k)
        free -= blocks.blocks_needed(r.seq.seq_id, base + k)


def reserve_draft_kv(rows: list[StepRow], blocks: BlockManager) -> None:
    for r in rows:
        if r.draft:  # fit_drafts_to_kv kept them within the free blocks
            blocks.grow(r.seq.seq_id, r.end)


def build_forward_batch(rows: list[StepRow], blocks: BlockManager, device: torch.device) -> ForwardBatch:
    """The flat ragged batch of every row's fed tokens; sets each sampling row's first_row (its
    k + 1 logits rows follow in order)."""
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
        if r.samples:
            r.first_row = len(logit_rows)
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
