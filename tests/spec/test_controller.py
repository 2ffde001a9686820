"""The k controller against synthetic cost models: the load-adaptive consequences, policies,
optimality against brute force, and the break-even and adaptive k of a 7B model on an H100-class GPU."""
import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest

from agentrt.errors import SpecConfigError
from agentrt.spec.arithmetic import expected_tokens, expected_tokens_positional
from agentrt.spec.controller import (
    KController,
    SeqDraftState,
    StepPrefill,
    break_even_batch,
    speculative_goodput,
)
from agentrt.spec.cost_model import StepCostModel

# CPU-like: ridge ~14 tokens at 200 context, big fixed overhead (eager PyTorch on 2 cores).
CPU = StepCostModel(overhead_s=0.015, bytes_fixed=270e6, bytes_per_kv_token=92160, flops_per_token=270e6,
                    read_bw=30e9, flop_rate=400e9, attn_flops_per_pair=69120)
# GPU-like: an 8B model on an H100-class part, ridge ~175 tokens.
GPU = StepCostModel(overhead_s=0.002, bytes_fixed=16e9, bytes_per_kv_token=131072, flops_per_token=16e9,
                    read_bw=4.0e12, flop_rate=700e12, attn_flops_per_pair=4 * 32 * 4096)
# A 6.74B-parameter model in bf16 at 3.35 TB/s and 494.5 TFLOP/s, 0.082 GB of KV per 640-token sequence.
H100_7B = StepCostModel(overhead_s=0.0, bytes_fixed=13.5e9, bytes_per_kv_token=0.082e9 / 640,
                        flops_per_token=13.48e9, read_bw=3.35e12, flop_rate=494.5e12)
# A pure roofline with a small overhead, where the plain step turns compute-bound at ~40 sequences.
SMALL_OVERHEAD = StepCostModel(overhead_s=0.0001, bytes_fixed=2e9, bytes_per_kv_token=0.0, flops_per_token=1e9,
                               read_bw=1e12, flop_rate=20e12)


def seqs(batch: int, alpha: float, kmax: int = 32, cost: float = 0.0, ctx: int = 200) -> list[SeqDraftState]:
    return [SeqDraftState(i, [alpha] * kmax, cost, ctx) for i in range(batch)]


@pytest.mark.parametrize("model,cost", [(CPU, 5e-4), (GPU, 5e-4), (GPU, 2e-3)])
def test_k_grows_with_alpha(model, cost):
    ctl = KController(model, kmax_cap=32)
    ks = [ctl.choose(seqs(1, a, cost=cost)).k[0] for a in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)]
    assert ks == sorted(ks) and ks[-1] >= ks[0] + 5, ks


@pytest.mark.parametrize("model,last_k", [(CPU, 1), (GPU, 0), (H100_7B, 0)])
def test_k_falls_as_more_sequences_run(model, last_k):
    # CPU keeps one likely draft at B = 1024: its 1024 contexts' K/V read (~0.2 s) is paid by the
    # step whatever k is, which makes a draft's linear-layer cost small beside it
    ctl = KController(model, kmax_cap=16)
    mean_k = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        alloc = ctl.choose(seqs(batch, 0.8, kmax=16, ctx=64))
        mean_k.append(sum(alloc.k) / batch)
    assert mean_k == sorted(mean_k, reverse=True), mean_k
    assert mean_k[0] >= 8 and mean_k[-1] == last_k


@pytest.mark.parametrize("model", [CPU, GPU, H100_7B])
def test_long_contexts_bring_speculation_back_at_the_same_batch(model):
    # MagicDec's inversion: the KV read makes a long-context step memory-bound again
    ctl = KController(model, kmax_cap=16)
    short = ctl.choose(seqs(128, 0.8, kmax=16, ctx=64))
    long = ctl.choose(seqs(128, 0.8, kmax=16, ctx=16384))
    assert short.compute_bound and sum(long.k) > sum(short.k) + 128


def test_k_is_zero_once_the_step_is_compute_bound():
    ctl = KController(SMALL_OVERHEAD, kmax_cap=16)
    for batch in (64, 128, 512):
        batch_seqs = seqs(batch, 0.9, kmax=16)
        assert SMALL_OVERHEAD.is_compute_bound(batch, batch * 200)  # already without drafts
        alloc = ctl.choose(batch_seqs)
        assert alloc.k == [0] * batch and alloc.compute_bound
    # the 7B model at B = 2000 on short contexts is compute-bound too
    assert KController(H100_7B, 16).choose(seqs(2000, 0.8, kmax=16, ctx=64)).k == [0] * 2000


def test_overhead_makes_speculation_pay_a_little_past_the_ridge():
    # Past the ridge a token costs its FLOPs; with a large fixed overhead the plain step's average
    # cost per token is higher still, so a likely draft token still pays: the controller follows
    # the cost model, not a rule of thumb. Check against alpha vs B*s / T(B) (s: a token's
    # linear-layer FLOPs; attention reads the K/V whatever k is, so a draft adds no attention time).
    batch, ctx = 40, 50
    assert CPU.is_compute_bound(batch, batch * ctx, batch * ctx)
    s = CPU.compute_s(1)
    threshold = batch * s / CPU.predict(batch, batch * ctx, batch * ctx)  # about 0.56
    hi = KController(CPU, 8).choose(seqs(batch, threshold + 0.05, kmax=8, ctx=ctx))
    lo = KController(CPU, 8).choose(seqs(batch, threshold - 0.05, kmax=8, ctx=ctx))
    assert sum(hi.k) > 0 and sum(lo.k) == 0


@pytest.mark.parametrize("model", [CPU, GPU])
def test_idle_engine_with_high_alpha_drafts_deep(model):
    # one sequence, a cheap drafter (50 us per token, n-gram-like) offering 32 tokens
    alloc = KController(model, kmax_cap=32).choose(seqs(1, 0.95, kmax=32, cost=5e-5))
    assert alloc.k[0] >= 16
    forced = KController(model, kmax_cap=32).choose(seqs(1, 1.0, kmax=32, cost=5e-5))
    assert forced.k == [32]  # grammar-forced continuation: take everything offered


def test_never_more_drafts_than_offered_or_the_cap():
    rng = random.Random(3)
    batch = [SeqDraftState(i, [1.0] * rng.randint(0, 40), 0.0, rng.randint(1, 4000)) for i in range(12)]
    for cap in (0, 3, 16, 64):
        alloc = KController(GPU, kmax_cap=cap).choose(batch)
        for s, k in zip(batch, alloc.k):
            assert 0 <= k <= min(cap, len(s.accept_probs))
        fixed = KController(GPU, kmax_cap=cap, policy="fixed", fixed_k=20).choose(batch)
        assert fixed.k == [min(20, cap, len(s.accept_probs)) for s in batch]


def test_fixed_and_off_policies():
    batch = [SeqDraftState("a", [0.9] * 8, 1e-4, 100), SeqDraftState("b", [0.5] * 2, 1e-4, 300)]
    fixed = KController(CPU, policy="fixed", fixed_k=4).choose(batch)
    assert fixed.k == [4, 2]
    assert fixed.expected_tokens == pytest.approx([expected_tokens(0.9, 4), expected_tokens(0.5, 2)])
    assert fixed.predicted_draft_s == pytest.approx(6e-4)
    assert fixed.predicted_step_s == pytest.approx(CPU.predict(8, 400, 5 * 100 + 3 * 300) + 6e-4)
    assert fixed.predicted_goodput == pytest.approx(sum(fixed.expected_tokens) / fixed.predicted_step_s)
    off = KController(CPU, policy="off").choose(batch)
    assert off.k == [0, 0] and off.expected_tokens == [1.0, 1.0]
    assert off.predicted_step_s == pytest.approx(CPU.predict(2, 400, 400))
    with pytest.raises(SpecConfigError, match="policy"):
        KController(CPU, policy="sometimes")


def test_greedy_matches_brute_force_on_random_small_problems():
    rng = random.Random(0)
    for _ in range(150):
        model = rng.choice([CPU, GPU, SMALL_OVERHEAD])
        _assert_optimal(model, _random_batch(rng, lambda: rng.choice([0.0, 1e-4, 1e-3, 5e-3]), max_k=6))


def test_greedy_matches_brute_force_where_rows_come_in_tiles():
    # a step past each 4 rows: not convex in the tokens added, so one greedy pass is not enough;
    # one draft cost per step (one drafter), as the engine runs
    rng = random.Random(1)
    for _ in range(150):
        model = replace(rng.choice([CPU, GPU, SMALL_OVERHEAD]), row_tile=4)
        model = replace(model, tile_s=rng.choice([0.1, 0.5, 2.0]) * model.predict(1, 0))
        cost = rng.choice([0.0, 1e-4, 1e-3])
        _assert_optimal(model, _random_batch(rng, lambda: cost, max_k=7))


def _random_batch(rng: random.Random, cost, max_k: int) -> list[SeqDraftState]:
    return [SeqDraftState(i, [rng.choice([1.0, rng.uniform(0.1, 1.0)]) for _ in range(rng.randint(0, max_k))],
                          cost(), rng.randint(10, 5000))
            for i in range(rng.randint(1, 3))]


def _assert_optimal(model: StepCostModel, batch: list[SeqDraftState]) -> None:
    greedy = KController(model, kmax_cap=32).choose(batch)
    best = max(_goodput(model, batch, ks) for ks in itertools.product(*[range(len(s.accept_probs) + 1) for s in batch]))
    assert greedy.predicted_goodput == pytest.approx(best, rel=1e-9)


def test_a_full_row_tile_drafts_only_what_pays_for_the_next_tile():
    # the quantized AMX path's shape: the linears' ridge past 40 rows, and a 17th row costing ~25%
    # of a 16-row step; 16 one-token sequences
    smooth = replace(CPU, overhead_s=0.002, flops_per_token=90e6, row_tile=16)
    tiled = replace(smooth, tile_s=0.25 * smooth.predict(16, 16 * 200, 16 * 200))
    assert sum(KController(smooth, kmax_cap=8).choose(seqs(16, 0.15, kmax=8)).k) > 0  # priced smooth, it drafts
    assert sum(KController(tiled, kmax_cap=8).choose(seqs(16, 0.15, kmax=8)).k) == 0  # ~16 x 0.15 tokens: < 25%
    assert sum(KController(tiled, kmax_cap=8).choose(seqs(16, 0.95, kmax=8)).k) > 16  # likely drafts fill the next tile
    # 10 sequences leave 6 rows in the tile: drafts there cost no step
    assert 0 < sum(KController(tiled, kmax_cap=8).choose(seqs(10, 0.15, kmax=8)).k) <= 6


def _goodput(model, batch, ks):
    tokens = sum(k + 1 for k in ks)
    kv = sum(s.context_len for s in batch)
    pairs = sum((k + 1) * s.context_len for s, k in zip(batch, ks))
    draft = sum(k * s.draft_cost_s_per_token for s, k in zip(batch, ks))
    emitted = sum(expected_tokens_positional(s.accept_probs[:k]) for s, k in zip(batch, ks))
    return emitted / (model.predict(tokens, kv, pairs) + draft)


def test_adaptive_k_against_the_batch_on_a_7b_model():
    # at alpha = 0.8, 640-token contexts: best k = 5 at B = 1 (c = 0.15 of a step), 3-4 at B = 32;
    # from B = 128 on the linears are compute-bound, but each sequence's K/V read (24 us of a
    # step, whatever k is) keeps a draft of 2 paying (MagicDec's long-context regime)
    ctl = KController(H100_7B, kmax_cap=16)
    c = 0.15 * H100_7B.predict(1, 640, 640)
    assert ctl.choose(seqs(1, 0.8, kmax=16, cost=c, ctx=640)).k == [5]
    assert set(ctl.choose(seqs(32, 0.8, kmax=16, ctx=640)).k) <= {3, 4}
    assert set(ctl.choose(seqs(128, 0.8, kmax=16, ctx=640)).k) == {2}
    assert set(ctl.choose(seqs(1024, 0.8, kmax=16, ctx=640)).k) == {2}


def test_break_even_batch_against_the_formula():
    # fixed k = 4 at alpha = 0.5 loses once E * T(B, 0) > T(B, 4) turns, with the linears
    # compute-bound under k = 4 and memory-bound without: T(B, 0) = W + B r, T(B, 4) = 5 B c + B r
    # (W weights' read, c a token's FLOPs, r one sequence's K/V read; ms)
    e = expected_tokens(0.5, 4)
    w, c, r = 13.5 / 3.35, 13.48 / 494.5, 0.082 / 3.35
    b_star = e * w / (5 * c - (e - 1) * r)
    assert break_even_batch(0.5, 4, 640, cost_model=H100_7B) == int(b_star) + 1
    assert KController(H100_7B).break_even_batch(0.5, 4, 640) == int(b_star) + 1
    gain = speculative_goodput(H100_7B, 64, 0.5, 4, 640) / speculative_goodput(H100_7B, 64, 0.5, 0, 640)
    assert gain == pytest.approx(e * (w + 64 * r) / (5 * 64 * c + 64 * r))
    assert break_even_batch(0.5, 4, 640, cost_model=H100_7B, max_batch=50) is None
    # at alpha = 0.8 the K/V read every step pays makes fixed k = 4 win at any batch
    assert break_even_batch(0.8, 4, 640, cost_model=H100_7B) is None


def test_break_even_falls_with_alpha_and_draft_length():
    b = [break_even_batch(a, 4, 640, cost_model=H100_7B) for a in (0.3, 0.5, 0.7)]
    assert b[0] < b[1] < b[2]
    assert break_even_batch(0.6, 8, 640, cost_model=H100_7B) < break_even_batch(0.6, 2, 640, cost_model=H100_7B)


def test_allocation_is_consistent_and_empty_batch_is_fine():
    batch = [SeqDraftState(i, [0.9, 0.9, 1.0, 0.6, 0.6], 2e-4, 150 * (i + 1)) for i in range(3)]
    alloc = KController(CPU).choose(batch)
    assert alloc.expected_tokens == pytest.approx(
        [expected_tokens_positional(s.accept_probs[:k]) for s, k in zip(batch, alloc.k)])
    assert alloc.predicted_step_s == pytest.approx(alloc.predicted_target_s + alloc.predicted_draft_s)
    assert alloc.predicted_goodput == pytest.approx(_goodput(CPU, batch, alloc.k))
    empty = KController(CPU).choose([])
    assert empty.k == [] and empty.predicted_goodput == 0.0


def test_bad_sequence_input_names_the_sequence():
    with pytest.raises(SpecConfigError, match="'s7'.*accept_probs"):
        KController(CPU).choose([SeqDraftState("s7", [0.5, 1.2], 0.0, 10)])
    with pytest.raises(SpecConfigError, match="'s8'"):
        KController(CPU).choose([SeqDraftState("s8", [0.5], -1.0, 10)])


def test_a_prompt_chunk_in_the_step_is_priced_and_makes_drafts_cheap_beside_it():
    # SMALL_OVERHEAD is compute-bound from ~40 sequences on: 64 decoding sequences draft nothing,
    # since a draft costs a full token's compute and must beat the step's goodput. With 4096
    # prompt rows riding along the step takes ~65x longer for the same 64 emitted tokens, so a
    # draft accepted with 0.9 pays for itself many times over.
    ctl = KController(SMALL_OVERHEAD, kmax_cap=4)
    batch = seqs(64, 0.9, kmax=4)
    plain = ctl.choose(batch)
    chunk = StepPrefill(tokens=4096, pairs=4096 * 2048)
    with_chunk = ctl.choose(batch, chunk)
    assert plain.k == [0] * 64
    assert with_chunk.k == [4] * 64
    assert with_chunk.predicted_target_s == pytest.approx(
        SMALL_OVERHEAD.predict(64 * 5 + 4096, 64 * 200, 64 * 5 * 200 + 4096 * 2048))
    assert plain.predicted_target_s == pytest.approx(SMALL_OVERHEAD.predict(64, 64 * 200, 64 * 200))
    with pytest.raises(SpecConfigError, match="StepPrefill"):
        ctl.choose(batch, StepPrefill(tokens=-1))
