"""Speculative decoding in the engine: greedy identity for every drafter (fp32 and quantized), exact stops
inside accepted runs, α accounting, and the sampled distribution at temperature 1."""
from __future__ import annotations

import collections

import pytest
from scipy.stats import chi2_contingency

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.errors import SpecConfigError

REPEATY = "one two three four five six seven. one two three four five six seven. one two three"
CHATS = [
    [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red green blue."}],
    [{"role": "user", "content": 'Write JSON with keys "city" and "days" for Paris, 3.'}],
    [{"role": "user", "content": "Count from 1 to 12."}],
    [{"role": "user", "content": "What is a hash table?"}],
]


def _drafters(model_dir) -> list[SpecConfig]:
    return [
        SpecConfig(drafter="suffix", k=4),
        SpecConfig(drafter="suffix"),  # adaptive k
        SpecConfig(drafter="layerskip:1", k=3),
        SpecConfig(drafter=f"draft:{model_dir}", k=5),
    ]


def _batched(engine, prompts, params) -> list:
    """The results of these requests run together in one batch, in request order."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    got = {}
    while len(got) < len(rids):
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    return [got[r] for r in rids]


def _first_two_tokens(engine, prompt: list[int], n: int, batch: int, seed0: int, **params) -> list[tuple[int, ...]]:
    """n samples of the first two tokens at temperature 1, `batch` requests at a time, seeded."""
    pairs = []
    for b in range(n // batch):
        sps = [SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True, seed=seed0 + b * batch + i, **params)
               for i in range(batch)]
        pairs += [tuple(r.token_ids) for r in _batched(engine, [list(prompt)] * batch, sps)]
    return pairs


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_tiny(batch, tiny_loaded, make_engine):
    loaded = tiny_loaded("smollm")
    prompts = [REPEATY, "the the the the", "a b c d e f g", "hello world"][:batch]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (40, 23, 31, 17)][:batch]
    base = make_engine(loaded)
    want = [base.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    for spec in _drafters(loaded.source.path):
        engine = make_engine(loaded, spec=spec)
        assert [r.token_ids for r in _batched(engine, prompts, params)] == want, spec.drafter
        assert engine.blocks.num_free == engine.blocks.allocator.num_blocks


@pytest.mark.parametrize("weights", ["fp32", "quantized"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_smollm2(batch, weights, request, smollm2_source, make_engine):
    """fp32, and the GGUF's Q4_1 blocks on the fused quantized decoder, which is batch-invariant
    as it stands (no `batch_invariant` flag). The draft model is the fp32 SmolLM2."""
    loaded = request.getfixturevalue("smollm2_fp32" if weights == "fp32" else "smollm2_quant")
    if weights == "quantized":
        assert make_engine(loaded).model.quant_fused
    params = SamplingParams(max_tokens=28, temperature=0)
    want = [r.token_ids for r in make_engine(loaded).generate(CHATS[:batch], params)]
    for spec in [SpecConfig(drafter="suffix", k=6), SpecConfig(drafter="layerskip:12", k=2),
                 SpecConfig(drafter=f"draft:{smollm2_source.path}", k=4)]:
        engine = make_engine(loaded, spec=spec)
        got = engine.generate(CHATS[:batch], params)
        assert [r.token_ids for r in got] == want, spec.drafter
        total = collections.Counter()
        for r in got:
            total.update({k: v for k, v in r.spec.total.to_dict().items() if isinstance(v, int)})
        assert total["drafted"] > 0 and total["emitted"] == sum(len(w) for w in want)
        if spec.drafter.startswith("draft:"):
            # The target drafting for itself agrees everywhere but past the end of the output
            # (drafts after the stop token are counted as drafted, cut as not accepted).
            assert total["accepted"] >= 0.7 * total["drafted"]


def test_stops_inside_an_accepted_run_cut_exactly(tiny_loaded, make_engine):
    loaded = tiny_loaded("llama3")
    plain = make_engine(loaded)
    spec = make_engine(loaded, spec=SpecConfig(drafter=f"draft:{loaded.source.path}", k=8))
    base = plain.generate([REPEATY], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    cases = [
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),  # max_tokens mid-run
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(base.token_ids[6],)),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[base.text[5:8]]),
    ]
    for p in cases:
        a = plain.generate([REPEATY], p)[0]
        b = spec.generate([REPEATY], p)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert b.spec.total.accepted > 0


def test_unknown_drafter_is_a_clear_error(tiny_loaded, make_engine):
    with pytest.raises(SpecConfigError, match="unknown drafter"):
        make_engine(tiny_loaded("smollm"), spec=SpecConfig(drafter="medusa"))
    with pytest.raises(SpecConfigError, match="layerskip"):
        make_engine(tiny_loaded("smollm"), spec=SpecConfig(drafter="layerskip:x"))


@pytest.mark.parametrize("weights", ["fp32", "quantized"])
def test_first_two_tokens_distribution_matches_plain_sampling(weights, request, make_engine):
    """Two-sample chi-square on the joint (t1, t2) at temperature 1: the 12 most frequent pairs
    plus "other". N = 1200 samples per arm; the test fails when p < 1e-3 (a false alarm once in
    a thousand runs; the seeds are fixed, so the outcome is deterministic). For the fp32 model
    and for the GGUF's quantized blocks (the target is then the quantized model)."""
    loaded = request.getfixturevalue("smollm2_fp32" if weights == "fp32" else "smollm2_quant")
    n, batch = 1200, 100
    prompt = loaded.tokenizer.encode("My favourite food is")

    plain = _first_two_tokens(make_engine(loaded, max_num_seqs=batch, kv_cache_tokens=8192), prompt, n, batch, 0)
    spec_engine = make_engine(loaded, max_num_seqs=batch, kv_cache_tokens=8192, spec=SpecConfig(drafter="layerskip:20", k=1))
    spec = _first_two_tokens(spec_engine, prompt, n, batch, 10**6)
    top = [p for p, _ in collections.Counter(plain + spec).most_common(12)]
    table = [[sum(1 for x in arm if x == t) for t in top] + [sum(1 for x in arm if x not in top)] for arm in (plain, spec)]
    _, pvalue, _, _ = chi2_contingency(table)
    assert pvalue > 1e-3, table


PENALIZED = dict(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.3, min_tokens=6,
                 logit_bias={5: 2.0, 9: -3.0})


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_with_penalties_every_drafter(batch, tiny_loaded, make_engine):
    """Penalties change what is generated; speculation must not: each verified row is penalized
    with its own prefix's counts (agentrt.decoding.penalties)."""
    loaded = tiny_loaded("smollm")
    prompts = [REPEATY, "the the the the", "a b c d e f g"][:batch]
    params = [SamplingParams(max_tokens=m, temperature=0, **PENALIZED) for m in (40, 23, 31)][:batch]
    base = make_engine(loaded)
    want = [base.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    plain = [base.generate([p], SamplingParams(max_tokens=sp.max_tokens, temperature=0))[0].token_ids
             for p, sp in zip(prompts, params)]
    assert want != plain  # the penalties do something here
    accepted = {}
    for spec in _drafters(loaded.source.path):
        got = _batched(make_engine(loaded, spec=spec), prompts, params)
        assert [r.token_ids for r in got] == want, spec.drafter
        accepted[spec.drafter] = sum(r.spec.total.accepted for r in got)
    # rows after accepted drafts were penalized with those drafts counted
    assert sum(accepted.values()) > 0, accepted


def test_sampled_distribution_with_penalties_matches_plain_sampling(tiny_loaded, make_engine):
    """Two-sample chi-square on the joint (t1, t2) at temperature 1 with a strong presence and
    repetition penalty (t2's distribution depends on t1 through them), layer-skip drafts of k=1
    (a stochastic q): the 12 most frequent pairs plus "other", N = 1500 per arm, fails when
    p < 1e-3 (seeds fixed: deterministic)."""
    loaded = tiny_loaded("smollm")
    n, batch = 1500, 150
    prompt = loaded.tokenizer.encode("the cat sat")
    pen = dict(presence_penalty=2.0, repetition_penalty=1.5, frequency_penalty=0.5)

    plain = _first_two_tokens(make_engine(loaded, max_num_seqs=batch), prompt, n, batch, 0, **pen)
    spec = _first_two_tokens(make_engine(loaded, max_num_seqs=batch, spec=SpecConfig(drafter="layerskip:1", k=1)),
                             prompt, n, batch, 10**6, **pen)
    repeats = sum(1 for a, b in plain if a == b) / n
    assert repeats < 0.05  # the penalties act: a repeated token is rare
    top = [p for p, _ in collections.Counter(plain + spec).most_common(12)]
    table = [[sum(1 for x in arm if x == t) for t in top] + [sum(1 for x in arm if x not in top)] for arm in (plain, spec)]
    _, pvalue, _, _ = chi2_contingency(table)
    assert pvalue > 1e-3, table


def test_logprobs_are_the_model_rows_with_and_without_speculation(tiny_loaded, make_engine):
    """Per generated token its log-probability and top alternatives from the model's own row at
    that position: greedy picks the top one, and drafting changes nothing (fp32, tolerance for
    the batch shape)."""
    import math

    loaded = tiny_loaded("smollm")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    [plain] = make_engine(loaded).generate([REPEATY], params)
    assert plain.logprobs is not None and [lp.token_id for lp in plain.logprobs] == plain.token_ids
    for lp in plain.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)
    for spec in _drafters(loaded.source.path)[:1] + _drafters(loaded.source.path)[3:]:
        [got] = make_engine(loaded, spec=spec).generate([REPEATY], params)
        assert got.token_ids == plain.token_ids and got.spec.total.accepted > 0, spec.drafter
        for a, b in zip(got.logprobs, plain.logprobs):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
    [none] = make_engine(loaded).generate([REPEATY], SamplingParams(max_tokens=4, temperature=0))
    assert none.logprobs is None
