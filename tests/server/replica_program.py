"""A program for the replica tests, tools only (no LLM call, so every replica runs it the same):
`record` counts its calls in a file, then `wait_go` (idempotent) counts its starts and waits for a
go-file (go-N), so a test can cancel the run, or kill its replica, while that tool runs. AGENTRT_TEST_DIR
names the folder of the files."""
import os
import time
from pathlib import Path

from agentrt.dag import Program
from agentrt.tools import tool

DIR = Path(os.environ.get("AGENTRT_TEST_DIR", "."))


def count(name: str, note: str) -> None:
    with (DIR / f"{name}.calls").open("a") as f:
        f.write(note + "\n")


@tool
def record(n: int) -> int:
    "Record a number (not idempotent: each call is one more line)."
    count("record", str(n))
    return n


@tool(idempotent=True)
def wait_go(n: int) -> int:
    "Double a number once its go-file (go-N) exists."
    count("wait_go", f"start {n}")
    while not (DIR / f"go-{n}").exists():
        time.sleep(0.05)
    count("wait_go", f"end {n}")
    return 2 * n


tools = [record, wait_go]
DEFAULT_INPUTS = {"n": 21}

p = Program("replica", inputs={"n": int}, tools=tools)
rec = p.tool("record", "record", args={"n": p.input("n")})
p.output(p.tool("double", "wait_go", args={"n": rec}))
program = p.compile()
