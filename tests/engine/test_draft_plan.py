"""The step's draft plan hands out frozen drafts; a grammar's cut keeps a tree's allowed nodes; a
step's tokens are kept by the stop checks and committed in one place (no model needed)."""
from __future__ import annotations

from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import pytest

from agentrt.engine.step.budget import Closing
from agentrt.engine.step.draft_plan import cut, keep_nodes, planned
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.step.sequence import Sequence, StopChecker
from agentrt.engine.step.step_rows import NO_DRAFT, RowDraft, rows_of


def test_a_planned_row_and_its_draft_are_frozen():
    seq = Sequence(0, [1, 2, 3], SamplingParams())
    seq.num_computed = 2
    (row,) = rows_of([seq], [1])
    (row,) = planned([row], {row: RowDraft((9, 8), forced=(False, True), expected_accepted=1.5)})
    assert (row.draft, row.k, row.forced, row.first_row, row.expected_accepted) == ([9, 8], 2, (False, True), 0, 1.5)
    with pytest.raises(FrozenInstanceError):
        row.plan = NO_DRAFT
    with pytest.raises(FrozenInstanceError):
        row.plan.tokens = ()


def test_cuts_keep_a_chains_prefix_and_a_trees_allowed_nodes():
    chain = RowDraft((1, 2, 3), forced=(True, False, False), expected_accepted=2.0)
    assert cut(chain, 1) == RowDraft((1,), forced=(True,), expected_accepted=2.0)
    assert keep_nodes(chain, [0, 1]) == cut(chain, 2)
    # nodes 0 and 1 are roots, 2 under 0, 3 under 1: keeping 1 and 3 renumbers them 0 and 1
    tree = RowDraft((5, 6, 7, 8), parents=(-1, -1, 0, 1), forced=(True, False, True, False))
    assert keep_nodes(tree, [1, 3]) == RowDraft((6, 8), parents=(-1, 0), forced=(False, False))


def test_stop_checks_decide_what_is_kept_and_commit_adds_it():
    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=3))
    seq.output_ids = [5]
    stops = StopChecker(seq, eos_ids=(0,), detok=SimpleNamespace(push=lambda t: f"<{t}>"))
    kept, text, reason = stops.apply([7, 8, 9])
    assert (kept, text, reason) == ([7, 8], "<7><8>", "length") and seq.output_ids == [5]
    seq.commit(kept)
    assert seq.output_ids == [5, 7, 8]


def test_commit_advances_the_budgets_forced_completion():
    seq = Sequence(0, [1], SamplingParams())
    seq.closing = Closing(forced=[4, 5])
    seq.commit([4])
    assert seq.closing.forced == [5]
    with pytest.raises(RuntimeError, match="where the completion forced 5"):
        seq.commit([6])
