"""The adaptive k controller inside the engine: a request whose drafts are accepted, drafts deep when
it runs alone, and drafts nothing once it shares the step with a full batch.

The engine gets a synthetic step-cost model with its ridge at 4 new tokens, so the outcome does not
depend on this machine's speed: 20 ms of weight reads per step, 5 ms of compute per new token, no
overhead, and the engine prices steps by it alone (learn_step_costs=False). Alone, the first 3
drafts ride free under the memory time. With 6 sequences in the step the forward is already
compute-bound, producing 6 tokens at 5 ms each, so a draft that costs 5 ms would need to be accepted with probability > 1 to raise tokens per second: k must be 0."""
from __future__ import annotations

import pytest

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.spec.cost_model import StepCostModel

RIDGE_AT_4 = StepCostModel(overhead_s=0.0, bytes_fixed=0.020, bytes_per_kv_token=0.0, flops_per_token=0.005,
                           read_bw=1.0, flop_rate=1.0)
REPETITIVE = "red green blue, " * 10 + "red"
OTHERS = ["The capital of France is", "def fibonacci(n):", "My favourite colour is", "Once upon a time",
          "Dear team, thank you"]
MAX_TOKENS = 16


def _engine(make_engine, loaded):
    engine = make_engine(loaded, spec=SpecConfig(drafter="suffix", k=None, learn_step_costs=False),
                         max_num_seqs=len(OTHERS) + 1)
    engine.spec.cost_model = RIDGE_AT_4
    return engine


def _decode_steps(engine, rid: int):
    """(k of request rid, batch size) for every decode step that ran it."""
    return [(rec.k[rec.request_ids.index(rid)], rec.batch_size) for rec in engine.step_log
            if rid in rec.request_ids and rec.num_prefill_tokens == 0]


def _run(engine, rid: int) -> dict:
    results = {}
    while engine.has_work():
        results.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    return results[rid].spec.total.to_dict()


def test_high_alpha_request_drafts_alone_and_not_in_a_full_batch(smollm2_fp32, make_engine):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    alone = _engine(make_engine, smollm2_fp32)
    rid = alone.add_request(REPETITIVE, params)
    stats = _run(alone, rid)
    steps = _decode_steps(alone, rid)
    assert stats["drafted"] > 0 and stats["accepted"] >= 0.6 * stats["drafted"], stats  # the premise: high α
    assert all(b == 1 for _, b in steps)
    ks = [k for k, _ in steps]
    assert max(ks) >= 3 and sum(k > 0 for k in ks) >= 0.5 * len(ks), ks
    assert all(rec.predicted_s is not None for rec in alone.step_log)  # the controller sized every step

    crowded = _engine(make_engine, smollm2_fp32)
    rid = crowded.add_request(REPETITIVE, params)
    for prompt in OTHERS:
        crowded.add_request(prompt, params)
    _run(crowded, rid)
    steps = [(k, b) for k, b in _decode_steps(crowded, rid) if b == 1 + len(OTHERS)]
    assert len(steps) >= MAX_TOKENS // 2, steps  # it really shared most of its steps with the full batch
    assert all(k == 0 for k, _ in steps), steps
    full = [rec for rec in crowded.step_log if rec.batch_size == 1 + len(OTHERS) and rec.num_prefill_tokens == 0]
    assert all(sum(rec.k) == 0 for rec in full)  # nobody else drafts either


def test_verifications_teach_the_acceptance_calibration(smollm2_fp32, make_engine):
    # every free draft position up to the first rejection is one observation (spec.acceptance)
    engine = _engine(make_engine, smollm2_fp32)
    rid = engine.add_request(REPETITIVE, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    _run(engine, rid)
    tested = sum(min(a + 1, k) for rec in engine.step_log for k, a in zip(rec.k, rec.accepted) if k)
    assert tested > 0
    assert engine.spec.calibration.evidence == pytest.approx(tested, rel=0.01)
    assert engine.spec.calibration(0.75) > 0.75  # the repetition's drafts held more often than scored
