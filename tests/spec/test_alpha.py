"""Online α: the prior, adaptation within a request, censored observations, grammar-forced tokens
excluded, and per-drafter priors that learn across requests."""
import math
import random

import pytest

from agentrt.errors import SpecConfigError
from agentrt.spec.alpha import DEFAULT_PRIOR, AlphaPrior, AlphaRegistry, OnlineAlpha


def verify_chain(rng: random.Random, alpha: float, k: int) -> int:
    """Accepted drafts of one verification under the stopping rule, i.i.d. acceptance alpha."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


def test_fresh_estimate_is_the_prior_mean():
    assert OnlineAlpha().estimate() == pytest.approx(DEFAULT_PRIOR.mean)
    assert OnlineAlpha(AlphaPrior(0.83, 10.0)).estimate() == pytest.approx(0.83)


def test_update_is_the_censored_beta_posterior():
    # without decay: 3 accepted of 8 is 3 successes and ONE failure (drafts 5..8 were never tested)
    a = OnlineAlpha(AlphaPrior(0.5, 4.0), half_life_tokens=math.inf, half_life_steps=math.inf)
    a.update(8, 3)
    assert a.estimate() == pytest.approx((2 + 3) / (4 + 4))
    a.update(4, 4)  # all accepted: four successes, no failure
    assert a.estimate() == pytest.approx((2 + 7) / (4 + 8))
    assert a.evidence_tokens == pytest.approx(8)
    assert (a.total_drafted, a.total_accepted) == (12, 7)


def test_censored_estimate_is_unbiased_where_naive_counting_is_not():
    # 1500 verifications of k = 8 at alpha = 0.7 give ~4000 observed tokens; the standard error
    # is ~0.007, so 0.03 is a > 4-sigma bound. Counting rejected-or-unseen drafts as failures
    # (accepted / drafted) lands near 0.26.
    rng = random.Random(0)
    a = OnlineAlpha(AlphaPrior(0.5, 2.0), half_life_tokens=math.inf, half_life_steps=math.inf)
    drafted = accepted_total = 0
    for _ in range(1500):
        acc = verify_chain(rng, 0.7, 8)
        a.update(8, acc)
        drafted, accepted_total = drafted + 8, accepted_total + acc
    assert abs(a.estimate() - 0.7) < 0.03
    assert accepted_total / drafted < 0.35


def test_adapts_within_a_few_steps_after_a_burst():
    a = OnlineAlpha(AlphaPrior(0.6, 4.0), half_life_tokens=12.0, half_life_steps=4.0)
    for _ in range(10):  # free prose: every draft rejected at once
        a.update(4, 0)
    assert a.estimate() < 0.35
    trace = []
    for _ in range(2):  # the model starts copying a span of the prompt
        a.update(8, 8)
        trace.append(a.estimate())
    assert trace[-1] > 0.8
    for _ in range(3):  # and stops
        a.update(8, 0)
        trace.append(a.estimate())
    assert trace[1:] == sorted(trace[1:], reverse=True) and trace[-1] < 0.7


def test_decay_weights_newest_evidence_most():
    # token half-life 1: each observation halves the weight of every earlier one
    a = OnlineAlpha(AlphaPrior(0.5, 1e-6), half_life_tokens=1.0, half_life_steps=math.inf)
    a.update(1, 0)  # failure
    a.update(2, 1)  # success then failure: weights 1/2 and 1, old failure 1/4
    assert a.evidence_tokens == pytest.approx(1.75)
    assert a.estimate() == pytest.approx(0.5 / 1.75, rel=1e-5)


def test_forced_tokens_are_excluded_from_the_free_estimate():
    a = OnlineAlpha(AlphaPrior(0.4, 4.0), half_life_tokens=math.inf, half_life_steps=math.inf)
    a.update(10, 10, forced=10)  # a fully grammar-forced run says nothing about the drafter
    assert a.estimate() == pytest.approx(0.4) and a.evidence_tokens == 0
    b, c = OnlineAlpha(), OnlineAlpha()
    b.update(8, 5, forced=3)  # 2 free successes, then the rejection
    c.update(5, 2)
    assert b.estimate() == pytest.approx(c.estimate())
    assert b.total_forced == 3


def test_accept_probs_marks_forced_positions():
    a = OnlineAlpha(AlphaPrior(0.7, 4.0))
    assert a.accept_probs(4, forced_positions=[0, 1]) == pytest.approx([1.0, 1.0, 0.7, 0.7])
    assert a.accept_probs(0) == []


@pytest.mark.parametrize("drafted,accepted,forced", [(3, 4, 0), (4, 2, 3), (-1, 0, 0), (2, -1, 0)])
def test_inconsistent_counts_are_rejected(drafted, accepted, forced):
    with pytest.raises(SpecConfigError, match="num_accepted"):
        OnlineAlpha().update(drafted, accepted, forced)


def test_bad_priors_are_named():
    with pytest.raises(SpecConfigError, match="mean"):
        AlphaPrior(1.0)
    with pytest.raises(SpecConfigError, match="strength"):
        AlphaPrior(0.5, 0.0)
    with pytest.raises(SpecConfigError, match="half_life"):
        OnlineAlpha(half_life_tokens=0.0)
    with pytest.raises(SpecConfigError, match="half_life"):
        OnlineAlpha(half_life_steps=-1.0)


def test_step_half_life_ages_evidence_once_per_verification():
    a = OnlineAlpha(AlphaPrior(0.5, 1e-6), half_life_tokens=math.inf, half_life_steps=1.0)
    a.update(4, 4)  # 4 successes
    a.update(1, 0)  # one failure; the 4 successes now weigh 2
    assert a.estimate() == pytest.approx(2 / 3, rel=1e-5)


def test_registry_seeds_per_drafter_and_learns_across_requests():
    reg = AlphaRegistry(priors={"ngram": AlphaPrior(0.3, 8.0)}, default=AlphaPrior(0.5, 4.0))
    assert reg.new_sequence("ngram").estimate() == pytest.approx(0.3)
    assert reg.new_sequence("eagle").estimate() == pytest.approx(0.5)
    rng = random.Random(1)
    for _ in range(40):  # 40 requests of 20 verifications, the n-gram drafter doing well
        seq = reg.new_sequence("ngram")
        for _ in range(20):
            seq.update(6, verify_chain(rng, 0.9, 6))
    # the shared estimate saw ~4000 tokens at 0.9: a new request now starts near it
    assert reg.estimate("ngram") == pytest.approx(0.9, abs=0.03)
    fresh = reg.new_sequence("ngram")
    assert fresh.estimate() == pytest.approx(reg.estimate("ngram"))
    assert fresh.prior.strength == reg.seq_prior_strength  # weak prior: still adapts within the request
    for _ in range(3):
        fresh.update(6, 0)
    assert fresh.estimate() < 0.6
    assert reg.estimate("eagle") == pytest.approx(0.5)  # drafters do not share estimates
