"""A branch without a default must take every value its `on` can have (an enum, a boolean):
compile() names the node, the values no case takes and the fix; a default is the explicit opt-out."""
from __future__ import annotations

import pytest

from agentrt.dag import JsonSchema, Program
from agentrt.errors import ProgramValidationError

LEVELS = {"type": "object", "properties": {"urgency": {"type": "string", "enum": ["low", "medium", "high"]},
                                           "spam": {"type": "boolean"}}, "required": ["urgency", "spam"]}


def triage(cases, **kw) -> Program:
    p = Program("desk", inputs={"ticket": str})
    tri = p.llm("tri", prompt="Triage: {ticket}", output=JsonSchema(LEVELS))
    p.output(p.branch("route", on=tri["urgency"], cases=cases, **kw))
    return p


def problems(p: Program) -> list[tuple[str, str]]:
    with pytest.raises(ProgramValidationError) as e:
        p.compile()
    return e.value.problems


def test_an_enum_value_no_case_takes_is_a_compile_error_naming_node_values_and_fix():
    [(node, message)] = problems(triage({"high": "page the on-call", "low": "reply tomorrow"}))
    assert node == "route"
    assert message.startswith('no case takes tri.urgency = "medium" (the cases take "low", "high" of '
                              '["low", "medium", "high"]) and there is no default')
    assert 'add a case for it, or give default=' in message
    [(_, both)] = problems(triage({"high": "page the on-call"}))
    assert 'tri.urgency = "low" or "medium"' in both and "add a case for each" in both


def test_a_default_is_the_explicit_opt_out():
    triage({"high": "page the on-call", "low": "reply tomorrow"}, default="queue it").compile()
    triage({"high": "page", "low": "later", "medium": "soon"}).compile()


def test_a_boolean_counts_as_its_two_values():
    p = Program("desk", inputs={"ticket": str})
    tri = p.llm("tri", prompt="Triage: {ticket}", output=JsonSchema(LEVELS))
    p.output(p.branch("drop", on=tri["spam"], cases={True: "dropped"}))
    [(node, message)] = problems(p)
    assert node == "drop" and message.startswith("no case takes tri.spam = false")


def test_predicates_and_open_values_are_not_judged():
    triage([(lambda u: u != "low", "page"), ("low", "later")]).compile()  # only running it could tell
    p = Program("desk", inputs={"ticket": str})
    kind = p.llm("kind", prompt="{ticket}", output=JsonSchema({"type": "string"}))
    p.output(p.branch("route", on=kind, cases={"a": "x"}))  # any string: a default would be wise, not required
    p.compile()


def test_a_misspelt_key_is_reported_once_with_the_value_it_likely_meant():
    [(node, message)] = problems(triage({"high": "page", "low": "later", "meduim": "soon"}))
    assert node == "route" and message.startswith("case meduim can never match")
    assert 'did you mean "medium", which no case takes?' in message
