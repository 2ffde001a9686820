"""A program whose LLM node drafts a line, then waits for a person to approve it (a test program
for the live view of a waiting run)."""
from agentrt.dag import Program

APPROVAL = {"type": "object", "properties": {"approved": {"type": "boolean"}}, "required": ["approved"],
            "additionalProperties": False}
DEFAULT_INPUTS = {"topic": "rain"}

p = Program("review", inputs={"topic": str})
draft = p.llm("draft", prompt="Write one line about {topic}.", max_tokens=8)
review = p.wait_for("review", APPROVAL, prompt="Publish {draft}?")
p.output(review["approved"])
program = p.compile()
