"""Fixtures of the runtime tests: scripted backends (closed after each test) and, for the tests
that run the examples end to end, the embedded engine loaded once per session."""
from __future__ import annotations

import pytest

from agentrt.dag import JsonSchema, Program
from agentrt.runtime import ScriptedBackend


@pytest.fixture
async def scripted():
    """scripted(replies, **options) -> a ScriptedBackend stopped at the end of the test."""
    made: list[ScriptedBackend] = []

    def make(replies=None, **kw) -> ScriptedBackend:
        kw.setdefault("step_s", 0.001)
        backend = ScriptedBackend(replies, **kw)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()


@pytest.fixture(scope="session")
def engine():
    """The embedded SmolLM2-135M behind AsyncEngine, with the template drafter (α split into grammar-forced and free drafts)."""
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig

    eng = AsyncEngine(LLMEngine(EngineConfig(spec=SpecConfig(drafter="template"))))
    yield eng
    eng.close()


@pytest.fixture
def research_program():
    """research_program(search_tool): a split into a JSON list, a fan-out of search + summary
    over it, and a synthesis."""

    def research_program(search_tool):
        p = Program("research", inputs={"question": str}, tools=[search_tool])
        subs = p.llm("split", prompt="Split {question}", output=JsonSchema({"type": "array", "items": {"type": "string"}}))

        def body(b):
            b.tool("search", "search", args={"query": b.item})
            return b.llm("summary", prompt="Summarise {search} for {item}")

        p.fan_out("answers", over=subs, body=body)
        p.output(p.llm("synthesis", prompt="Answer from {answers}", max_tokens=64))
        return p

    return research_program


class SpanReader:
    """A runtime's trace read by node: its top-level spans, and when a node started running."""

    def __init__(self, rt) -> None:
        self.records = [r for r in rt.trace.records() if r["type"] == "span"]

    def node_spans(self) -> dict[str, dict]:
        return {r["attributes"]["agentrt.node"]: r for r in self.records if r["parent_id"] is None}

    def started(self, node: str) -> float:
        """When the node left its waiting phase (its span opens when the node appears)."""
        span = self.node_spans()[node]["span_id"]
        return min(r["start"] for r in self.records
                   if r["parent_id"] == span and r["attributes"].get("agentrt.phase") != "waiting")


@pytest.fixture
def span_reader():
    """span_reader(rt) -> a SpanReader of the runtime's trace as it stands."""
    return SpanReader
