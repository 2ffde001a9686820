"""Prefix cache and priorities in the engine: reuse across a program's calls and between
siblings, pins through tool stalls, no leaks with preemption and speculation, priority order."""
from __future__ import annotations

import pytest

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.kernels.cpu_build import cpu_kernels

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = "You are a planning agent. " * 6


def _run(engine, prompts, params=GREEDY):
    rids = [engine.add_request(p, params) for p in prompts]
    got = {}
    while len(got) < len(rids):
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    return [got[r] for r in rids]


def test_second_call_of_a_program_reuses_its_prefix(tiny_loaded, make_engine):
    loaded = tiny_loaded("smollm")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "plan a trip"}]
    engine = make_engine(loaded, block_size=8)
    [r1] = _run(engine, [first])
    assert r1.cached_tokens == 0
    second = first + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "now book it"}]
    [r2] = _run(engine, [second])
    assert r2.cached_tokens >= (r1.prompt_tokens // 8) * 8  # at least the whole first prompt's full blocks
    assert engine.blocks.prefix.stats.hit_tokens == r2.cached_tokens
    # Same tokens as without the cache.
    [ref] = _run(make_engine(loaded, block_size=8, prefix_caching=False), [second])
    assert r2.token_ids == ref.token_ids


def test_siblings_share_their_prefix(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), block_size=8)
    base = [{"role": "system", "content": SYSTEM}]
    a = engine.add_request(base + [{"role": "user", "content": "branch one"}], GREEDY)
    engine.step()  # a's prompt is computed and offered to the cache
    b = engine.add_request(base + [{"role": "user", "content": "branch two"}], GREEDY)
    got = {}
    while len(got) < 2:
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    assert got[a].cached_tokens == 0 and got[b].cached_tokens >= 64


def test_pinned_blocks_survive_a_stall_and_go_under_pressure(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), block_size=8, kv_cache_tokens=8 * 40)
    prog = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "call a tool"}]
    [r] = _run(engine, [prog])
    tokens = r.prompt_token_ids + r.token_ids
    assert engine.pin_prefix(tokens, ttl_s=3600) >= 5
    # Other traffic that fits beside the pinned blocks leaves them alone...
    for i in range(3):
        _run(engine, [[{"role": "user", "content": f"other {i} " * 10}]])
    assert engine.blocks.prefix.stats.released_pins == 0
    [again] = _run(engine, [prog + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "tool said ok"}]])
    assert again.cached_tokens >= (r.prompt_tokens // 8) * 8 and engine.blocks.prefix.stats.pin_hits >= 1
    # ...while traffic that needs every block gets them: pins are released, nothing fails.
    assert engine.pin_prefix(tokens, ttl_s=3600) > 0
    big = _run(engine, [[{"role": "user", "content": "x " * 100}]], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    assert big[0].finish_reason == "length"
    assert engine.blocks.prefix.stats.released_pins > 0


def test_no_block_leaks_with_preemption_and_speculation(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("llama3"), block_size=8, kv_cache_tokens=8 * 24, max_num_batched_tokens=32,
                         spec=SpecConfig(drafter="suffix", k=4))
    prompts = [("one two three four " * (3 + i)).strip() for i in range(5)]
    results = _run(engine, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert sum(r.num_preemptions for r in results) > 0
    assert sum(r.spec.total.drafted for r in results) > 0
    assert engine.scheduler.shared_prefill_tokens > 0  # the prompts extend each other: shared in-step too
    engine.blocks.check_invariants()
    assert not engine.blocks.tables and engine.blocks.num_free == engine.blocks.allocator.num_blocks
    # Identical to a run without the cache, preemption or speculation.
    plain = _run(make_engine(tiny_loaded("llama3"), prefix_caching=False), prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


def test_priority_orders_admission(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), max_num_seqs=1)
    late_but_urgent = None
    first = engine.add_request("program A step", GREEDY, priority=5.0)
    late_but_urgent = engine.add_request("program B step", GREEDY, priority=1.0)
    order = []
    while len(order) < 2:
        order += [ev.request_id for ev in engine.step() if ev.finished]
    assert order == [late_but_urgent, first]


def test_prompts_arriving_together_share_their_prefix(tiny_loaded, make_engine):
    """Agents of one kind arrive together with one long system prompt: all are admitted in one
    step, the first computes the shared blocks and the others take them from it (in-batch prefix
    sharing), with the same tokens as computing everything."""
    loaded = tiny_loaded("smollm")
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}] for i in range(3)]
    engine = make_engine(loaded, block_size=8)
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    assert sorted(s.seq_id for s in engine.scheduler.running) == rids  # nobody waits
    got = {}
    while len(got) < 3:
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    ids = [got[r].prompt_token_ids for r in rids]
    common = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1)
    shared = common // 8 * 8
    assert shared >= 32
    assert got[rids[0]].cached_tokens == 0
    assert all(got[r].cached_tokens == shared for r in rids[1:])
    assert engine.scheduler.shared_prefill_tokens == 2 * shared
    engine.blocks.check_invariants()
    assert not engine.blocks.tables
    plain = _run(make_engine(loaded, block_size=8, share_prefill_min_tokens=0), prompts)
    assert [got[r].token_ids for r in rids] == [r.token_ids for r in plain]
    assert all(r.cached_tokens == 0 for r in plain)  # side by side in one step: nothing to reuse


def test_sharing_with_a_chunked_prefill(tiny_loaded, make_engine):
    """The leader's prompt is prefilled in chunks; the follower, admitted with the leader's last
    chunk, takes the shared blocks, from the prefix cache (earlier chunks) or from this step."""
    loaded = tiny_loaded("smollm")
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}] for i in range(2)]
    engine = make_engine(loaded, block_size=8, max_num_batched_tokens=32)
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    assert [s.seq_id for s in engine.scheduler.running] == rids[:1]  # the budget went to the first chunk
    got = {}
    while len(got) < 2:
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    ids = [got[r].prompt_token_ids for r in rids]
    common = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1) // 8 * 8
    assert got[rids[1]].cached_tokens == common
    assert engine.scheduler.shared_prefill_tokens + engine.blocks.prefix.stats.hit_tokens == common
    engine.blocks.check_invariants()
    plain = _run(make_engine(loaded, block_size=8, prefix_caching=False), prompts)
    assert [got[r].token_ids for r in rids] == [r.token_ids for r in plain]


@pytest.mark.skipif(cpu_kernels() is None, reason="the bf16 kernel path needs the CPU kernels")
def test_in_batch_sharing_on_the_kernel_path_gives_the_same_tokens(tiny_loaded, make_engine):
    loaded = tiny_loaded("smollm", "bfloat16")
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}] for i in range(3)]
    shared = _run(make_engine(loaded, block_size=16), prompts)
    plain = _run(make_engine(loaded, block_size=16, prefix_caching=False), prompts)
    assert sum(r.cached_tokens for r in shared) > 0
    assert [r.token_ids for r in shared] == [r.token_ids for r in plain]


def test_unrelated_prompts_are_not_held_back(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), block_size=8)
    rids = [engine.add_request(f"{w} " * 30, GREEDY) for w in ("alpha", "beta", "gamma")]
    engine.step()
    assert sorted(s.seq_id for s in engine.scheduler.running) == rids
    assert engine.scheduler.shared_prefill_tokens == 0
