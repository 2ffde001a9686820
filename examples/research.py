"""Research fan-out: the model splits a question into sub-questions; each is searched in parallel
over a local text corpus (BM25 over the paragraphs of examples/data/corpus/*.md) and summarised;
a last call synthesises the answer from the findings.

    agentrt run examples/research.py
    agentrt run examples/research.py --input question="How do bees decide where to swarm?"

    split (LLM, JSON list) ── answers[i]: search (tool) ── summary (LLM) ── synthesis (LLM)
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field

from agentrt.dag import JsonSchema, Program
from agentrt.tools import tool

CORPUS = Path(__file__).parent / "data" / "corpus"
STOPWORDS = set("""a an and are as at be been but by can do does for from has have how in into is it its
of on or that the their them they this to was were what when where which who why will with""".split())
K1, B = 1.5, 0.75  # BM25 constants (the usual defaults)


def tokens(text: str) -> list[str]:
    """Lower-case words without stopwords, with a light plural/suffix fold (bees -> bee)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return [_fold(w) for w in words if w not in STOPWORDS]


def _fold(word: str) -> str:
    for suffix in ("ies", "es", "s"):
        if word.endswith(suffix) and len(word) > len(suffix) + 2:
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


@dataclass(frozen=True)
class Passage:
    doc: str
    title: str
    text: str
    terms: Counter


@lru_cache(maxsize=1)
def index() -> tuple[list[Passage], dict[str, float], float]:
    """Passages (one per paragraph), BM25 idf per term, mean passage length."""
    passages = []
    for path in sorted(CORPUS.glob("*.md")):
        lines = path.read_text(encoding="utf-8").strip().split("\n")
        title = lines[0].lstrip("# ").strip()
        for para in "\n".join(lines[1:]).split("\n\n"):
            if para.strip():
                passages.append(Passage(path.stem, title, " ".join(para.split()), Counter(tokens(title + " " + para))))
    df = Counter(t for p in passages for t in p.terms)
    n = len(passages)
    idf = {t: math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}
    avg = sum(sum(p.terms.values()) for p in passages) / n
    return passages, idf, avg


def bm25(query: list[str], p: Passage, idf: dict[str, float], avg: float) -> float:
    length = sum(p.terms.values())
    score = 0.0
    for t in query:
        f = p.terms.get(t, 0)
        if f:
            score += idf[t] * f * (K1 + 1) / (f + K1 * (1 - B + B * length / avg))
    return score


@tool(idempotent=True, timeout_s=5)
def search(query: Annotated[str, Field(min_length=1, description="what to look for")],
           k: Annotated[int, Field(ge=1, le=10, description="how many passages")] = 3) -> list[dict]:
    """Search the local corpus; the best-matching passages with their document and score."""
    terms = tokens(query)
    if not terms:
        raise ValueError(f"the query {query!r} has no searchable words")
    passages, idf, avg = index()
    scored = sorted(((bm25(terms, p, idf, avg), i) for i, p in enumerate(passages)), reverse=True)
    return [{"doc": passages[i].doc, "title": passages[i].title, "score": round(s, 3), "text": passages[i].text}
            for s, i in scored[:k] if s > 0]


tools = [search]

p = Program("research", inputs={"question": str}, tools=tools)
subs = p.llm("split", system="You plan web searches.",
             prompt="What keywords would you search to answer: {question}",
             output=JsonSchema({"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 40},
                                "minItems": 1, "maxItems": 3}, name="queries"),
             max_tokens=64)


def per_question(b):
    b.tool("search", "search", args={"query": b.item, "k": 2}, fallback=[])
    return b.llm("summary", system="Answer only from the passages.",
                 prompt="Passages: {search}\nIn one sentence, what do they say about: {item}", max_tokens=48)


answers = p.fan_out("answers", over=subs, body=per_question)
p.output(p.llm("synthesis", system="You write short, factual answers.",
               prompt="Question: {question}\nFindings: {answers}\nAnswer the question in three sentences.",
               max_tokens=128))
program = p.compile()

DEFAULT_INPUTS = {"question": "How do honey bee colonies survive the winter, and what threatens them?"}
