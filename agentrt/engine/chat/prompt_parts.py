"""Where a chat prompt's tokens go: one count per message, and what the engine added to each.

A program author sees a one-line question cost hundreds of prompt tokens; the breakdown says
which message they sit in and how many of them the engine added (format instructions, tool
descriptions) rather than the author.
"""
from __future__ import annotations

from typing import Any

from agentrt.errors import AgentRTError


def message_token_counts(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], int]:
    """(tokens of each message, tokens of the generation prompt) for a chat prompt.

    Counts are differences between renderings of growing prefixes of the conversation, so they
    add up to the whole prompt's length exactly: a template's framing (role headers, a default
    system prompt, a tools section) counts to the message it is rendered with, and a BPE merge
    across a message boundary counts to the later part."""
    counts, before = [], 0
    for i in range(len(messages)):
        upto = len(tokenizer.encode(tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False,
                                                                  tools=tools)))
        counts.append(upto - before)
        before = upto
    total = len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)))
    return counts, total - before


def prompt_parts(tokenizer: Any, asked: list[dict], sent: list[dict], tools: list[dict] | None) -> list[dict[str, Any]]:
    """The parts of a prompt as [{"part", "tokens", "added"}]: one per message the engine encoded
    ("0:system", "1:user", ...), then "generation prompt". `sent` is `asked` with the engine's
    additions (structured.output_format.with_instructions: instructions joined to a message, or a system
    message put first) and `tools` what it gave the chat template; `added` is how many of a part's
    tokens those additions account for (the same count for the message as asked, subtracted).
    A chat template that refuses a part of the conversation (some require the tools' user turn)
    gives one part, the whole prompt."""
    try:
        sent_counts, generation = message_token_counts(tokenizer, sent, tools)
    except AgentRTError:
        whole = tokenizer.apply_chat_template(sent, add_generation_prompt=True, tools=tools)
        return [{"part": "whole prompt", "tokens": len(tokenizer.encode(whole)), "added": 0}]
    if sent == asked and tools is None:
        asked_counts = sent_counts
    else:
        try:
            asked_counts, _ = message_token_counts(tokenizer, asked, None)
        except AgentRTError:
            asked_counts = sent_counts  # nothing to tell apart: no part counted as added
    inserted = len(sent) - len(asked)  # 1: a system message put first, 0: joined to a message
    parts = []
    for i, (message, tokens) in enumerate(zip(sent, sent_counts)):
        j = i - inserted
        own = asked_counts[j] if 0 <= j < len(asked_counts) else 0
        parts.append({"part": f"{i}:{message.get('role', '?')}", "tokens": tokens, "added": max(0, tokens - own)})
    parts.append({"part": "generation prompt", "tokens": generation, "added": 0})
    return parts
