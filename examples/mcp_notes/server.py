"""A small MCP server (the official SDK's MCPServer) over stdio: a team's notes, kept in memory.
examples/notes_desk.py starts it as a child process and calls its tools; run on its own it speaks
MCP on stdin/stdout:

    python examples/mcp_notes/server.py

Tools: search_notes (read-only), read_note (read-only), word_count (reports progress per note).
"""
from __future__ import annotations

import asyncio
import re
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

NOTES = {
    "standup-rules": ("Stand-up rules", "Stand-up starts at 9:30 in room Ada. Each person speaks for two minutes: "
                                        "what they finished, what they start, what blocks them."),
    "release-checklist": ("Release checklist", "Before a release: freeze main on Thursday, run the load test, "
                                                "write the changelog, and tag the release on Friday morning."),
    "oncall": ("On-call", "The on-call engineer answers pages within 15 minutes and hands over on Monday at noon "
                          "with a written summary of open incidents."),
}

server = MCPServer("notes", log_level="ERROR")


class Hit(BaseModel):
    id: str
    title: str
    score: int


class Hits(BaseModel):
    hits: list[Hit]


class Note(BaseModel):
    id: str
    title: str
    text: str


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def search_notes(query: Annotated[str, Field(min_length=1, description="words to look for")]) -> Hits:
    """Find the notes that share the most words with the query (best first)."""
    wanted = _words(query)
    scored = [Hit(id=k, title=t, score=len(wanted & _words(t + " " + body))) for k, (t, body) in NOTES.items()]
    return Hits(hits=sorted((h for h in scored if h.score), key=lambda h: -h.score)[:3])


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def read_note(id: Annotated[Literal["standup-rules", "release-checklist", "oncall"],
                            Field(description="a note id from search_notes")]) -> Note:
    """The full text of one note."""
    # the schema lists the ids, so a client that constrains its calls by it (agentrt does) cannot
    # ask for another; a client that does not is told which ones there are
    if id not in NOTES:
        raise ToolError(f"no note '{id}' (notes: {', '.join(NOTES)})")
    title, text = NOTES[id]
    return Note(id=id, title=title, text=text)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def word_count(ctx: Context) -> int:
    """How many words all the notes hold, counted note by note (progress after each)."""
    total = 0
    for i, (_, text) in enumerate(NOTES.values()):
        total += len(text.split())
        await ctx.report_progress(i + 1, len(NOTES), f"counted {i + 1} of {len(NOTES)} notes")
        await asyncio.sleep(0)
    return total


if __name__ == "__main__":
    server.run("stdio")
