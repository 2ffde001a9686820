"""A program that waits for a person's approval before its one short LLM call (a test program for
the durable-runs tests)."""
from agentrt.dag import Program

APPROVAL = {"type": "object", "properties": {"approved": {"type": "boolean"}}, "required": ["approved"],
            "additionalProperties": False}
DEFAULT_INPUTS = {"sql": "DELETE FROM orders WHERE id = 7"}

p = Program("approve", inputs={"sql": str})
ok = p.wait_for("approval", APPROVAL, prompt="Run {sql}?")
p.output(p.llm("answer", prompt="Say in five words whether {sql} may run: {approval}", max_tokens=8))
program = p.compile()
