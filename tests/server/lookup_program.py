"""A program whose tool fails when asked to (a test program for the web console): a tool node,
then one short LLM call on its result."""
from agentrt.dag import Program
from agentrt.tools import tool


@tool
def lookup(city: str, fail: bool = False) -> str:
    "Look up today's weather in a city."
    if fail:
        raise RuntimeError(f"the weather service is down for {city}")
    return f"{city}: 12 C, light rain"


tools = [lookup]
DEFAULT_INPUTS = {"city": "Oslo", "fail": False}

p = Program("lookup", inputs={"city": str, "fail": bool}, tools=tools)
info = p.tool("info", "lookup", args={"city": p.input("city"), "fail": p.input("fail")})
p.output(p.llm("say", prompt="Say in one sentence: {info}", max_tokens=16))
program = p.compile()
