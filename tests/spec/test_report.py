"""A request's frozen speculation figures: the rates computed once, sums over requests and drafters,
and the JSON shape traces, engine workers and API bodies carry, read back unchanged."""
import json

import pytest

from agentrt.errors import SpecError
from agentrt.spec.report import NO_SPEC, SpecFigures, SpecReport
from agentrt.spec.stats import RequestSpecStats, SpecStepEvent


def _request() -> RequestSpecStats:
    req = RequestSpecStats(seq_id=3)
    for step, (drafter, k, accepted, emitted, forced) in enumerate([
        ("template", 4, 4, 5, 3),  # grammar forced 3 of the 4 accepted drafts
        ("template", 4, 1, 2, 0),  # rejected at the 2nd draft
        ("none", 0, 0, 1, 0),  # a plain decode pass
        ("suffix", 3, 0, 0, 0),  # the stop token itself was dropped
    ]):
        req.record(SpecStepEvent(step, 0.1 * step, 3, drafter, k, accepted, emitted, forced))
    return req


def test_rates_are_derived_from_the_counts():
    t = _request().report().total
    assert (t.drafted, t.accepted, t.rejections, t.forced, t.target_passes, t.emitted) == (11, 5, 2, 3, 4, 8)
    assert t.alpha == pytest.approx(5 / 11) and t.alpha_tested == pytest.approx(5 / 7)
    assert t.alpha_free == pytest.approx(2 / 8) and t.alpha_forced == 1.0
    assert t.tokens_per_pass == 2.0 and t.drafts_per_pass == pytest.approx(11 / 4)
    assert (t.free_drafted, t.free_accepted, t.bonus, t.spec_passes) == (8, 2, 3, 3)
    empty = SpecFigures()
    assert (empty.alpha, empty.alpha_tested, empty.alpha_free, empty.alpha_forced, empty.tokens_per_pass) == (None,) * 5


def test_report_dict_is_what_the_accumulator_wrote_and_reads_back():
    req = _request()
    report = req.report()
    data = json.loads(json.dumps(report.to_dict()))
    assert data == req.to_dict()  # the shape traces and API bodies always had
    assert set(data) == {"seq_id", "total", "by_drafter"} and set(data["by_drafter"]) == {"template", "none", "suffix"}
    assert data["total"]["run_lengths"] == {"0": 1, "1": 1, "4": 1}
    assert SpecReport.from_dict(data) == report
    assert SpecReport.from_dict({}) == SpecReport.from_dict(None) == NO_SPEC
    # a total without rejections or histogram (e.g. written by a simulator) reads as zeros there
    partial = SpecFigures.from_dict({"drafted": 4, "accepted": 2, "target_passes": 2, "emitted": 4, "alpha": 0.5})
    assert partial.rejections == 0 and partial.run_lengths == {} and partial.alpha == 0.5


def test_figures_are_frozen():
    figures = _request().report().total
    with pytest.raises(AttributeError):
        figures.accepted = 0
    with pytest.raises(TypeError):
        figures.run_lengths[9] = 1


def test_sum_over_requests_merges_drafters():
    a = _request().report()
    b = RequestSpecStats(seq_id=4)
    b.record(SpecStepEvent(0, 0.0, 4, "suffix", 2, 2, 3, 0))
    both = SpecReport.sum([a, b.report()])
    assert both.seq_id is None
    assert both.total == a.total + b.report().total
    assert both.by_drafter["suffix"].accepted == 2 and both.by_drafter["suffix"].drafted == 5
    assert both.total.run_lengths == {4: 1, 1: 1, 0: 1, 2: 1}
    assert SpecFigures.sum([]) == SpecFigures()


@pytest.mark.parametrize("counts,culprit", [
    ({"drafted": -1}, "drafted"),
    ({"drafted": 2, "accepted": 3}, "accepted"),
    ({"drafted": 3, "accepted": 1, "forced": 2}, "forced"),
    ({"emitted": 1.5}, "emitted"),
])
def test_impossible_figures_are_refused(counts, culprit):
    with pytest.raises(SpecError, match=culprit):
        SpecFigures(**counts)


@pytest.mark.parametrize("bad,culprit", [
    ({"total": {"drafted": "many"}}, "not an integer"),
    ({"total": [1, 2]}, "must be an object"),
    ({"by_drafter": ["suffix"]}, "by_drafter"),
    ("spec", "must be an object"),
])
def test_bad_json_is_refused_naming_the_part(bad, culprit):
    with pytest.raises(SpecError, match=culprit):
        SpecReport.from_dict(bad)
