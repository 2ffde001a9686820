"""`agentrt run` asking a person for a wait_for node's value: field by field on a terminal, one JSON
value per line from piped input; every answer checked against the schema and asked again."""
from __future__ import annotations

import asyncio
import io
import os
import pty
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from agentrt.dag import Program
from agentrt.runtime import Runtime
from agentrt.runtime.input_prompt import answer_inputs, ask_value, console_reader

ROOT = Path(__file__).parents[2]
DECISION = {"type": "object", "properties": {"approved": {"type": "boolean"}, "note": {"type": "string", "maxLength": 20}},
            "required": ["approved"], "additionalProperties": False}


def asked(schema, typed: str, **kw):
    """(value, transcript) of asking for `schema` with `typed` as the person's lines."""
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    value = ask_value(schema, console_reader(console, io.StringIO(typed)), console, node="approval", **kw)
    return value, out.getvalue()


def test_a_boolean_is_yes_or_no_and_text_keeps_to_its_length():
    value, shown = asked(DECISION, "maybe\nyes\nthis note is far too long for it\nfine by me\n", question="Refund 58 EUR?")
    assert value == {"approved": True, "note": "fine by me"}
    assert "approval: Refund 58 EUR?" in shown and "approved (yes/no): maybe" in shown
    assert "approved: answer yes or no" in shown
    assert "note (text, at most 20 characters, optional: Enter to skip)" in shown
    assert "is too long" in shown  # the schema's own words, then asked again


def test_an_empty_answer_skips_an_optional_field_and_a_required_one_is_asked_again():
    value, shown = asked(DECISION, "\nn\n\n")
    assert value == {"approved": False}
    assert "approved is required" in shown


def test_choices_are_numbered_numbers_keep_their_bounds_and_defaults_are_taken_on_enter():
    schema = {"type": "object", "required": ["level", "amount", "count"], "properties": {
        "level": {"enum": ["low", "high", "urgent"], "description": "how soon"},
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "count": {"type": "integer", "exclusiveMinimum": 0, "default": 1},
        "mode": {"const": "manual"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "ok": {"type": "boolean", "default": False}}}
    typed = "7\nurgent\n-3\nlots\n12.5\n2.5\n\n[\"a\", \"b\", \"c\"]\n[\"a\"]\n\n"
    value, shown = asked(schema, typed)
    assert value == {"level": "urgent", "amount": 12.5, "count": 1, "mode": "manual", "tags": ["a"], "ok": False}
    for part in ("level: how soon", "1) low", "3) urgent", "pick a number from 1 to 3",
                 "amount (a number from 0 to 1000)", "-3 is less than the minimum of 0", "'lots' is not a number",
                 "count (a whole number > 0, Enter for 1)", "'2.5' is not a whole number", "mode: manual (fixed by the schema)",
                 "tags (JSON: array, optional: Enter to skip)", "is too long", "ok (yes/no, Enter for no)"):
        assert part in shown, part
    assert asked(schema, "2\n5\n3\n\n\n")[0]["level"] == "high"  # a number picks the choice


def test_a_schema_that_is_not_an_object_is_one_question_and_the_whole_value_is_checked():
    assert asked({"type": "integer", "minimum": 1}, "0\n4\n")[0] == 4
    either = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "minProperties": 1}
    value, shown = asked(either, "\n\n\nx\n")
    assert value == {"b": "x"} and "the value as a whole does not fit" in shown
    assert asked({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}, '""\n')[0] == {"s": ""}


def test_input_that_ends_before_the_answer_raises_eof():
    with pytest.raises(EOFError):
        asked(DECISION, "maybe\n")


def approval_program() -> Program:
    p = Program("approve", inputs={"sql": str})
    p.wait_for("approval", DECISION, prompt="Run {sql}?")
    p.output(p.llm("answer", prompt="Say whether {sql} may run: {approval}", max_tokens=8))
    return p


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def answered(scripted, stdin, answers=None):
    """(run result, transcript, the approval span's attributes) of the approval program whose
    wait_for node is answered from `stdin` (or --answer)."""
    out = io.StringIO()
    async with Runtime(scripted({"answer": "It may."})) as rt:
        answer_inputs(rt, answers or {}, Console(file=out, width=200, color_system=None), stdin=stdin)
        result = await asyncio.wait_for(rt.run(approval_program(), {"sql": "DROP TABLE t"}), 10)
        spans = [r for r in rt.trace.records() if r["type"] == "span" and r["parent_id"] is None]
    attrs = next((s["attributes"] for s in spans if s["attributes"]["agentrt.node"] == "approval"), {})
    return result, out.getvalue(), attrs


async def test_piped_input_is_one_json_value_per_line_checked_against_the_schema(scripted):
    result, shown, attrs = await answered(scripted, io.StringIO('yes\n{"approved": "yes"}\n\n{"approved": true}\n'))
    assert result.ok and result.output == "It may."
    assert "reading one JSON value per line" in shown and "approval: not JSON" in shown
    assert "'yes' is not of type 'boolean'" in shown
    assert attrs["agentrt.value"] == {"approved": True} and attrs["agentrt.input.via"] == "stdin"


async def test_a_terminal_is_asked_field_by_field(scripted):
    result, shown, attrs = await answered(scripted, FakeTerminal("y\nlooks right\n"))
    assert result.ok and "approval: Run DROP TABLE t?" in shown and "approved (yes/no): y" in shown
    assert attrs["agentrt.value"] == {"approved": True, "note": "looks right"}
    assert attrs["agentrt.input.via"] == "terminal"


async def test_input_that_ends_stops_the_run_saying_how_to_answer_and_a_bad_answer_flag_is_asked_again(scripted):
    result, shown, _ = await answered(scripted, io.StringIO(""))
    assert not result.ok and "give it with --answer approval=JSON" in shown
    result, shown, attrs = await answered(scripted, FakeTerminal("no\n\n"), answers={"approval": {"approved": 1}})
    assert result.ok and "--answer approval: input for node 'approval'" in shown
    assert attrs["agentrt.value"] == {"approved": False} and attrs["agentrt.input.via"] == "terminal"


PTY_SCRIPT = textwrap.dedent("""
    import asyncio
    from rich.console import Console
    from agentrt.runtime import Runtime
    from agentrt.runtime.input_prompt import answer_inputs
    from agentrt.runtime.scripted import ScriptedBackend
    from tests.runtime.test_input_prompt import approval_program

    async def main():
        async with Runtime(ScriptedBackend({"answer": "It may."})) as rt:
            answer_inputs(rt, {}, Console())
            result = await rt.run(approval_program(), {"sql": "DROP TABLE t"})
            print("RESULT", result.output)

    asyncio.run(main())
""")


def test_a_real_pseudo_terminal_gets_the_field_questions():
    """Through a real pty: stdin is a terminal, read with input(), and the answers go in."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", PTY_SCRIPT], stdin=follower, stdout=follower, stderr=follower,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"})
    os.close(follower)
    seen, deadline = b"", time.monotonic() + 60
    # (what the terminal shows, how many times, then what the person types)
    replies = [(b"approved (yes/no): ", 1, b"perhaps\n"), (b"approved (yes/no): ", 2, b"yes\n"),
               (b"note (text", 1, b"\n")]
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the child closed the terminal: all is read
                    break
                if not chunk:
                    break
                seen += chunk
            if replies and seen.count(replies[0][0]) >= replies[0][1]:
                os.write(leader, replies.pop(0)[2])
        proc.wait(timeout=30)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode("utf-8", "replace")
    assert not replies, text
    assert "RESULT It may." in text, text
