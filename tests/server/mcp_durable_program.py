"""A served program whose MCP tool finishes before the run waits for a person (the MCP durability
test kills its server while it waits)."""
import os
import sys
from pathlib import Path

from agentrt.dag import Program
from agentrt.tools.mcp import mcp_tools

# an MCP server gets only a safe subset of its parent's environment: the call log is passed on
fx = mcp_tools("fx", command=[sys.executable, str(Path(__file__).parents[1] / "tools" / "mcp_server_fixture.py")],
               env={"MCP_FIXTURE_CALL_LOG": os.environ.get("MCP_FIXTURE_CALL_LOG", os.devnull)})
GO = {"type": "object", "properties": {"go": {"type": "boolean"}}, "required": ["go"], "additionalProperties": False}

p = Program("counted", inputs={}, tools=fx)
count = p.tool("count", "fx.slow", args={"steps": 3})
p.output(p.wait_for("go_on", GO, prompt="The tool said: {count}. Go on?"))
program = p.compile()
tools = list(fx)  # the implementations the runtime registers (agentrt serve reads them from here)
