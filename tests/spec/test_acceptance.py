"""Online calibration of draft scores: identity before evidence, learns the rates it sees (within
a binomial bound), monotone, censored at the first rejection, forgets with its half-life."""
import math
import random

import pytest

from agentrt.errors import SpecConfigError
from agentrt.spec.acceptance import AcceptanceCalibration


def test_without_evidence_a_score_means_itself():
    cal = AcceptanceCalibration(bins=10)
    assert [cal(s) for s in (0.0, 0.05, 0.42, 0.55, 0.99, 1.0)] == pytest.approx([0.05, 0.05, 0.45, 0.55, 0.95, 0.95])
    assert cal.evidence == 0.0


def test_learns_the_acceptance_rate_of_a_score_bin():
    # scores of 0.5-0.6 accepted with p = 0.85 (one free position per verification); after n = 2000
    # observations the posterior mean is within 4 standard errors (+ the prior's pull) of 0.85
    rng = random.Random(0)
    cal = AcceptanceCalibration(bins=10, prior_strength=8.0, half_life=math.inf)
    n, p = 2000, 0.85
    for _ in range(n):
        cal.observe([0.55], 1 if rng.random() < p else 0)
    bound = 4 * math.sqrt(p * (1 - p) / n) + 8.0 * (p - 0.55) / n
    assert abs(cal(0.55) - p) < bound
    assert cal(0.35) == pytest.approx(0.35)  # other bins keep their prior
    assert cal.evidence == pytest.approx(n)


def test_the_map_never_falls_as_the_score_rises():
    rng = random.Random(1)
    cal = AcceptanceCalibration(bins=10, half_life=math.inf)
    for _ in range(400):  # bin 0.5 held 90% of the time, bin 0.7 only 30%
        cal.observe([0.55], 1 if rng.random() < 0.9 else 0)
        cal.observe([0.75], 1 if rng.random() < 0.3 else 0)
    probs = [cal((b + 0.5) / 10) for b in range(10)]
    assert probs == sorted(probs)
    assert cal(0.55) == pytest.approx(cal(0.75))  # pooled: one rate for both
    assert 0.45 < cal(0.65) < 0.75


def test_only_positions_up_to_the_first_rejection_are_evidence():
    cal = AcceptanceCalibration(bins=10, half_life=math.inf)
    cal.observe([0.95, 0.95, 0.15, 0.15], accepted=2)  # two held, the third rejected, the fourth never tested
    assert cal.evidence == pytest.approx(3)
    assert cal(0.95) > 0.95 and cal(0.15) < 0.15
    cal.observe([0.95, 0.95], accepted=2)  # all held: no failure
    assert cal.evidence == pytest.approx(5)
    cal.observe([], accepted=0)  # nothing free was drafted
    assert cal.evidence == pytest.approx(5)


def test_old_evidence_fades_with_the_half_life():
    cal = AcceptanceCalibration(bins=10, prior_strength=1.0, half_life=100.0)
    for _ in range(1000):
        cal.observe([0.55], 0)
    assert cal(0.55) < 0.05
    for _ in range(1000):  # ten half-lives later the rejections weigh ~0.1%
        cal.observe([0.55], 1)
    assert cal(0.55) > 0.95
    assert cal.evidence == pytest.approx(100 / math.log(2), rel=0.02)  # sum of 0.5^(i/100)


def test_bad_input_is_refused():
    with pytest.raises(SpecConfigError, match="accepted"):
        AcceptanceCalibration().observe([0.5], accepted=2)
    with pytest.raises(SpecConfigError, match="bins"):
        AcceptanceCalibration(bins=0)
    with pytest.raises(SpecConfigError, match="half_life"):
        AcceptanceCalibration(half_life=0.0)
