"""The three example programs (trip planner, research fan-out, SQL agent), declared with the DSL,
compiled, and driven through a run (the LLM and tool outputs are fixed values standing in for the
runtime)."""
import pytest

from agentrt.dag import JsonSchema, Program, render_prompt, tool_arguments
from agentrt.errors import ProgramRunError


def fn(name, properties, required=None, description=""):
    return {"type": "function", "function": {"name": name, "description": description or name, "parameters": {
        "type": "object", "properties": properties, "required": required or list(properties)}}}


WEATHER = fn("get_weather", {"city": {"type": "string"}, "date": {"type": "string"}})
CURRENCY = fn("convert_currency", {"from": {"type": "string"}, "to": {"type": "string"}, "amount": {"type": "number"}})
CALENDAR = fn("find_free_days", {"start": {"type": "string"}, "days": {"type": "integer"}})
SEARCH = fn("search", {"query": {"type": "string"}})
INSPECT = fn("inspect_schema", {"table": {"type": "string"}}, required=[])
RUN_QUERY = fn("run_query", {"sql": {"type": "string"}})

PLAN_SCHEMA = {"type": "object", "required": ["city", "currency", "start", "days", "budget"], "properties": {
    "city": {"type": "string"}, "currency": {"type": "string"}, "start": {"type": "string"},
    "days": {"type": "integer"}, "budget": {"type": "number"}}}


def trip_planner():
    p = Program("trip_planner", inputs={"request": str, "home_currency": str}, tools=[WEATHER, CURRENCY, CALENDAR])
    plan = p.llm("plan", prompt="Plan this trip: {request}", output=JsonSchema(PLAN_SCHEMA))
    p.tool("weather", "get_weather", args={"city": plan["city"], "date": plan["start"]},
           fallback={"forecast": "unavailable"})
    p.tool("money", "convert_currency",
           args={"from": p.input("home_currency"), "to": plan["currency"], "amount": plan["budget"]})
    p.tool("days", "find_free_days", args={"start": plan["start"], "days": plan["days"]})
    p.output(p.llm("summary", prompt="Itinerary for {plan.city}. Weather: {weather}. Budget: {money}. "
                                     "Free days: {days}."))
    return p.compile()


def research():
    p = Program("research", inputs={"question": str}, tools=[SEARCH])
    subs = p.llm("split", prompt="Write 2-5 sub-questions for: {question}",
                 output=JsonSchema({"type": "array", "items": {"type": "string"}, "maxItems": 5}))

    def per_question(b):
        b.tool("search", "search", args={"query": b.item}, fallback=[])
        return b.llm("summary", prompt="Summarise what {search} says about {item}", max_tokens=128)

    answers = p.fan_out("answers", over=subs, body=per_question)
    p.output(p.llm("synthesis", prompt="Answer {question} from these findings: {answers}"))
    return p.compile(), answers


def sql_agent(max_steps=6, on_max_steps="answer"):
    p = Program("sql_agent", inputs={"question": str}, tools=[INSPECT, RUN_QUERY])
    p.output(p.agent_loop("agent", prompt="Answer from the database: {question}",
                          system="Inspect the schema before querying. Fix failed queries.",
                          tools=["inspect_schema", "run_query"], max_steps=max_steps, on_max_steps=on_max_steps))
    return p.compile()


def test_trip_planner_compiles_and_runs_with_a_fallback():
    c = trip_planner()
    assert c.topological_order == ("request", "home_currency", "plan", "weather", "money", "days", "summary")
    assert {c.graph.nodes[n]["kind"] for n in c.graph} == {"input", "llm", "tool"}
    assert set(c.graph.predecessors("summary")) == {"plan", "weather", "money", "days"}
    run = c.start({"request": "4 days in Lisbon in May", "home_currency": "NOK"})
    assert run.ready() == ["plan"]
    plan = {"city": "Lisbon", "currency": "EUR", "start": "2025-05-02", "days": 4, "budget": 900.0}
    assert run.complete("plan", plan) == ["weather", "money", "days"]  # the three tools run in parallel
    assert tool_arguments(run.spec("money"), run.values) == {"from": "NOK", "to": "EUR", "amount": 900.0}
    run.fail("weather", TimeoutError("weather service timed out"))  # declared fallback
    run.complete("money", {"amount": 10200})
    assert run.complete("days", ["2025-05-02", "2025-05-03"]) == ["summary"]
    prompt = render_prompt(run.spec("summary"), run.values)[-1]["content"]
    assert prompt == ('Itinerary for Lisbon. Weather: {"forecast": "unavailable"}. Budget: {"amount": 10200}. '
                      'Free days: ["2025-05-02", "2025-05-03"].')
    run.complete("summary", "Day 1: ...")
    assert (run.status, run.result) == ("done", "Day 1: ...")


def test_trip_planner_tool_without_fallback_ends_the_run_naming_it():
    run = trip_planner().start({"request": "x", "home_currency": "NOK"})
    run.complete("plan", {"city": "Oslo", "currency": "NOK", "start": "d", "days": 1, "budget": 1})
    with pytest.raises(ProgramRunError, match=r"^money: tool call failed: HTTP 503") as e:
        run.fail("money", "HTTP 503")
    assert e.value.node == "money" and run.status == "failed" and run.error is e.value
    assert run.graph.nodes["money"]["state"] == "failed" and run.ready() == []


def test_research_fan_out_compiles_with_a_template_body():
    c, answers = research()
    assert c.topological_order == ("question", "split", "answers[*].item", "answers[*].search",
                                   "answers[*].summary", "answers", "synthesis")
    assert all(c.graph.nodes[n]["template"] for n in c.graph if "[*]" in n)
    assert set(c.graph.predecessors("answers")) == {"split", "answers[*].summary"}
    assert answers.node == "answers"


def test_research_fan_out_runs_in_parallel_and_fans_in_in_order():
    c, _ = research()
    run = c.start({"question": "Why is the sky blue?"})
    run.complete("split", ["What is Rayleigh scattering?", "Why not violet?", "What about sunsets?"])
    assert run.ready() == ["answers[0].search", "answers[1].search", "answers[2].search"]
    assert tool_arguments(run.spec("answers[1].search"), run.values) == {"query": "Why not violet?"}
    for i in (2, 0, 1):
        run.complete(f"answers[{i}].search", [f"page {i}"])
    assert render_prompt(run.spec("answers[2].summary"), run.values)[0]["content"] == \
        'Summarise what ["page 2"] says about What about sunsets?'
    for i in (1, 2, 0):  # finish out of order: the fan-in keeps item order
        run.complete(f"answers[{i}].summary", f"finding {i}")
    assert run.values["answers"] == ["finding 0", "finding 1", "finding 2"]
    assert run.ready() == ["synthesis"]
    run.complete("synthesis", "Because of Rayleigh scattering.")
    assert run.result == "Because of Rayleigh scattering."


def test_sql_agent_loop_feeds_query_errors_back_to_the_model():
    run = sql_agent().start({"question": "How many users signed up in May?"})
    assert run.ready() == ["agent#1.llm"]
    first = run.spec("agent#1.llm")
    fmt = first.output.to_response_format()
    assert fmt["type"] == "tool_call" and fmt["allow_text"] is True
    assert [t["function"]["name"] for t in fmt["tools"]] == ["inspect_schema", "run_query"]
    assert run.complete("agent#1.llm", {"name": "inspect_schema", "arguments": {}}) == ["agent#1.tool"]
    run.complete("agent#1.tool", {"users": ["id", "created_at"]})
    run.complete("agent#2.llm", {"name": "run_query", "arguments": {"sql": "SELECT count(*) FROM user"}})
    assert tool_arguments(run.spec("agent#2.tool"), run.values) == {"sql": "SELECT count(*) FROM user"}
    run.fail("agent#2.tool", RuntimeError("no such table: user"))  # goes back to the model
    messages = render_prompt(run.spec("agent#3.llm"), run.values)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert messages[-1] == {"role": "tool", "tool_call_id": "call_2", "name": "run_query",
                            "content": '{"error": "no such table: user"}'}
    assert messages[4]["tool_calls"][0]["function"] == {"name": "run_query",
                                                       "arguments": '{"sql": "SELECT count(*) FROM user"}'}
    run.complete("agent#3.llm", {"name": "run_query", "arguments": {"sql": "SELECT count(*) FROM users"}})
    run.complete("agent#3.tool", [[42]])
    run.complete("agent#4.llm", {"text": "42 users signed up in May."})
    assert (run.status, run.result) == ("done", "42 users signed up in May.")
    chain = ["agent#1.llm", "agent#1.tool", "agent#2.llm", "agent#2.tool", "agent#3.llm", "agent#3.tool",
             "agent#4.llm", "agent"]
    assert all(run.graph.has_edge(u, v) for u, v in zip(chain, chain[1:]))
    assert set(run.graph.predecessors("agent")) == {"agent#4.llm"}


def test_tools_from_agentrt_tools_are_accepted_as_declared():
    from agentrt.tools import tool

    @tool
    def get_forecast(city: str, days: int = 1) -> dict:
        """Forecast for a city."""
        return {"city": city, "days": days}

    p = Program("t", inputs={"city": str}, tools=[get_forecast])
    forecast = p.tool("forecast", "get_forecast", args={"city": p.input("city")})
    p.output(p.llm("tip", prompt="Tip for {city}: {forecast.summary}"))  # open output schema: unchecked
    c = p.compile()
    assert c.tools["get_forecast"].parameters == get_forecast.parameters
    bad = Program("t", inputs={"city": str}, tools=[get_forecast])
    bad.output(bad.tool("forecast", "get_forecast", args={"town": bad.input("city")}))
    with pytest.raises(Exception, match=r"^forecast: args.town: tool 'get_forecast' has no parameter 'town'"):
        bad.compile()
