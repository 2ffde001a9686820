"""Adds two numbers the model picks, then says the sum (a test program for the server)."""
import asyncio

from agentrt.dag import JsonSchema, Program
from agentrt.tools import tool


@tool
def add(a: int, b: int) -> int:
    "Add two integers."
    return a + b


@tool(retries=1, backoff_s=0.01, retry_on=ConnectionError)
async def slow_add(a: int, b: int, delay: float = 0.0) -> int:
    "Add two integers after a delay."
    await asyncio.sleep(delay)
    return a + b


tools = [add, slow_add]
DEFAULT_INPUTS = {"question": "What is 2 + 3?", "delay": 0.0}

p = Program("calc", inputs={"question": str, "delay": float}, tools=tools)
plan = p.llm("plan", prompt="Pick the numbers in: {question}",
             output=JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                "required": ["a", "b"]}), max_tokens=32)
total = p.tool("sum", "slow_add", args={"a": plan["a"], "b": plan["b"], "delay": p.input("delay")})
p.output(p.llm("answer", prompt="Say that the sum is {sum}.", max_tokens=24))
program = p.compile()
