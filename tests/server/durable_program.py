"""A program for the durable-runs tests: the model picks two numbers, a tool records them (and
counts its calls in a file), a slow tool waits for a go-file (so a test can kill the server while
it runs), then the model says the sum. AGENTRT_TEST_DIR names the directory of the files; with
AGENTRT_SLOW_IDEMPOTENT=1 the slow tool is declared idempotent."""
import json
import os
import time
from pathlib import Path

from agentrt.dag import JsonSchema, Program
from agentrt.tools import tool

DIR = Path(os.environ.get("AGENTRT_TEST_DIR", "."))


def count(name: str, note: str) -> None:
    with (DIR / f"{name}.calls").open("a") as f:
        f.write(note + "\n")


@tool
def record(a: int, b: int) -> dict:
    "Record two numbers."
    count("record", json.dumps([a, b]))
    return {"a": a, "b": b}


@tool(idempotent=os.environ.get("AGENTRT_SLOW_IDEMPOTENT") == "1")
def slow_add(a: int, b: int) -> int:
    "Add two integers once the go-file exists."
    count("slow_add", "start")
    while not (DIR / "go").exists():
        time.sleep(0.05)
    count("slow_add", "end")
    return a + b


tools = [record, slow_add]
DEFAULT_INPUTS = {"question": "What is 2 + 3?"}

p = Program("durable", inputs={"question": str}, tools=tools)
plan = p.llm("plan", prompt="Pick the numbers in: {question}",
             output=JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                "required": ["a", "b"]}), max_tokens=32)
rec = p.tool("record", "record", args={"a": plan["a"], "b": plan["b"]})
total = p.tool("sum", "slow_add", args={"a": rec["a"], "b": rec["b"]})
p.output(p.llm("answer", prompt="Say that the sum of {plan} is {sum}.", max_tokens=24))
program = p.compile()
