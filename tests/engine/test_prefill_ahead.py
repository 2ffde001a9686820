"""Prefill-ahead requests in the engine: the known start of a call's prompt computed while nothing
else runs, cached and pinned; never in a step with other work, first to give blocks up, and the
later call's tokens unchanged."""
from __future__ import annotations

from agentrt.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MARK = "\x00mark\x00"
SYSTEM = "You are a planning agent for a travel company. " * 6


def _messages(tail: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "The weather tool said: " + tail}]


def _drain(engine) -> dict:
    got = {}
    while engine.has_work():
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    return got


def test_a_prefilled_start_is_reused_and_the_call_is_unchanged(tiny_loaded, make_engine):
    loaded = tiny_loaded("smollm")
    engine = make_engine(loaded, block_size=8)
    seq = engine.prepare_ahead(_messages(MARK), GREEDY, MARK, ttl_s=60.0)
    assert seq.num_tokens % 8 == 0 and seq.num_tokens > 40  # whole blocks, the cut's block left out
    engine.add(seq)
    [result] = _drain(engine).values()
    assert result.finish_reason == "prefilled" and result.token_ids == []
    assert engine.blocks.prefix.num_pinned() == seq.num_tokens // 8
    engine.blocks.check_invariants()

    full = _messages("sunny, 21 C, light wind. Plan the day.")
    [call] = engine.generate([full], GREEDY)
    assert call.cached_tokens == seq.num_tokens  # every block computed ahead is taken
    [alone] = make_engine(loaded, block_size=8).generate([full], GREEDY)
    assert alone.cached_tokens == 0 and call.token_ids == alone.token_ids
    # nothing left to compute: no request
    assert engine.prepare_ahead(_messages(MARK), GREEDY, MARK, ttl_s=60.0) is None


def test_prefill_ahead_runs_only_in_steps_with_nothing_else(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), block_size=8)
    ahead = engine.prepare_ahead(_messages(MARK), GREEDY, MARK, ttl_s=60.0)
    engine.add(ahead)
    rid = engine.add_request([{"role": "user", "content": "Say something short."}], GREEDY)
    ran_together, finished = False, {}
    while engine.has_work():
        before = ahead.num_computed
        events = engine.step()
        record = engine.step_log[-1]
        if ahead.seq_id in record.request_ids:
            ran_together |= len(record.request_ids) > 1
        else:
            assert ahead.num_computed == before
        finished.update({ev.request_id: ev.result for ev in events if ev.finished})
        if rid not in finished:
            assert ahead.num_computed == 0  # not one token while the ready request runs
    assert not ran_together
    assert finished[ahead.seq_id].finish_reason == "prefilled" and finished[rid].finish_reason == "length"


def test_prefill_ahead_gives_its_blocks_up_before_anything_is_preempted(tiny_loaded, make_engine):
    # 32 blocks of 8 tokens: the ahead request (26 blocks) holds 2 after a chunk, then a request
    # that needs 31
    engine = make_engine(tiny_loaded("smollm"), block_size=8, kv_cache_tokens=256, max_num_batched_tokens=16)
    ahead = engine.prepare_ahead(_messages(MARK), GREEDY, MARK, ttl_s=60.0)
    engine.add(ahead)
    engine.step()  # one chunk of 16 tokens: 2 blocks held
    assert ahead.num_computed == 16 and len(engine.blocks.tables[ahead.seq_id]) == 2
    rid = engine.add_request(list(range(3, 3 + 240)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    got = _drain(engine)
    assert got[rid].finish_reason == "length" and got[rid].num_preemptions == 0
    assert got[ahead.seq_id].finish_reason in ("prefilled", "dropped")
    engine.blocks.check_invariants()


def test_an_aborted_prefill_ahead_keeps_what_it_computed(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), block_size=8, max_num_batched_tokens=16)
    ahead = engine.prepare_ahead(_messages(MARK), GREEDY, MARK, ttl_s=60.0)
    engine.add(ahead)
    engine.step()
    engine.step()
    ev = engine.abort(ahead.seq_id)
    assert ev.finish_reason == "abort" and not engine.has_work()
    [call] = engine.generate([_messages("rain all day.")], GREEDY)
    assert call.cached_tokens == 32  # the two chunks' blocks
    engine.blocks.check_invariants()


def test_no_prefix_cache_no_prefill_ahead(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), block_size=8, prefix_caching=False)
    assert engine.prepare_ahead(_messages(MARK), GREEDY, MARK, ttl_s=60.0) is None
