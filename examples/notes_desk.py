"""Notes desk: answers a question from a team's notes, which live in an MCP server
(examples/mcp_notes/server.py, started over stdio as a child process: no network). The notes are
searched first; then an agent loop reads the notes it needs (read_note) and answers. The MCP
tools are in the registry as `notes.search_notes`, `notes.read_note`, ... with the server's own
schemas, so the model's tool calls are constrained by them like any tool's.

    agentrt run examples/notes_desk.py
    agentrt run examples/notes_desk.py --input question="When is the release tagged?"
    agentrt run examples/notes_desk.py --mcp notes="python examples/mcp_notes/server.py"   # another server

    search (notes.search_notes) ── agent loop: LLM ─ notes.read_note ─ ... ─ answer (at most 3 LLM steps)
"""
from __future__ import annotations

import sys
from pathlib import Path

from agentrt.dag import Program
from agentrt.tools.mcp import mcp_tools

notes = mcp_tools("notes", command=[sys.executable, str(Path(__file__).parent / "mcp_notes" / "server.py")])

program = Program("notes_desk", inputs={"question": str}, tools=list(notes))
found = program.tool("search", "notes.search_notes", args={"query": program.input("question")})
program.output(program.agent_loop(
    "answer",
    system="You answer questions about the team's notes. Read a note before you rely on it.",
    prompt="Question: {question}\nNotes that match (id, title): {search.hits}",
    tools=["notes.read_note"], tool_choice="required_first", max_steps=3, max_tokens=96, on_max_steps="answer",
))

tools = list(notes)
DEFAULT_INPUTS = {"question": "What time does stand-up start?"}
