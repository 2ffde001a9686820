"""Chat messages as callers send them -> what the chat template can render.

OpenAI-style content may be a string, a list of parts ({"type": "text", "text": ...}, concatenated
as the server's chat API does), or null/absent for an assistant message that only calls tools.
Anything else is a RequestError naming the message and field, before the template sees it (a
template fed an int or a list fails with a TypeError from inside Jinja)."""
from __future__ import annotations

from typing import Any

from agentrt.errors import RequestError


def _content(i: int, message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if message.get("role") == "assistant":
            return ""  # a reply that only calls tools
        raise RequestError(f"messages[{i}].content: missing (only an assistant message may have none)")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   f"are supported, got {kind if kind is not None else type(part).__name__!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{i}].content: expected a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages: list[Any]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role: expected a non-empty string, got {role!r}")
        out.append({**m, "content": _content(i, m)})
    return out
