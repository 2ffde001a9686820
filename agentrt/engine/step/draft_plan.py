"""The drafting of one engine step, in one place: which draft tokens each sampling row feeds.

One plan per step, made in this order, each stage reading only what the stages before it left:

1. limit: a row may feed no draft past max_tokens or the context (the token after the last
   draft is emitted too, hence - 1), and no more than the KV slots its blocks already reserve
   plus an even share of the free blocks (`draft_limits`).
2. budget cap: a constrained row in the last stretch of max_tokens keeps room for the
   completion that ends its output valid (engine.step.budget.draft_cap).
3. propose: the drafter's drafts within those limits, their depth chosen by the k controller
   (SpecRunner.propose); a row forcing its completion proposes nothing.
4. force: with speculation on, a row forcing its completion feeds the completion as its draft,
   accepted by construction (engine.step.budget.forced_draft).
5. fit to KV: drafts cut to the blocks free in turn, in row order (`fit_to_kv`: the share in 1
   is a first guess, and the controller may give one row more than its share when others draft
   less); drafts never preempt anyone.
6. mask cut: the grammar masks of every verified row of the constrained rows; a draft is cut at
   the first token its grammar forbids, a token tree loses the nodes it forbids with their
   subtrees (Constraints.step_masks); a grammar that raises fails its request (no drafts).
7. reserve: the block tables grow to hold the drafts, before the forward writes their K/V.

The result is a StepPlan: each row with its frozen RowDraft and first logits row, the step's
masks and what drafting cost. Nothing later in the step writes or cuts a draft: the forward
batch, the sampler, the engine's commit and the α accounting read the plan. A draft's
expected_accepted is the controller's expectation for it as proposed (before 5 and 6 cut it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from agentrt.engine.step import budget
from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.step.constraints import Constraints, StepMasks
from agentrt.engine.step.spec_runner import DraftStep, SpecRunner
from agentrt.engine.step.step_rows import NO_DRAFT, RowDraft, StepRow
from agentrt.engine.step.step_tree import kept_tree
from agentrt.spec.arithmetic import expected_accepted


@dataclass(frozen=True)
class StepPlan:
    rows: list[StepRow]  # the step's rows in the scheduler's order, drafts and first logits rows set
    masks: StepMasks | None  # grammar masks of the logits rows, None when no row is constrained
    drafting: DraftStep  # what drafting cost, and the step time the controller predicted


def draft_limits(rows: list[StepRow], blocks: BlockManager, max_model_len: int) -> dict[StepRow, int]:
    """Each sampling row's most drafts: by output and context left, and by KV (the slots its
    blocks already reserve plus an even share of the free blocks)."""
    sampling = [r for r in rows if r.samples]
    share = blocks.num_free * blocks.block_size // max(1, len(sampling))
    limits = {}
    for r in sampling:
        seq = r.seq
        reserved = len(blocks.tables.get(seq.seq_id, ())) * blocks.block_size - seq.num_tokens
        limits[r] = max(0, min(seq.params.max_tokens - len(seq.output_ids) - 1,
                               max_model_len - seq.num_tokens - 1, reserved + share))
    return limits


def cut(draft: RowDraft, k: int) -> RowDraft:
    """The draft's first k tokens (a tree's first k nodes: parents come first, so they are a tree)."""
    if k >= len(draft.tokens):
        return draft
    return replace(draft, tokens=draft.tokens[:k], forced=draft.forced[:k],
                   parents=None if draft.parents is None else draft.parents[:k],
                   q=None if draft.q is None else draft.q[:k])


def keep_nodes(draft: RowDraft, keep: list[int]) -> RowDraft:
    """Only the draft tokens `keep` (a chain's first ones; a tree's nodes, each with its parent)."""
    if draft.parents is None:
        return cut(draft, len(keep))
    return replace(draft, tokens=tuple(draft.tokens[i] for i in keep), parents=kept_tree(draft.parents, keep),
                   forced=tuple(draft.forced[i] for i in keep) if draft.forced else ())


def fit_to_kv(rows: list[StepRow], drafts: dict[StepRow, RowDraft], blocks: BlockManager) -> dict[StepRow, RowDraft]:
    """The drafts cut to the blocks free in turn, every row's fed tokens counted in row order."""
    free, fitted = blocks.num_free, {}
    for r in rows:
        draft = drafts.get(r, NO_DRAFT)
        base, k = r.start + r.num_new, len(draft.tokens)
        while k and blocks.blocks_needed(r.seq.seq_id, base + k) > free:
            k -= 1
        if draft.tokens:
            fitted[r] = cut(draft, k)
        free -= blocks.blocks_needed(r.seq.seq_id, base + k)
    return fitted


def reserve_draft_kv(rows: list[StepRow], blocks: BlockManager) -> None:
    for r in rows:
        if r.draft:  # fit_to_kv kept them within the free blocks
            blocks.grow(r.seq.seq_id, r.end)


def planned(rows: list[StepRow], drafts: dict[StepRow, RowDraft],
            failed: dict[StepRow, str] | None = None) -> list[StepRow]:
    """The rows with their drafts, failures and first logits rows (k + 1 rows per sampling row,
    in order)."""
    out, first = [], 0
    for r in rows:
        draft = drafts.get(r, NO_DRAFT)
        out.append(replace(r, plan=draft, first_row=first if r.samples else -1,
                           failed=(failed or {}).get(r)))
        first += len(draft.tokens) + 1 if r.samples else 0
    return out


class DraftPlanner:
    """Makes each step's plan (the module docstring's order) for one engine."""

    def __init__(self, blocks: BlockManager, max_model_len: int, spec: SpecRunner, constraints: Constraints,
                 encode: budget.Encode, decode: budget.Decode):
        self.blocks, self.max_model_len = blocks, max_model_len
        self.spec, self.constraints = spec, constraints
        self.encode, self.decode = encode, decode

    def plan(self, rows: list[StepRow]) -> StepPlan:
        limits = draft_limits(rows, self.blocks, self.max_model_len)  # 1
        limits = {r: budget.draft_cap(r.seq, n, self.encode, self.decode) for r, n in limits.items()}  # 2
        drafting, drafts = self.spec.propose(rows, {r: 0 if budget.closing(r.seq) else n
                                                    for r, n in limits.items()})  # 3
        if self.spec.drafter is not None:  # 4
            for r, n in limits.items():
                forced = budget.forced_draft(r.seq, n)
                if forced is not None:
                    drafts[r] = RowDraft(tuple(forced), None, None, (True,) * len(forced),
                                         expected_accepted([1.0] * len(forced)))
        drafts = fit_to_kv(rows, drafts, self.blocks)  # 5
        sampling = [r for r in rows if r.samples]  # 6
        masks, kept = self.constraints.step_masks(
            [(r.seq, list(drafts.get(r, NO_DRAFT).tokens), drafts.get(r, NO_DRAFT).parents) for r in sampling])
        failed = {}
        for r, keep in zip(sampling, kept):
            if isinstance(keep, str):
                failed[r] = keep
                if r in drafts:
                    drafts[r] = cut(drafts[r], 0)
            elif keep is not None:
                drafts[r] = keep_nodes(drafts[r], keep)
        rows = planned(rows, drafts, failed)
        reserve_draft_kv(rows, self.blocks)  # 7
        return StepPlan(rows, masks, drafting)
