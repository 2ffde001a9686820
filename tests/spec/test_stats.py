"""DraftStats arithmetic, merging, serialisation, and per-request event accounting."""
import json

import pytest

from agentrt.errors import SpecError
from agentrt.spec.stats import DraftStats, RequestSpecStats, SpecStepEvent


def test_record_arithmetic_and_rates():
    stats = DraftStats()
    stats.record(k=4, num_accepted=4, num_emitted=5)  # full acceptance + bonus
    stats.record(k=4, num_accepted=1, num_emitted=2)  # rejected at the 2nd draft
    stats.record(k=0, num_accepted=0, num_emitted=1)  # plain decode step
    stats.record(k=3, num_accepted=0, num_emitted=1, forced=1)
    assert (stats.drafted, stats.accepted, stats.rejections, stats.forced) == (11, 5, 2, 1)
    assert (stats.target_passes, stats.spec_passes, stats.emitted) == (4, 3, 9)
    assert stats.run_lengths == {4: 1, 1: 1, 0: 1}
    assert stats.alpha == pytest.approx(5 / 11)
    assert stats.alpha_tested == pytest.approx(5 / 7)  # 5 accepted + 2 rejected were tested
    assert stats.tokens_per_pass == pytest.approx(9 / 4)


def test_empty_stats_have_undefined_rates():
    stats = DraftStats()
    assert stats.alpha is None and stats.alpha_tested is None and stats.tokens_per_pass is None
    stats.record(0, 0, 1)
    assert stats.alpha is None and stats.tokens_per_pass == 1.0


def test_emitted_may_be_cut_at_a_stop_token():
    stats = DraftStats()
    stats.record(k=5, num_accepted=3, num_emitted=2)
    stats.record(k=2, num_accepted=0, num_emitted=0)  # the stop token itself is not kept
    assert stats.emitted == 2 and stats.run_lengths == {3: 1, 0: 1}


@pytest.mark.parametrize(
    "k,accepted,emitted,forced,field",
    [(2, 3, 4, 0, "accepted"), (2, -1, 1, 0, "accepted"), (2, 1, 3, 0, "emitted"), (2, 1, -1, 0, "emitted"), (2, 1, 2, 3, "forced")],
)
def test_impossible_steps_are_rejected(k, accepted, emitted, forced, field):
    with pytest.raises(SpecError, match=field):
        DraftStats().record(k, accepted, emitted, forced)
    with pytest.raises(SpecError, match=field):
        SpecStepEvent(step=0, time=0.0, seq_id=1, drafter="x", k=k, accepted=accepted, emitted=emitted, forced=forced)


def test_merge_adds_everything():
    a, b = DraftStats(), DraftStats()
    a.record(3, 3, 4)
    a.record(3, 0, 1)
    b.record(2, 2, 3, forced=2)
    b.record(3, 0, 1)
    merged = DraftStats().merge(a).merge(b)
    assert (merged.drafted, merged.accepted, merged.rejections, merged.forced) == (11, 5, 2, 2)
    assert (merged.target_passes, merged.emitted) == (4, 9)
    assert merged.run_lengths == {3: 1, 0: 2, 2: 1}
    assert DraftStats.total([a, b]) == merged
    assert a.run_lengths == {3: 1, 0: 1}  # inputs untouched


def test_to_dict_is_json_ready():
    stats = DraftStats()
    stats.record(2, 1, 2)
    stats.record(2, 2, 3)
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["run_lengths"] == {"1": 1, "2": 1}
    assert data["alpha"] == 0.75 and data["tokens_per_pass"] == 2.5 and data["spec_passes"] == 2


def test_request_stats_split_by_drafter_and_keep_events():
    req = RequestSpecStats(seq_id=7)
    events = [
        SpecStepEvent(step=0, time=0.01, seq_id=7, drafter="suffix", k=4, accepted=2, emitted=3),
        SpecStepEvent(step=1, time=0.02, seq_id=7, drafter="model", k=2, accepted=2, emitted=3),
        SpecStepEvent(step=2, time=0.03, seq_id=7, drafter="suffix", k=4, accepted=4, emitted=5),
    ]
    for event in events:
        req.record(event)
    assert req.events == events
    assert req.by_drafter["suffix"].accepted == 6 and req.by_drafter["model"].drafted == 2
    total = req.total()
    assert (total.drafted, total.accepted, total.emitted, total.target_passes) == (10, 8, 11, 3)
    data = json.loads(json.dumps(req.to_dict(with_events=True)))
    assert data["events"][1]["drafter"] == "model" and data["total"]["alpha"] == 0.8
    with pytest.raises(SpecError, match="seq 8"):
        req.record(SpecStepEvent(step=3, time=0.04, seq_id=8, drafter="suffix", k=0, accepted=0, emitted=1))
