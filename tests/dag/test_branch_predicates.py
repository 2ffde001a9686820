"""Branches on predicates as well as values, first match wins, and cases whose result is a
constant: declaration, compile-time checks, runs (ProgramRun and the runtime), export."""
import json
from pathlib import Path

import pytest

from agentrt.dag import Constant, JsonSchema, Program, render_prompt
from agentrt.errors import ProgramRunError, ProgramValidationError

TRIAGE = {"type": "object", "properties": {"urgency": {"type": "integer"}, "topic": {"type": "string"}},
          "required": ["urgency", "topic"]}
PAGE = {"type": "function", "function": {"name": "page_oncall", "description": "page", "parameters": {
    "type": "object", "properties": {"summary": {"type": "string"}, "level": {"type": "integer"}}}}}
EXAMPLES = Path(__file__).parents[2] / "examples"


def urgent(t):
    return t["urgency"] >= 4


def escalated(t):
    return t["escalation"]["level"] > 1


def triage(cases=None, default=None):
    """ticket -> tri (JSON) -> route (branch on the whole tri) -> the output."""
    p = Program("triage", inputs={"ticket": str})
    tri = p.llm("tri", prompt="Triage: {ticket}", output=JsonSchema(TRIAGE))
    cases = cases if cases is not None else [
        (urgent, lambda b: b.llm("page", prompt="Write the on-call page for {ticket}, level {tri.urgency}")),
        (lambda t: t["topic"] == "billing", lambda b: b.llm("bill", prompt="Answer the billing question {ticket}")),
        (lambda t: t["urgency"] < 2, "no action needed"),
    ]
    p.output(p.branch("route", on=tri, cases=cases, default=default))
    return p


def declared_error(fn, *args, **kwargs):
    with pytest.raises(ProgramValidationError) as e:
        fn(*args, **kwargs)
    (node, message), = e.value.problems
    return node, message


def compile_problems(p):
    with pytest.raises(ProgramValidationError) as e:
        p.compile()
    return e.value.problems


# -- declaring and compiling --

def test_predicate_cases_compile_with_labels_from_names_or_positions():
    c = triage(default=lambda b: b.llm("reply", prompt="Reply to {ticket}")).compile()
    labels = [case.label for case in c.spec("route").cases]
    assert labels == ["urgent", "case1", "case2", "default"]
    assert {"route?urgent.page", "route?case1.bill", "route?default.reply"} <= set(c.graph)
    assert not any(n.startswith("route?case2.") for n in c.graph)  # a constant case has no node
    assert set(c.graph.predecessors("route")) == {"tri", "route?urgent.page", "route?case1.bill", "route?default.reply"}


def test_values_and_predicates_mix_in_a_list_and_a_dict_still_works():
    p = Program("score", inputs={"n": int})
    p.output(p.branch("kind", on=p.input("n"), cases=[
        (0, "zero"), (lambda n: n < 0, "negative"), (1, lambda b: b.llm("one", prompt="Say one about {n}"))],
        default="many"))
    c = p.compile()
    assert [(case.label, case.is_equality) for case in c.spec("kind").cases] == [
        ("0", True), ("case1", False), ("1", True), ("default", False)]
    by_dict = triage(cases={urgent: "page"}, default="calm").compile()  # a dict key may be a predicate too
    assert [case.label for case in by_dict.spec("route").cases] == ["urgent", "default"]


def test_declaration_errors_name_the_branch():
    p = triage()
    ticket = p.input("ticket")
    assert declared_error(p.branch, "r1", on=ticket, cases=[("a", "x"), ("a", "y")]) == \
        ("r1", "case a is given twice: the second can never match (the first match wins)")
    node, message = declared_error(p.branch, "r2", on=ticket, cases=[(urgent, "x"), (urgent, "y")])
    assert node == "r2" and "two cases are labelled 'urgent'" in message

    def default(t):
        return True

    assert "clashes with default=" in declared_error(p.branch, "r3", on=ticket, cases=[(default, "x")], default="y")[1]
    assert "non-empty dict" in declared_error(p.branch, "r4", on=ticket, cases=["a", "b"])[1]
    assert "non-empty dict" in declared_error(p.branch, "r5", on=ticket, cases=[])[1]
    node, message = declared_error(p.branch, "r6", on=ticket, cases=[("a", ticket)])
    assert node == "r6" and "give a function returning its Ref" in message
    node, message = declared_error(p.branch, "r7", on=ticket, cases=[("a", {1, 2})])
    assert node == "r7" and "case a: the body must be a function declaring the case's nodes or a JSON value" in message
    node, message = declared_error(p.branch, "r8", on=ticket, cases=[("a", lambda b: "text")])
    assert "give the value itself as the case's body" in message
    assert "or a predicate" in declared_error(p.branch, "r9", on=ticket, cases=[(1.5, "x")])[1]
    assert "on must be a Ref" in declared_error(p.branch, "r10", on="tri", cases=[("a", "x")])[1]


def test_an_equality_key_that_can_never_match_is_reported_beside_predicates():
    p = Program("p", inputs={"ticket": str})
    kind = p.llm("kind", prompt="{ticket}", output=JsonSchema({"type": "string", "enum": ["bug", "billing"]}))
    p.output(p.branch("route", on=kind, cases=[(lambda k: k.startswith("b"), "b-word"), ("refund", "never")],
                      default="other"))
    assert compile_problems(p) == [("route", "case refund can never match: kind is one of ['bug', 'billing']")]


def test_an_equality_key_of_the_wrong_json_type_can_never_match():
    p = triage(cases=[(urgent, "page"), ("billing", "bill")])  # "billing" is compared with the whole object
    assert compile_problems(p) == [("route", "case billing can never match: tri is object, never equal to 'billing'")]
    q = Program("q", inputs={"n": int})
    q.output(q.branch("b", on=q.input("n"), cases={True: "yes", 2: "two", None: "none"}))
    assert [m for _, m in compile_problems(q)] == ["case true can never match: n is integer, never equal to True",
                                                  "case null can never match: n is integer, never equal to None"]


def test_the_branch_output_is_the_union_of_its_cases_shapes():
    p = triage()  # text or a constant string: no member to read
    p.llm("x", prompt="{route.anything}")
    assert compile_problems(p) == [("x", "prompt placeholder {route.anything}: route.anything cannot exist: "
                                         "route is string, not an object: no key 'anything'"),
                                   ("x", "unreachable: its output feeds no program output (reference it, add it to "
                                         "p.output, or remove it)")]

    q = Program("q", inputs={"n": int})
    q.branch("label", on=q.input("n"), cases=[(lambda n: n > 9, "big"), (0, None)],
             default=lambda b: b.llm("say", prompt="Name {n}"))
    q.output(q.llm("use", prompt="{label.text}"))
    assert compile_problems(q) == [("use", "prompt placeholder {label.text}: label.text cannot exist: "
                                           "label is null or string, not an object: no key 'text'")]


def test_a_branch_of_constants_is_an_enum_that_later_checks_use():
    p = Program("p", inputs={"n": int})
    size = p.branch("size", on=p.input("n"), cases=[(lambda n: n > 9, "big")], default="small")
    p.output(p.branch("say", on=size, cases={"big": "B", "small": "S", "huge": "H"}))
    assert compile_problems(p) == [("say", "case huge can never match: size is one of ['big', 'small']")]


def test_constant_objects_have_their_properties_checked():
    p = Program("p", inputs={"n": int}, tools=[PAGE])
    plan = p.branch("plan", on=p.input("n"), cases=[(lambda n: n > 3, {"level": 2, "summary": "loud"})],
                    default=Constant({"level": 1, "summary": "quiet"}))
    p.output(p.tool("page", "page_oncall", args={"summary": plan["summary"], "level": plan["lvl"]}))
    assert compile_problems(p) == [("page", "args.level: plan.lvl cannot exist: plan has no property 'lvl' in its "
                                            "schema (properties: level, summary)")]


# -- running --

def test_the_first_matching_case_wins_in_document_order():
    c = triage(default=lambda b: b.llm("reply", prompt="Reply to {ticket}")).compile()
    run = c.start({"ticket": "Invoice wrong and site down"})
    assert run.complete("tri", {"urgency": 5, "topic": "billing"}) == ["route?urgent.page"]  # urgent and billing
    assert run.graph.nodes["route"]["case"] == "urgent"
    assert not any(n.startswith(("route?case1.", "route?default.")) for n in run.graph)
    run.complete("route?urgent.page", "PAGE: site down")
    assert run.result == "PAGE: site down"
    run = c.start({"ticket": "Invoice wrong"})
    assert run.complete("tri", {"urgency": 3, "topic": "billing"}) == ["route?case1.bill"]
    run = c.start({"ticket": "Hm"})
    assert run.complete("tri", {"urgency": 3, "topic": "other"}) == ["route?default.reply"]


def test_a_constant_case_gives_its_value_without_a_node():
    c = triage().compile()
    run = c.start({"ticket": "Thanks!"})
    assert run.complete("tri", {"urgency": 0, "topic": "praise"}) == []
    assert (run.status, run.result, run.values["route"]) == ("done", "no action needed", "no action needed")
    assert set(run.graph.predecessors("route")) == {"tri"}
    assert run.remaining_calls().total == 0


def test_a_constant_default_and_a_null_one():
    p = Program("p", inputs={"n": int})
    p.output({"sign": p.branch("sign", on=p.input("n"), cases=[(lambda n: n < 0, -1), (0, 0)], default=1),
              "note": p.branch("note", on=p.input("n"), cases={7: "lucky"}, default=Constant(None))})
    c = p.compile()
    assert c.start({"n": -5}).result == {"sign": -1, "note": None}
    assert c.start({"n": 7}).result == {"sign": 1, "note": "lucky"}
    assert c.start({"n": 0}).result == {"sign": 0, "note": None}


def test_a_constant_is_copied_into_each_run():
    p = Program("p", inputs={"n": int})
    p.output(p.branch("b", on=p.input("n"), cases={1: {"tags": ["a"]}}))
    c = p.compile()
    first = c.start({"n": 1})
    first.result["tags"].append("changed")
    assert c.start({"n": 1}).result == {"tags": ["a"]}


def test_a_downstream_prompt_reads_a_constant():
    p = Program("p", inputs={"n": int})
    p.branch("tone", on=p.input("n"), cases=[(lambda n: n > 100, "formal")], default="friendly")
    p.output(p.llm("write", prompt="Write a {tone} note about {n}"))
    run = p.compile().start({"n": 500})
    assert run.ready() == ["write"]
    assert render_prompt(run.spec("write"), run.values)[0]["content"] == "Write a formal note about 500"


def test_a_raising_predicate_fails_the_branch_naming_the_case():
    c = triage(cases=[(urgent, "page"), (escalated, "escalate")], default="queue").compile()
    run = c.start({"ticket": "?"})
    with pytest.raises(ProgramRunError) as e:
        run.complete("tri", {"urgency": 1, "topic": "bug"})
    assert e.value.node == "route" and run.status == "failed" and run.graph.nodes["route"]["state"] == "failed"
    assert str(e.value) == ("route: case escalated: predicate escalated raised KeyError: 'escalation' "
                            "(on tri = {'urgency': 1, 'topic': 'bug'})")


def test_a_predicate_that_does_not_answer_a_bool_fails_the_branch():
    c = triage(cases=[(lambda t: t.get("escalate"), "escalated")], default="normal").compile()
    run = c.start({"ticket": "?"})
    with pytest.raises(ProgramRunError, match=r"^route: case case0: predicate <lambda> returned None, not a bool"):
        run.complete("tri", {"urgency": 1, "topic": "x"})


def test_predicates_get_a_copy_of_the_value():
    def meddle(t):
        t["urgency"] = 99
        return False

    run = triage(cases=[(meddle, "x"), (lambda t: t["urgency"] == 99, "seen")], default="y").compile().start(
        {"ticket": "?"})
    run.complete("tri", {"urgency": 1, "topic": "x"})
    assert run.values["tri"] == {"urgency": 1, "topic": "x"} and run.result == "y"


def test_no_match_without_a_default_fails_as_before():
    run = triage().compile().start({"ticket": "?"})
    with pytest.raises(ProgramRunError, match=r"^route: tri = \{'urgency': 3, 'topic': 'bug'\} matches no case "
                                              r"\(urgent, case1, case2\) and there is no default"):
        run.complete("tri", {"urgency": 3, "topic": "bug"})


def test_a_predicate_branch_in_a_fan_out_body_decides_per_item():
    p = Program("p", inputs={"scores": list})

    def grade(b):
        return b.branch("grade", on=b.item, cases=[(lambda s: s >= 90, "A"), (lambda s: s >= 50, "pass")],
                        default=lambda c: c.llm("advice", prompt="Advise on a score of {item}"))

    p.output(p.fan_out("grades", over=p.input("scores"), body=grade))
    run = p.compile().start({"scores": [95, 10, 60]})
    assert run.ready() == ["grades[1].grade?default.advice"]
    run.complete("grades[1].grade?default.advice", "Study more.")
    assert run.result == ["A", "Study more.", "pass"]


# -- export and the runtime --

def test_export_names_predicates_and_shows_constants():
    c = triage(default=lambda b: b.llm("reply", prompt="Reply to {ticket}")).compile()
    route = next(n for n in c.to_json()["nodes"] if n["id"] == "route")
    assert route["cases"] == [
        {"label": "urgent", "predicate": "urgent", "result": "route?urgent.page"},
        {"label": "case1", "predicate": "<lambda>", "result": "route?case1.bill"},
        {"label": "case2", "predicate": "<lambda>", "constant": "no action needed"},
        {"label": "default", "default": True, "result": "route?default.reply"}]
    assert json.loads(json.dumps(c.to_json())) == c.to_json()
    assert "branch on tri" in c.to_mermaid() and '"route" [label="route\\nbranch on tri"' in c.to_dot()


async def run_scripted(program, inputs, replies):
    """The program on the runtime, its LLM calls answered by `replies`: (result, nodes asked)."""
    from agentrt.runtime import Runtime, ScriptedBackend

    backend = ScriptedBackend(replies, step_s=0.001)
    try:
        result = await Runtime(backend).run(program, inputs)
    finally:
        await backend.aclose()
    return result, [r.node.node for r in backend.requests]


async def test_the_runtime_runs_a_predicate_branch_and_stops_at_a_constant():
    c = triage().compile()
    result, asked = await run_scripted(c, {"ticket": "double charge"},
                                       {"tri": {"urgency": 1, "topic": "billing"}, "route?case1.bill": "Refunded."})
    assert (result.status, result.output, asked) == ("done", "Refunded.", ["tri", "route?case1.bill"])
    result, asked = await run_scripted(c, {"ticket": "thanks"}, {"tri": {"urgency": 0, "topic": "praise"}})
    assert (result.status, result.output, asked) == ("done", "no action needed", ["tri"])


async def test_the_runtime_fails_the_run_at_a_raising_predicate():
    program = triage(cases=[(escalated, "x")], default="y").compile()
    result, _ = await run_scripted(program, {"ticket": "?"}, {"tri": {"urgency": 1, "topic": "bug"}})
    assert (result.status, result.failed_node) == ("failed", "route")
    assert "case escalated: predicate escalated raised KeyError: 'escalation'" in result.error


def test_the_refund_desk_example_picks_its_policy_by_predicates():
    from agentrt.runtime.loader import load_example

    example = load_example(EXAMPLES / "refund_desk.py")
    c = example.program
    assert [case.label for case in c.spec("policy").cases] == ["case0", "costly", "default"]
    for order_id, price, policy in ((1042, 58.0, "Orders of 50 EUR or more"), (1043, 35.0, "Orders up to 40 EUR"),
                                    (1041, 42.0, "Refund what is fair")):
        run = c.start({**example.default_inputs, "order_id": order_id})
        order = {"order_id": order_id, "item": "x", "price": price, "customer": "C"}
        assert run.complete("order", order) == ["proposal"]
        assert run.values["policy"].startswith(policy)
        assert f"Refund policy: {policy}" in render_prompt(run.spec("proposal"), run.values)[-1]["content"]
