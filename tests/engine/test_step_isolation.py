"""One request's failure inside an engine step stays with that request: its grammar raising while
masks are built, its drafter raising, its own bookkeeping raising after the forward. The other
requests of the step go on and produce exactly what they produce alone; nothing is leaked."""
from __future__ import annotations

import pytest

from agentrt.engine import SamplingParams, SpecConfig

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}
TOOLS = {"type": "tool_call", "tools": [WEATHER]}
ASKS = ["What's the weather in Lisbon?", "Is it sunny in Oslo?"]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, response_format=TOOLS)


def _finish_all(engine, rids):
    results = {}
    while len(results) < len(rids):
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result
    return [results[r] for r in rids]


def _alone(engine_factory, ask):
    engine = engine_factory()
    (r,) = _finish_all(engine, [engine.add_request([{"role": "user", "content": ask}], _params())])
    return r.token_ids


def _boom(*_args, **_kw):
    raise RuntimeError("boom")


@pytest.fixture
def factory(smollm2_fp32, make_engine):
    return lambda **kw: make_engine(smollm2_fp32, spec=SpecConfig(drafter="template"), **kw)


def _check_clean(engine):
    assert engine.unfinished() == []
    engine.blocks.check_invariants()


@pytest.mark.parametrize("where", ["grammar masks", "grammar commit", "drafter"])
def test_a_failing_request_does_not_fail_its_batch(factory, where, monkeypatch):
    expected = _alone(factory, ASKS[1])
    engine = factory()
    bad, good = (engine.add_request([{"role": "user", "content": a}], _params()) for a in ASKS)
    seq = engine.sequence(bad)
    if where == "grammar masks":
        monkeypatch.setattr(seq.grammar, "fill_masks", _boom)
    elif where == "grammar commit":
        monkeypatch.setattr(seq.grammar, "commit", _boom)
    else:
        propose = engine.spec.drafter.propose
        monkeypatch.setattr(engine.spec.drafter, "propose",
                            lambda reqs: _boom() if any(r.seq_id == bad for r in reqs) else propose(reqs))
    r_bad, r_good = _finish_all(engine, [bad, good])
    assert r_good.error is None and r_good.token_ids == expected
    if where == "drafter":  # drafts only save passes: the request decodes on without them
        assert r_bad.error is None and r_bad.token_ids == _alone(factory, ASKS[0])
    else:
        assert r_bad.finish_reason == "error" and "RuntimeError: boom" in r_bad.error
        assert "grammar failed" in r_bad.error or where == "grammar commit"
    _check_clean(engine)


def test_a_drafter_string_with_a_stray_argument_is_refused():
    from agentrt.engine import SpecConfig
    from agentrt.errors import SpecConfigError

    for bad in ("none:foo", "suffix:3", "template:x"):
        with pytest.raises(SpecConfigError, match="unknown drafter"):
            SpecConfig(drafter=bad)
    SpecConfig(drafter="layerskip:8")  # the argument is checked against the model when the engine starts
