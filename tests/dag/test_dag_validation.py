"""compile() and declaration-time validation: every problem names the node at fault."""
import pytest

from agentrt.dag import JsonSchema, Program, Template, Text, ToolCall
from agentrt.errors import ProgramValidationError


def fn(name, properties, required=()):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


WEATHER = fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, required=["city"])
CURRENCY = fn("convert_currency", {"to": {"type": "string"}})
PLAN = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}


def problems_of(program):
    with pytest.raises(ProgramValidationError) as e:
        program.compile()
    err = e.value
    first_node = err.problems[0][0]
    assert str(err).startswith(first_node + ": ")
    return err.problems


def only_problem(program):
    problems = problems_of(program)
    assert len(problems) == 1, problems
    return problems[0]


def declaration_error(fn, *args, **kwargs):
    with pytest.raises(ProgramValidationError) as e:
        fn(*args, **kwargs)
    assert len(e.value.problems) == 1
    node, message = e.value.problems[0]
    site = e.value.sites[node]
    assert site.startswith(__file__ + ":")  # the line that made the declaration: fn(...) above
    assert str(e.value) == f"{node}: {message} (declared at {site})"
    return node, message


def test_compile_errors_name_the_line_that_declared_the_node():
    import inspect

    p = Program("lines", inputs={"topic": str})
    here = inspect.currentframe().f_lineno
    p.llm("unused", prompt="About {topic}")
    p.output(p.llm("used", prompt="More about {topic}"))
    with pytest.raises(ProgramValidationError) as e:
        p.compile()
    (node, _), = e.value.problems
    assert node == "unused" and str(e.value).endswith(f"(declared at {__file__}:{here + 1})")


def trip(**tools):
    return Program("trip", inputs={"city": str}, tools=tools.get("tools", [WEATHER, CURRENCY]))


def test_unknown_placeholder_names_node_and_placeholder_with_a_hint():
    p = trip()
    p.output(p.llm("summary", prompt="Weather for {cty}"))
    node, message = problems_of(p)[0]
    assert node == "summary"
    assert "{cty}" in message and "did you mean 'city'" in message


def test_unknown_reference_from_another_program():
    other = Program("other", inputs={"x": str})
    foreign = other.llm("foreign", prompt="{x}")
    p = trip()
    p.output(p.tool("weather", "get_weather", args={"city": foreign}))
    node, message = only_problem(p)
    assert node == "weather" and "unknown reference foreign" in message and "args.city" in message


@pytest.mark.parametrize("declare, node, needle", [
    (lambda p: p.tool("t", "get_wether", args={"city": p.input("city")}), "t", "unknown tool 'get_wether'"),
    (lambda p: p.llm("t", prompt="{city}", output=ToolCall(["get_weather", "teleport"])), "t",
     "output ToolCall names unknown tool 'teleport'"),
    (lambda p: p.agent_loop("t", prompt="{city}", tools=["get_weather", "run_query"]), "t",
     "tools names unknown tool 'run_query'"),
])
def test_unknown_tools(declare, node, needle):
    p = trip()
    p.output(declare(p))
    found_node, message = only_problem(p)
    assert found_node == node and needle in message and "declared tools: get_weather, convert_currency" in message


def test_tool_args_from_a_call_for_another_tool():
    p = trip()
    call = p.llm("pick", prompt="Convert for {city}", output=ToolCall(["convert_currency"]))
    p.output(p.tool("weather", "get_weather", args=call))
    node, message = only_problem(p)
    assert node == "weather"
    assert "a ToolCall for ['convert_currency']" in message and "never calls 'get_weather'" in message


def test_tool_args_from_a_matching_call_are_accepted_and_marked():
    p = trip()
    call = p.llm("pick", prompt="Weather for {city}", output=ToolCall(["get_weather", "convert_currency"]))
    p.output(p.tool("weather", "get_weather", args=call))
    assert p.compile().spec("weather").args_from_call


def test_reference_to_a_property_the_json_schema_lacks():
    p = trip()
    plan = p.llm("plan", prompt="{city}", output=JsonSchema(PLAN))
    p.output(p.tool("weather", "get_weather", args={"city": plan["town"]}))
    node, message = only_problem(p)
    assert node == "weather" and "plan has no property 'town'" in message and "properties: city, days" in message


def test_placeholder_into_text_output_and_into_a_list():
    p = trip()
    p.llm("note", prompt="{city}")
    words = p.llm("words", prompt="{city}", output=JsonSchema({"type": "array", "items": {"type": "string"}}))
    p.output(p.llm("out", prompt="{note.title} {words.first} {words[0]}"))
    problems = problems_of(p)
    assert [n for n, _ in problems] == ["out", "out"]
    assert "note is string, not an object: no key 'title'" in problems[0][1]
    assert "words is array, not an object: no key 'first'" in problems[1][1]


def test_tool_argument_names_types_and_required_parameters():
    p = trip()
    plan = p.llm("plan", prompt="{city}", output=JsonSchema(PLAN))
    p.output(p.tool("weather", "get_weather", args={"town": plan["city"], "days": "three"}))
    problems = problems_of(p)
    assert all(n == "weather" for n, _ in problems)
    text = "\n".join(m for _, m in problems)
    assert "args.town: tool 'get_weather' has no parameter 'town'" in text
    assert "missing required parameter 'city'" in text
    assert "args.days: literal 'three' does not match" in text


def test_reference_type_mismatch_with_a_parameter():
    p = trip()
    plan = p.llm("plan", prompt="{city}", output=JsonSchema(PLAN))
    p.output(p.tool("weather", "get_weather", args={"city": plan["city"], "days": plan["city"]}))
    node, message = only_problem(p)
    assert node == "weather" and "args.days: plan.city is string" in message


def test_cycle_through_template_names():
    p = trip()
    p.llm("a", prompt="{city} {b}")
    p.output(p.llm("b", prompt="{a}"))
    node, message = only_problem(p)
    assert node == "a" and "cycle a -> b -> a" in message


def test_self_reference_is_a_cycle():
    p = trip()
    p.output(p.llm("a", prompt="{city} {a}"))
    node, message = only_problem(p)
    assert node == "a" and "cycle a -> a" in message


def test_unreachable_nodes_and_unused_inputs():
    p = Program("p", inputs={"city": str, "unused": str}, tools=[WEATHER])
    p.tool("forgotten", "get_weather", args={"city": p.input("city")})
    p.output(p.llm("out", prompt="{city}"))
    problems = dict(problems_of(p))
    assert problems.keys() == {"unused", "forgotten"}
    assert problems["unused"] == "input is never used"
    assert problems["forgotten"].startswith("unreachable")


def test_unreachable_node_inside_a_fan_out_body():
    p = Program("p", inputs={"qs": list}, tools=[WEATHER])

    def body(b):
        b.llm("extra", prompt="{item}")
        return b.llm("keep", prompt="{item}")

    p.output(p.fan_out("f", over=p.input("qs"), body=body))
    node, message = only_problem(p)
    assert node == "f[*].extra" and message.startswith("unreachable")


def test_missing_output_names_the_program():
    p = trip()
    p.llm("a", prompt="{city}")
    problems = problems_of(p)
    assert problems[-1][0] == "trip" and "no output declared" in problems[-1][1]


def test_body_nodes_are_not_visible_outside_their_body():
    p = Program("p", inputs={"qs": list})
    p.fan_out("f", over=p.input("qs"), body=lambda b: b.llm("summary", prompt="{item}"))
    p.output(p.llm("out", prompt="{f} {summary}"))
    assert problems_of(p) == [("out", "prompt: unknown reference {summary}: no node or input 'summary' in scope")]


def test_handle_leaking_out_of_a_body_is_rejected():
    p = Program("p", inputs={"qs": list}, tools=[WEATHER])
    leaked = {}

    def body(b):
        leaked["s"] = b.llm("summary", prompt="{item}")
        return leaked["s"]

    f = p.fan_out("f", over=p.input("qs"), body=body)
    out = p.tool("out", "get_weather", args={"city": leaked["s"]})
    p.output({"f": f, "out": out})
    node, message = only_problem(p)
    assert node == "out" and "f[*].summary is inside the body of f" in message


def test_shadowing_an_outer_id_inside_a_body():
    p = Program("p", inputs={"qs": list, "city": str})
    p.output(p.fan_out("f", over=p.input("qs"), body=lambda b: b.llm("city", prompt="{item}")))
    problems = problems_of(p)
    assert ("f[*].city", "local id 'city' shadows city of an enclosing scope; rename one") in problems


def test_fan_out_over_something_that_is_not_a_list():
    p = trip()
    plan = p.llm("plan", prompt="{city}", output=JsonSchema(PLAN))
    p.output(p.fan_out("f", over=plan["city"], body=lambda b: b.llm("s", prompt="{item}")))
    node, message = only_problem(p)
    assert node == "f" and "over plan.city is string, not a list" in message


def test_branch_case_that_can_never_match_an_enum():
    p = trip()
    kind = p.llm("kind", prompt="{city}", output=JsonSchema({"type": "string", "enum": ["sun", "rain"]}))
    p.output(p.branch("b", on=kind, cases={"sun": lambda s: s.llm("x", prompt="{city}"),
                                             "snow": lambda s: s.llm("y", prompt="{city}")}))
    node, message = only_problem(p)
    assert node == "b" and "case snow can never match" in message


def test_all_problems_are_reported_together_in_declaration_order():
    p = trip()
    p.llm("a", prompt="{nope}")
    p.tool("b", "no_such_tool", args={})
    p.output(p.llm("c", prompt="{a} {b} {c}"))
    err_nodes = [n for n, _ in problems_of(p)]
    assert err_nodes == ["a", "b", "c"]
    with pytest.raises(ProgramValidationError, match=r"\(3 problems in program 'trip'\)$"):
        p.compile()


# -- problems raised at declaration --

def test_invalid_json_schema_names_node_and_part():
    p = trip()
    node, message = declaration_error(p.llm, "plan", prompt="{city}", output=JsonSchema(
        {"type": "object", "properties": {"city": {"type": "strin"}}}))
    assert node == "plan" and "at /properties/city/type" in message


def test_duplicate_ids_and_bad_ids():
    p = trip()
    p.llm("a", prompt="{city}")
    assert declaration_error(p.llm, "a", prompt="x") == ("a", "duplicate id: already used by another node or input")
    assert declaration_error(p.llm, "city", prompt="x")[0] == "city"
    assert declaration_error(p.llm, "bad-id", prompt="x")[0] == "bad-id"
    with pytest.raises(ProgramValidationError, match=r"^f\[\*\]\.item: duplicate id: already used by the fan-out's item"):
        p.fan_out("f", over=p.input("city"), body=lambda b: b.llm("item", prompt="x"))


@pytest.mark.parametrize("prompt, needle", [
    ("{city!r}", "conversions and format specs are not supported"),
    ("{}", "positional placeholders"),
    ("{city", "template syntax"),
    ("{city.}", "cannot read"),
])
def test_template_syntax_errors(prompt, needle):
    node, message = declaration_error(trip().llm, "t", prompt=prompt)
    assert node == "t" and needle in message


def test_bad_arguments_name_the_node():
    p = trip()
    assert declaration_error(p.tool, "t", object())[0] == "t"
    assert "JSON data" in declaration_error(p.tool, "t", "get_weather", args={"city": object()})[1]
    assert "args.q" in declaration_error(p.tool, "t", "get_weather", args={"q": Template("{x!r}")})[1]
    assert declaration_error(p.llm, "t", prompt="x", output="json")[0] == "t"
    assert declaration_error(p.llm, "t", prompt="x", max_tokens=0)[0] == "t"
    assert declaration_error(p.agent_loop, "t", prompt="x", tools=["get_weather"], max_steps=0)[0] == "t"
    assert declaration_error(p.fan_out, "t", over="city", body=lambda b: b.item)[0] == "t"
    assert "must return the Ref" in declaration_error(p.fan_out, "u", over=p.input("city"), body=lambda b: None)[1]
    assert declaration_error(p.branch, "t", on=p.input("city"), cases={"a b": lambda b: b.item})[0] == "t"
    assert declaration_error(p.output, 42)[0] == "trip"


def test_declaring_in_a_body_after_it_returned():
    p = Program("p", inputs={"qs": list})
    kept = []

    def body(b):
        kept.append(b)
        return b.llm("s", prompt="{item}")

    p.fan_out("f", over=p.input("qs"), body=body)
    assert declaration_error(kept[0].llm, "late", prompt="x")[0] == "f[*].late"


def test_bad_tools_and_inputs():
    with pytest.raises(ProgramValidationError, match=r"^tool broken: .*parameters is not a valid JSON schema"):
        Program("p", tools=[fn("broken", {"x": {"type": 3}})])
    with pytest.raises(ProgramValidationError, match=r"^tool get_weather: declared twice"):
        Program("p", tools=[WEATHER, WEATHER])
    with pytest.raises(ProgramValidationError, match=r"^when: input type must be one of"):
        Program("p", inputs={"when": set})
    with pytest.raises(ProgramValidationError, match=r"^town: no input named 'town' \(inputs: city\)"):
        trip().input("town")


def test_ref_in_an_f_string_is_refused():
    p = trip()
    city = p.input("city")
    with pytest.raises(TypeError, match="template placeholder '{city}'"):
        f"Weather in {city}"
    assert Text().to_response_format() == {"type": "text"}
