"""Scheduler admission order and prefill grouping, on the scheduler alone (no model): shortest
prompt first among equal priorities (prefix-cache hits excluded), first come first served with
prefill_order="arrival", and the split of a burst of prompts over steps (_first_group)."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.step.scheduler import Scheduler, SchedulerConfig
from agentrt.engine.step.sequence import Sequence

BS = 4  # block size
PARAMS = SamplingParams(max_tokens=8, temperature=0)


def _sched(step_cost=None, prefix_caching=False, num_blocks=512, **cfg) -> Scheduler:
    cfg.setdefault("prefill_order", "shortest")  # both are opt-in; these tests are about them
    cfg.setdefault("group_prefills", True)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, BS, prefix_caching=prefix_caching), step_cost=step_cost)


def _seq(seq_id: int, n: int, arrival: float, priority: float = 0.0, start: int | None = None) -> Sequence:
    """n prompt tokens, distinct from other sequences' (no shared prefix) unless start says so.
    arrival: an order key, made milliseconds from now (a request waiting a second or more is
    aged: see test_a_long_wait_goes_before_shorter_prompts)."""
    first = 1000 * (seq_id + 1) if start is None else start
    return Sequence(seq_id, list(range(first, first + n)), PARAMS, priority=priority,
                    arrival=time.monotonic() + arrival * 1e-3)


def _ids(batch) -> list[int]:
    return [s.seq_id for s in batch.seqs]


def _advance(batch) -> None:
    """What the engine does after a step: the fed tokens are computed, and a sequence whose
    prompt is done samples a token (so it decodes one token per later step)."""
    for seq, n in zip(batch.seqs, batch.num_new):
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(7)


# --- order -----------------------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs", [1, 64])
def test_shortest_admits_a_short_prompt_before_an_earlier_long_one(max_num_seqs):
    s = _sched(max_num_seqs=max_num_seqs)
    s.add(_seq(0, 200, arrival=0.0))
    s.add(_seq(1, 10, arrival=1.0))
    assert _ids(s.schedule()) == ([1] if max_num_seqs == 1 else [1, 0])


def test_a_long_wait_goes_before_shorter_prompts():
    s = _sched(shortest_first_max_wait_s=0.5)
    old = _seq(0, 200, arrival=0.0)
    old.arrival -= 0.6  # waited past the limit: no longer passed by shorter prompts
    s.add(old)
    s.add(_seq(1, 10, arrival=1.0))
    s.add(_seq(2, 20, arrival=2.0))
    assert _ids(s.schedule()) == [0, 1, 2]


@pytest.mark.parametrize("max_num_seqs", [1, 64])
def test_arrival_keeps_first_come_first_served(max_num_seqs):
    s = _sched(max_num_seqs=max_num_seqs, prefill_order="arrival")
    s.add(_seq(1, 10, arrival=1.0))  # added first, but arrived later
    s.add(_seq(0, 200, arrival=0.0))
    assert _ids(s.schedule()) == ([0] if max_num_seqs == 1 else [0, 1])


def test_equal_sizes_keep_arrival_order():
    s = _sched()
    for i, arrival in [(2, 2.0), (0, 0.0), (1, 1.0)]:
        s.add(_seq(i, 12, arrival=arrival))
    assert _ids(s.schedule()) == [0, 1, 2]


def test_priority_dominates_size():
    s = _sched(max_num_seqs=1)
    s.add(_seq(0, 10, arrival=0.0, priority=2.0))  # short but less urgent
    s.add(_seq(1, 200, arrival=1.0, priority=1.0))
    s.add(_seq(2, 50, arrival=2.0, priority=1.0))
    assert _ids(s.schedule()) == [2]  # the shortest of the most urgent
    s2 = _sched()
    for seq in (_seq(0, 10, 0.0, 2.0), _seq(1, 200, 1.0, 1.0), _seq(2, 50, 2.0, 1.0)):
        s2.add(seq)
    assert _ids(s2.schedule()) == [2, 1, 0]


def test_the_token_budget_goes_to_the_short_prompt_first():
    s = _sched(max_num_batched_tokens=64)
    s.add(_seq(0, 100, arrival=0.0))
    s.add(_seq(1, 20, arrival=1.0))
    batch = s.schedule()
    assert _ids(batch) == [1, 0] and batch.num_new == [20, 44]  # the long one gets the rest, chunked


def test_cached_prefix_counts_only_uncached_tokens():
    """A long prompt mostly in the prefix cache feeds few tokens: it goes before a medium prompt
    with nothing cached, though the medium one arrived first and has fewer tokens in all."""
    cached = list(range(5000, 5096))  # 96 tokens, 24 full blocks
    for prefix_caching, first in [(True, 1), (False, 0)]:
        s = _sched(prefix_caching=prefix_caching, max_num_seqs=1)
        s.blocks.grow(99, len(cached))  # an earlier request computed `cached` and finished
        s.blocks.cache_prefix(99, cached, len(cached))
        s.blocks.free(99)
        medium = _seq(0, 30, arrival=0.0)
        long = Sequence(1, cached + [1, 2, 3, 4, 5, 6, 7, 8], PARAMS, arrival=medium.arrival + 1e-3)  # 104 tokens, 8 uncached
        s.add(medium)
        s.add(long)
        batch = s.schedule()
        assert _ids(batch) == [first], prefix_caching
        if prefix_caching:
            assert long.cached_tokens == 96 and batch.num_new == [8]


# --- grouping --------------------------------------------------------------------------------

def _burst(s: Scheduler, sizes=(32, 8, 24, 16)) -> dict[int, int]:
    for i, n in enumerate(sizes):
        s.add(_seq(i, n, arrival=float(i)))
    return dict(enumerate(sizes))


def test_a_burst_is_split_shortest_first_when_tokens_cost_more_than_steps():
    s = _sched(step_cost=lambda n: 0.001 + 0.001 * n)
    sizes = _burst(s)
    first = s.schedule()
    admitted = _ids(first)
    assert 0 < len(admitted) < len(sizes)
    by_size = sorted(sizes, key=sizes.get)
    assert admitted == by_size[: len(admitted)]  # the shortest, in order
    # No starvation: every prompt is admitted within a few steps, shortest first throughout.
    order, steps = list(admitted), 1
    _advance(first)
    while len(order) < len(sizes):
        assert steps < len(sizes), f"only {order} admitted after {steps} steps"
        batch = s.schedule()
        steps += 1
        order += [sid for sid in _ids(batch) if sid not in order]
        _advance(batch)
    assert order == by_size and not s.waiting
    assert steps > 1


def test_a_burst_goes_in_one_step_when_steps_cost_more_than_tokens():
    s = _sched(step_cost=lambda n: 10.0 + 1e-6 * n)
    sizes = _burst(s)
    batch = s.schedule()
    assert _ids(batch) == sorted(sizes, key=sizes.get) and not s.waiting


@pytest.mark.parametrize("kw", [{}, {"group_prefills": False, "step_cost": lambda n: 0.001 + 0.001 * n}])
def test_no_grouping_without_a_step_cost_or_when_off(kw):
    s = _sched(**kw)
    sizes = _burst(s)
    batch = s.schedule()
    assert sorted(_ids(batch)) == sorted(sizes) and not s.waiting
    assert sum(batch.num_new) == sum(sizes.values())


def test_grouping_never_exceeds_the_token_budget():
    s = _sched(step_cost=lambda n: 10.0 + 1e-6 * n, max_num_batched_tokens=40)
    sizes = _burst(s)
    batch = s.schedule()
    assert sum(batch.num_new) <= 40 and _ids(batch)[:2] == [1, 3]  # 8 + 16, then a chunk of 24


def test_running_decodes_count_as_the_base_of_every_step():
    """The decodes of running sequences are in every step, so each extra step costs them too:
    a burst split on an idle engine goes in together beside 50 decodes. With cost
    0.001 + 0.001 n and three 8-token prompts: idle, one at a time (3*9 + 2*9 + 9 = 54 ms) beats
    together (3*25 = 75 ms); beside 50 decodes, together (3*75 = 225 ms) beats any split
    (e.g. 3*67 + 59 = 260 ms)."""
    cost = lambda n: 0.001 + 0.001 * n
    s = _sched(step_cost=cost)
    _burst(s, (8, 8, 8))
    assert _ids(s.schedule()) == [0]
    s = _sched()  # no step cost yet: all 50 short prompts go in one step
    for i in range(50):
        s.add(_seq(100 + i, 4, arrival=-1.0))
    _advance(s.schedule())
    s.step_cost = cost
    assert len(s.running) == 50 and all(seq.num_tokens - seq.num_computed == 1 for seq in s.running)
    _burst(s, (8, 8, 8))
    batch = s.schedule()
    assert batch.num_new[:50] == [1] * 50 and _ids(batch)[50:] == [0, 1, 2]


def test_a_shared_prefix_counts_once_only_where_it_can_be_shared():
    """Two prompts share 64 tokens (16 blocks) and add 4 each. With the prefix cache the second
    feeds only its 4 (in-batch sharing now, or a cache hit later), so one step for both is
    best: 2 * (10 + 72) = 164 ms against 2 * (10 + 68) + (10 + 4) = 170 ms. Without the cache
    it feeds all 68 either way and a step each is best: 2 * 78 + 78 = 234 ms against
    2 * (10 + 136) = 292 ms."""
    common = list(range(7000, 7064))
    for prefix_caching, together in [(True, True), (False, False)]:
        s = _sched(step_cost=lambda n: 0.01 + 0.001 * n, prefix_caching=prefix_caching)
        s.add(Sequence(0, common + [1, 2, 3, 4], PARAMS, arrival=0.0))
        s.add(Sequence(1, common + [5, 6, 7, 8], PARAMS, arrival=1.0))
        batch = s.schedule()
        assert _ids(batch) == ([0, 1] if together else [0]), prefix_caching
        if together:
            assert batch.num_new == [68, 4] and s.shared_prefill_tokens == 64


# --- _first_group ----------------------------------------------------------------------------

def _brute_force(sizes, cost, base):
    """Least summed time to first token over every split of sizes into consecutive steps; returns
    (best total, sizes of the first group among the best splits)."""
    m, best = len(sizes), (float("inf"), None)
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, m), r) for r in range(m)):
        bounds = [0, *cuts, m]
        total = sum((m - a) * cost(base + sum(sizes[a:b])) for a, b in zip(bounds, bounds[1:]))
        if total < best[0] - 1e-12:
            best = (total, bounds[1])
    return best


def test_first_group_on_hand_computed_cases():
    def first(sizes, cost, base=0, budget=1024):
        s = _sched(step_cost=cost, max_num_batched_tokens=base + budget)
        return s._first_group(sizes, base, budget)

    # [10, 10], cost 1 + n: together 2 * 21 = 42; apart 2 * 11 + 11 = 33 -> one now.
    assert first([10, 10], lambda n: 1 + n) == 1
    # cost 100 + n: together 2 * 120 = 240; apart 2 * 110 + 110 = 330 -> both now.
    assert first([10, 10], lambda n: 100 + n) == 2
    # [1, 1, 100], cost 5 + n: {1,1}{100}: 3*7 + 105 = 126 beats {1}{1}{100}: 3*6 + 2*6 + 105 = 135,
    # {1}{1,100}: 18 + 2*107 = 232 and all together: 3*107 = 321 -> two now.
    assert first([1, 1, 100], lambda n: 5 + n) == 2
    # base tokens (decodes) are in every step: [10, 10], base 5, cost 1 + n: together 2 * 26 = 52,
    # apart 2 * 16 + 16 = 48 -> one now.
    assert first([10, 10], lambda n: 1 + n, base=5) == 1
    # A first prompt larger than the budget is still admitted (chunked): never 0.
    assert first([500, 10], lambda n: 1 + n, budget=100) >= 1
    assert first([10, 10], lambda n: 0.0) >= 1
    assert first([3], lambda n: 1 + n) == 1


def test_first_group_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 60) for _ in range(rng.randint(1, 6))]
        overhead, per_token, base = rng.choice([0.0, 1.0, 20.0, 500.0]), rng.choice([0.1, 1.0]), rng.choice([0, 7])
        cost = lambda n, o=overhead, k=per_token: o + k * n
        s = _sched(step_cost=cost, max_num_batched_tokens=100_000)
        got = s._first_group(sizes, base, 100_000 - base)
        total, want = _brute_force(sizes, cost, base)
        # Ties may pick either split: the chosen first group must start an optimal split.
        rest = _brute_force(sizes[got:], cost, base)[0] if got < len(sizes) else 0.0
        assert len(sizes) * cost(base + sum(sizes[:got])) + rest == pytest.approx(total), (sizes, overhead, per_token, base, got, want)


def test_invalid_prefill_order_is_rejected():
    with pytest.raises(ValueError, match="prefill_order"):
        SchedulerConfig(prefill_order="bogus")
    assert SchedulerConfig().prefill_order == "arrival" and not SchedulerConfig().group_prefills


def test_a_family_sharing_a_long_prefix_counts_its_tails():
    """Agents of one kind (one system prompt and tool list, a short question each) go before an
    unrelated medium prompt: each costs only its tail once one of them has fed the prefix."""
    common = list(range(7000, 7064))  # 64 shared tokens, 16 blocks
    s = _sched(prefix_caching=True)
    s.add(_seq(0, 40, arrival=0.0))  # medium, unrelated, first to arrive
    s.add(Sequence(1, common + [1, 2, 3, 4], PARAMS, arrival=time.monotonic() + 1e-3))
    s.add(Sequence(2, common + [5, 6, 7, 8], PARAMS, arrival=time.monotonic() + 2e-3))
    assert _ids(s.schedule()) == [1, 2, 0]
    s = _sched(prefix_caching=False)  # without a prefix cache nothing is shared: sizes decide
    s.add(_seq(0, 40, arrival=0.0))
    s.add(Sequence(1, common + [1, 2, 3, 4], PARAMS, arrival=time.monotonic() + 1e-3))
    s.add(Sequence(2, common + [5, 6, 7, 8], PARAMS, arrival=time.monotonic() + 2e-3))
    assert _ids(s.schedule()) == [0, 1, 2]
