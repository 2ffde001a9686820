"""Token-tree drafts through the engine (engine/step/step_tree.py) on the embedded SmolLM2 GGUF:
greedy output is the same without speculation, with chains and with trees, and trees are
proposed where an enum or several quoted values fit."""
from __future__ import annotations

import pytest

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.step import step_rows

CONVERT = {"type": "function", "function": {"name": "convert_temperature", "description": "Convert a temperature",
           "parameters": {"type": "object", "properties": {  # the enum mid-call: inside a draft
               "value": {"type": "integer", "minimum": -500, "maximum": 5000},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin", "rankine"]},
               "label": {"type": "string", "maxLength": 30}},
               "required": ["value", "unit", "label"]}}}
CHATS = [  # the unit unquoted: the enum slot's tree holds the schema's members, the label's the quoted spans
    [{"role": "user", "content": "Convert 300 to celsius and label it 'Lab B reading' (or 'Lab A reading')."}],
    [{"role": "user", "content": "Convert 451 degrees to fahrenheit, label 'Paper burns' or 'Book fire'."}],
]


def _run(engine, chats, params):
    rids = [engine.add_request(c, params) for c in chats]
    got = {}
    while len(got) < len(rids):
        got.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    return [got[r] for r in rids]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_outputs_identical_with_trees_chains_and_no_speculation(smollm2_quant, make_engine, monkeypatch,
                                                                temperature):
    trees = []
    real = step_rows.tree_keys
    monkeypatch.setattr(step_rows, "tree_keys", lambda rows, blocks: trees.append(1) or real(rows, blocks))
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=7,
                            response_format={"type": "tool_call", "tools": [CONVERT]})
    plain = _run(make_engine(smollm2_quant), CHATS, params)
    chain = _run(make_engine(smollm2_quant, spec=SpecConfig(drafter="template", tree_width=1)), CHATS, params)
    assert not trees
    tree = _run(make_engine(smollm2_quant, spec=SpecConfig(drafter="template", tree_width=4)), CHATS, params)
    assert trees, "no tree was proposed"
    assert [r.token_ids for r in plain] == [r.token_ids for r in chain] == [r.token_ids for r in tree]
    assert all(r.error is None and r.parsed["name"] == "convert_temperature" for r in tree)
    if temperature == 0:
        passes = lambda rs: sum(r.spec.total.target_passes for r in rs)  # noqa: E731
        assert passes(tree) <= passes(chain)


def test_trees_fall_back_to_chains_where_the_forward_cannot_read_them(smollm2_quant, make_engine, monkeypatch):
    monkeypatch.setattr(type(smollm2_quant.model), "tree_attention", lambda self, kv: False)
    monkeypatch.setattr(step_rows, "tree_keys", lambda rows, blocks: pytest.fail("a tree reached the forward"))
    params = SamplingParams(max_tokens=40, temperature=0, response_format={"type": "tool_call", "tools": [CONVERT]})
    plain = _run(make_engine(smollm2_quant), CHATS[:1], params)
    tree = _run(make_engine(smollm2_quant, spec=SpecConfig(drafter="template", tree_width=4)), CHATS[:1], params)
    assert [r.token_ids for r in plain] == [r.token_ids for r in tree]


def test_suffix_trees_change_no_output(smollm2_quant, make_engine, monkeypatch):
    """Unconstrained requests whose context went on differently after the same words: the suffix
    drafter's trees of continuations, greedy and seeded, emit what decoding without drafts does."""
    trees = []
    real = step_rows.tree_keys
    monkeypatch.setattr(step_rows, "tree_keys", lambda rows, blocks: trees.append(1) or real(rows, blocks))
    chats = [[{"role": "user", "content": "Continue the list: red apple, red car, green apple, red apple, green car, "
                                          "red apple, green apple, red"}],
             [{"role": "user", "content": "Repeat: one two three, one two four, one two three, one two four, one two"}]]
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=3)
        plain = _run(make_engine(smollm2_quant), chats, params)
        tree = _run(make_engine(smollm2_quant, spec=SpecConfig(drafter="suffix", tree_width=3)), chats, params)
        assert [r.token_ids for r in plain] == [r.token_ids for r in tree]
    assert trees
