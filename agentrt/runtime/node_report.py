"""`agentrt inspect TRACE --node ID`: one node of a run in full, from its span in the trace.

LLM node: the parts of its prompt with their token counts (what the engine added marked), the
messages and tools as sent, the exact prompt text the tokenizer encoded, the raw output, the
parsed value, the finish reason, usage and α. Tool node: its arguments, result or error, and
attempts. wait_for node: the question, the schema, the value given, who gave it, how and when.
All: status, phases and what the node waited on.
"""
from __future__ import annotations

import difflib
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentrt.errors import RunConfigError
from agentrt.runtime.summary import node_summary
from agentrt.runtime.trace_content import REDACTED_ATTR, TRUNCATED_ATTR


def node_span(records: list[dict[str, Any]], node: str, run_id: str | None = None) -> tuple[dict[str, Any], list[dict]]:
    """The node's span (of the trace's last run that has it, or of run_id) and its phase spans;
    RunConfigError naming the node ids there are when none matches."""
    spans = [r for r in records if r["type"] == "span"]
    nodes = [s for s in spans if s["parent_id"] is None and (run_id is None or s["run_id"] == run_id)]
    found = [s for s in nodes if s["attributes"].get("agentrt.node") == node]
    if not found:
        ids = sorted({s["attributes"].get("agentrt.node", "?") for s in nodes})
        close = difflib.get_close_matches(node, ids, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise RunConfigError(f"no node '{node}' in this trace{hint} (its nodes: {', '.join(ids) or 'none'})")
    span = found[-1]
    phases = sorted((s for s in spans if s["parent_id"] == span["span_id"]), key=lambda p: p["start"])
    return span, phases


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2, default=repr)


def _section(console: Console, title: str, body: Any, attrs: dict[str, Any], name: str) -> None:
    marks = [m for key, m in ((TRUNCATED_ATTR, "cut to the trace's size limit"), (REDACTED_ATTR, "redacted"))
             if name in (attrs.get(key) or [])]
    console.rule(Text(title + (f" ({', '.join(marks)})" if marks else ""), style="bold"), align="left")
    console.print(Text(_json(body)))


def parts_table(parts: list[dict[str, Any]]) -> Table:
    """The prompt's parts: tokens of each message and of the generation prompt, and of those how
    many the engine added (format instructions, tool descriptions)."""
    t = Table(title="prompt tokens by part", title_justify="left")
    for col in ("part", "tokens", "added by agentrt"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for p in parts:
        t.add_row(p["part"], str(p["tokens"]), str(p.get("added", 0)))
    t.add_row("total", str(sum(p["tokens"] for p in parts)), str(sum(p.get("added", 0) for p in parts)), style="bold")
    return t


def render_answer(console: Console, n: dict[str, Any]) -> None:
    """A wait_for node: who answered, how, when, and how long the run waited for it."""
    if n.get("answered_at") is None:
        console.print("not answered" + (f" (asked at {_clock(n['asked_at'])})" if n.get("asked_at") else ""))
        return
    waited = f" after {n['answered_at'] - n['asked_at']:.1f} s" if n.get("asked_at") else ""
    who = f" by {n['answered_by']}" if n.get("answered_by") else ""  # `by` is optional
    console.print(f"answered{who} via {n.get('via')} at {_clock(n['answered_at'])}{waited}")


def _clock(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))


def attempt_lines(attempts: list[dict[str, Any]]) -> list[Text]:
    """A tool call's attempts, one line each: how it ended and took, its error, the wait after a
    failed one, and why the last failed one was not tried again."""
    lines = []
    for a in attempts:
        head = f"attempt {a.get('attempt')}: {'ok' if a.get('ok') else a.get('error_kind') or 'failed'}, " \
               f"{a.get('duration_s') or 0:.3f} s"
        if a.get("ok"):
            lines.append(Text(head))
            continue
        then = f"not retried: {a['not_retried']}" if a.get("not_retried") else \
            f"retried after {a.get('backoff_s') or 0:.3f} s"
        lines.append(Text(f"{head}: {a.get('error')}; {then}", style="red"))
    return lines


def render_node(console: Console, records: list[dict[str, Any]], node: str, run_id: str | None = None) -> dict[str, Any]:
    """Print one node in full; returns its summary (summary.node_summary) for --json."""
    span, phases = node_span(records, node, run_id)
    a, n = span["attributes"], node_summary(span, phases)
    head = f"{n['node']} ({n['kind']}, {span['name']}): {n['status']}, {n['duration_s']:.3f} s"
    console.print(Text(head, style="bold" if n["status"] == "ok" else "bold red"))
    if n.get("error"):
        console.print(Text(f"error: {n['error']}", style="red"))
    console.print("phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in n["phases"].items())
                  + (f"; waited on {n['waited_on']}" if n.get("waited_on") else ""))
    if n["kind"] == "llm":
        u, s = n["usage"], n["spec"]
        per_pass = "–" if s["tokens_per_pass"] is None else f"{s['tokens_per_pass']:.2f}"
        console.print(f"finish reason: {n.get('finish_reason')}; tokens in {u['input_tokens']} "
                      f"(cached {u['cached_input_tokens']}), out {u['output_tokens']}; drafted {s['drafted']}, "
                      f"accepted {s['accepted']} (forced {s['forced']}), tokens per target pass {per_pass}")
        if a.get("agentrt.prompt.parts"):
            console.print(parts_table(a["agentrt.prompt.parts"]))
        for title, name in (("messages sent", "agentrt.prompt.messages"), ("tools given to the chat template",
                            "agentrt.prompt.tools"), ("prompt text (exactly what the tokenizer encoded)",
                            "agentrt.prompt.text"), ("raw output", "agentrt.output.text"),
                            ("value", "agentrt.value")):
            if name in a:
                _section(console, title, a[name], a, name)
    elif n["kind"] == "wait_for":
        render_answer(console, n)
        for title, name in (("question", "agentrt.input.prompt"), ("schema", "agentrt.input.schema"),
                            ("value given", "agentrt.value")):
            if name in a:
                _section(console, title, a[name], a, name)
    else:
        console.print(f"tool: {n.get('tool')}; attempts: {n.get('attempts')}")
        if "started_before_caller_end_s" in n:
            console.print(f"started early: {n['started_before_caller_end_s']:.3f} s before {n['waited_on']} ended "
                          "(on what it had streamed)")
        for line in attempt_lines(n.get("attempt_log") or []):
            console.print(line)
        for title, name in (("arguments", "gen_ai.tool.call.arguments"), ("result", "gen_ai.tool.call.result")):
            if name in a:
                _section(console, title, a[name], a, name)
    return {**n, "attributes": a}
