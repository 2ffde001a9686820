"""The step residual (what engine steps cost beyond the fitted model) and the k controller priced
with it: buckets, medians, interpolation, and k choices that follow the measured curve."""
import pytest

from agentrt.errors import SpecConfigError
from agentrt.spec.arithmetic import expected_tokens_positional
from agentrt.spec.controller import KController, SeqDraftState, StepPrefill
from agentrt.spec.cost_model import StepCostModel
from agentrt.spec.step_residual import StepResidual, bucket_of

# The quantized embedded model's fit on a Zen 4 EPYC: flat to ~6 rows, then ~0.8 ms a row at 780 tokens.
Q4_FIT = StepCostModel(overhead_s=0.00089, bytes_fixed=97.6e6, bytes_per_kv_token=53868, flops_per_token=69.1e6,
                       read_bw=34.4e9, flop_rate=140.8e9, attn_flops_per_pair=75378, source="fit")


def test_buckets_are_exact_to_16_rows_then_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 15, 16, 17, 31, 32, 100)] == [1, 2, 15, 16, 16, 16, 32, 64]
    with pytest.raises(SpecConfigError, match="at least one row"):
        bucket_of(0)


def test_nothing_learned_adds_nothing_and_few_samples_stay_out():
    r = StepResidual(min_samples=3)
    assert r(5) == 0.0
    r.observe(5, 0.010, 0.008)
    r.observe(5, 0.010, 0.008)
    assert r(5) == 0.0
    r.observe(5, 0.011, 0.008)
    assert r(5) == pytest.approx(0.002) and r(1) == pytest.approx(0.002)  # the one learned count, for every count


def test_the_median_ignores_a_delayed_step_and_the_window_forgets():
    r = StepResidual(window=5, min_samples=1)
    for extra in (0.001, 0.001, 0.050, 0.001, 0.001):  # one step another process delayed
        r.observe(3, 0.005 + extra, 0.005)
    assert r(3) == pytest.approx(0.001)
    for _ in range(5):
        r.observe(3, 0.009, 0.005)
    assert r(3) == pytest.approx(0.004)


def test_counts_between_learned_ones_interpolate_and_ends_extend():
    r = StepResidual(min_samples=1)
    r.observe(6, 0.005, 0.001)  # +4 ms
    r.observe(10, 0.007, 0.001)  # +6 ms
    assert r(1) == pytest.approx(0.004) and r(8) == pytest.approx(0.005)
    assert r(14) == pytest.approx(0.008)  # past the largest: on along the line through 6 and 10 rows
    assert r(20) == pytest.approx(0.006 + 0.0005 * (16 - 10))  # bucket 16
    assert r(40) == pytest.approx(0.006 + 0.0005 * (20 - 10)) == r(500)  # to twice 10 rows, then held
    r.observe(3, 0.001, 0.001)  # +0 ms: below half the largest count, out of the trend
    assert r(14) == pytest.approx(0.008)
    r.observe(64, 0.011, 0.001)  # +10 ms (bucket 64), alone in the upper half: held
    assert r(10) == pytest.approx(0.006) and r(40) == pytest.approx(0.006 + 0.004 * (32 - 10) / (64 - 10))
    assert r(500) == pytest.approx(0.010)


def test_a_fit_whose_slope_is_off_is_corrected_past_the_rows_learned():
    # a fit timed 25% slow on the rows (another process held a core): steps of 1-8 rows teach a
    # residual that falls with the rows, and 9-16 rows, never run yet, are priced along it
    slow = StepCostModel(**{**Q4_FIT.__dict__, "flop_rate": Q4_FIT.flop_rate / 1.25,
                            "attn_flops_per_pair": 1.25 * Q4_FIT.attn_flops_per_pair})
    def fit(n): return slow.predict(n, 780, n * 780)
    def true(n): return Q4_FIT.predict(n, 780, n * 780)
    r = StepResidual(min_samples=1)
    for n in range(1, 9):
        r.observe(n, true(n), fit(n))
    assert fit(16) + r(8) > 1.15 * true(16)  # held at 8 rows' residual: 16 rows priced ~19% dear
    for n in (12, 16):
        assert fit(n) + r(n) == pytest.approx(true(n), rel=0.08)
    for alpha in (0.9, 0.95, 0.98, 1.0):  # the k chosen does, by the true costs, what the true fit's k does
        probs = [alpha] * 15
        seq = [SeqDraftState(0, probs, 0.0, 780)]
        best = KController(Q4_FIT, kmax_cap=15).choose(seq).k[0]
        got = KController(slow, kmax_cap=15, residual=r).choose(seq).k[0]
        def goodput(k): return expected_tokens_positional(probs[:k]) / true(k + 1)
        assert goodput(got) >= 0.97 * goodput(best), (alpha, got, best)
    assert KController(slow, kmax_cap=15, residual=r).choose([SeqDraftState(0, [1.0] * 15, 0.0, 780)]).k == [15]


def test_bad_settings_are_refused():
    with pytest.raises(SpecConfigError, match="window"):
        StepResidual(window=4, min_samples=5)


def _measured(residual_ms: dict[int, float]) -> StepResidual:
    r = StepResidual(min_samples=1)
    for n, ms in residual_ms.items():
        r.observe(n, Q4_FIT.predict(n, 780, n * 780) + ms / 1e3, Q4_FIT.predict(n, 780, n * 780))
    return r


# Zen 4 steps of the embedded model, 1 / 2 / 5 / 9 / 15 rows: 5.5 / 6.8 / 8.9 / 13.3 / 17.8 ms
ZEN4_STEPS_MS = {1: 5.48, 2: 6.77, 5: 8.88, 9: 13.28, 15: 17.76}


def test_measured_steps_make_deep_copies_pay_where_the_bare_fit_stops_short():
    residual = _measured({n: ms - 1e3 * Q4_FIT.predict(n, 780, n * 780) for n, ms in ZEN4_STEPS_MS.items()})
    seq = [SeqDraftState(0, [0.95] * 15, 0.0, 780)]
    bare = KController(Q4_FIT, kmax_cap=15).choose(seq).k[0]
    priced = KController(Q4_FIT, kmax_cap=15, residual=residual).choose(seq)
    assert priced.k[0] > bare
    # the measured curve's best k for α = 0.95, found by hand over the measured points
    steps = {n - 1: ms for n, ms in ZEN4_STEPS_MS.items()}
    best = max(steps, key=lambda k: expected_tokens_positional([0.95] * k) / steps[k])
    assert abs(priced.k[0] - best) <= 2, (priced.k, best)
    assert priced.predicted_residual_s == pytest.approx(residual(priced.k[0] + 1))
    assert priced.predicted_target_s == pytest.approx(
        Q4_FIT.predict(priced.k[0] + 1, 780, 780 + priced.k[0] * 780) + priced.predicted_residual_s)


def test_a_first_draft_row_that_costs_a_jump_still_drafts_when_the_run_pays():
    # the second row of a step costs 3 ms more than the fit says, later rows cost what it says:
    # one draft at α 0.6 does not pay for the jump, fifteen at 0.97 do
    residual = _measured({1: 0.0, 2: 3.0, 3: 3.0, 16: 3.0})
    ctl = KController(Q4_FIT, kmax_cap=15, residual=residual)
    assert ctl.choose([SeqDraftState(0, [0.6], 0.0, 780)]).k == [0]
    assert ctl.choose([SeqDraftState(0, [0.97] * 15, 0.0, 780)]).k[0] >= 8


@pytest.mark.parametrize("alpha,prefill", [(0.5, 0), (0.8, 0), (0.95, 0), (0.9, 64)])
def test_one_sequence_gets_the_best_k_of_all(alpha, prefill):
    residual = _measured({1: 0.4, 2: 2.0, 4: 1.0, 8: 2.5, 16: 0.5})  # no shape promised
    ctl = KController(Q4_FIT, kmax_cap=15, residual=residual)
    probs = [alpha] * 15
    pre = StepPrefill(prefill, prefill * 780)
    chosen = ctl.choose([SeqDraftState(0, probs, 1e-5, 780)], pre)
    goodputs = [ctl._allocation([SeqDraftState(0, probs, 1e-5, 780)], [k], pre).predicted_goodput for k in range(16)]
    assert chosen.predicted_goodput == pytest.approx(max(goodputs))


def test_batches_still_run_the_greedy_and_a_residual_never_prices_a_step_below_a_tenth():
    residual = _measured({1: -50.0, 64: -50.0})  # a nonsense residual: far below the fit
    ctl = KController(Q4_FIT, kmax_cap=8, residual=residual)
    alloc = ctl.choose([SeqDraftState(i, [0.9] * 8, 0.0, 200) for i in range(4)])
    k = sum(alloc.k)
    assert alloc.predicted_target_s == pytest.approx(0.1 * Q4_FIT.predict(4 + k, 800, 800 + 200 * k))
    assert all(0 <= k <= 8 for k in alloc.k)
