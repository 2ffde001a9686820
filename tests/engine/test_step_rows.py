"""The step's rows: draft limits and KV fitting (engine.step.draft_plan), and the flat batch the rows
build (no model needed)."""
from __future__ import annotations

import torch

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.step.sequence import Sequence
from agentrt.engine.step.draft_plan import draft_limits, fit_to_kv, planned, reserve_draft_kv
from agentrt.engine.step.step_rows import RowDraft, build_forward_batch, rows_of

BS = 4


def decoding(seq_id: int, prompt: int, output: int, blocks: BlockManager, max_tokens: int = 100) -> Sequence:
    """A sequence in decode: every token but the last sampled one is cached (the scheduler's
    state before a decode step, its next slot reserved)."""
    seq = Sequence(seq_id, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))
    seq.output_ids = [7] * output
    seq.num_computed = seq.num_tokens - 1
    blocks.grow(seq_id, seq.num_tokens)
    return seq


def test_limit_drafts_by_output_left_context_left_and_kv_share():
    blocks = BlockManager(num_blocks=10, block_size=BS)
    short = decoding(0, 6, 2, blocks, max_tokens=5)  # 3 output tokens left: 2 drafts + the bonus token
    near_end = decoding(1, 10, 0, blocks)  # context 12: one position after the next token
    roomy = decoding(2, 3, 0, blocks)
    prefill = Sequence(3, [1, 2, 3, 4, 5], SamplingParams())
    blocks.grow(3, 2)
    rows = rows_of([short, near_end, roomy], [1, 1, 1]) + rows_of([prefill], [2])
    assert [r.samples for r in rows] == [True, True, True, False]
    limits = draft_limits(rows, blocks, max_model_len=12)
    free_share = blocks.num_free * BS // 3
    assert limits[rows[0]] == 2 and limits[rows[1]] == 1
    # roomy holds 3 tokens in one block: one reserved slot beyond them, plus its share
    assert limits[rows[2]] == 1 + free_share
    assert rows[3] not in limits  # prefill chunks never draft


def test_fit_drafts_to_kv_cuts_in_turn_and_reserve_grows_the_tables():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    a, b = decoding(0, 4, 0, blocks), decoding(1, 4, 0, blocks)  # one full block each, 2 free
    rows = rows_of([a, b], [1, 1])
    drafts = {rows[0]: RowDraft((5,) * 6, forced=(True,) * 6),  # needs positions 4..9: 2 blocks
              rows[1]: RowDraft((6,) * 3, forced=(False,) * 3)}  # needs 1 block, none left after a
    rows = planned(rows, fit_to_kv(rows, drafts, blocks))
    assert rows[0].k == 6 and rows[1].k == 0 and rows[1].forced == ()
    reserve_draft_kv(rows, blocks)
    assert blocks.num_free == 0 and len(blocks.tables[0]) == 3 and rows[0].end == 3 + 1 + 6


def test_forward_batch_is_the_rows_flattened_with_their_first_logits_rows():
    blocks = BlockManager(num_blocks=16, block_size=BS)
    a = decoding(0, 5, 1, blocks)
    prefill = Sequence(1, [11, 12, 13, 14, 15, 16], SamplingParams())
    blocks.grow(1, 6)
    b = decoding(2, 2, 0, blocks)
    rows = rows_of([a, prefill, b], [1, 6, 1])
    rows = planned(rows, {rows[0]: RowDraft((21, 22))})
    reserve_draft_kv(rows, blocks)
    fwd = build_forward_batch(rows, blocks, torch.device("cpu"))
    assert fwd.input_ids.tolist() == [7, 21, 22, 11, 12, 13, 14, 15, 16, 2]
    assert fwd.positions.tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 5, 1]
    # a: its next token's row and one per draft; the prefill's last row; b's one row
    assert fwd.logits_indices.tolist() == [0, 1, 2, 8, 9]
    assert [r.first_row for r in rows] == [0, 3, 4]
    assert [r.num_rows for r in rows] == [3, 1, 1]
    table = blocks.tables[0]
    assert fwd.slot_mapping[:3].tolist() == [table[p // BS] * BS + p % BS for p in (5, 6, 7)]
