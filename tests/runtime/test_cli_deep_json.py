"""`agentrt run` with JSON nested past the depth limit: an --input or --answer value stops the
command naming the limit; a wait_for value typed at the terminal or piped in is refused saying
why, and the next good value is taken."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from rich.console import Console

from agentrt.cli.run import parse_answers, run_example
from agentrt.errors import RunConfigError
from agentrt.jsonutil import MAX_JSON_DEPTH
from agentrt.runtime.input_prompt import ask_value, console_reader
from agentrt.runtime.loader import coerce_input, load_example

REVIEW = Path(__file__).parents[1] / "server" / "review_program.py"  # an LLM node, then a wait_for node
DEEP = "[" * 5000 + "]" * 5000
TOO_DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels"


@pytest.mark.parametrize("type_name", ["array", "object"])
def test_an_input_nested_past_the_limit_names_it(type_name):
    with pytest.raises(RunConfigError, match=f"--input x=.*{TOO_DEEP}"):
        coerce_input("x", type_name, DEEP)


def test_an_answer_nested_past_the_limit_names_it():
    with pytest.raises(RunConfigError, match=f"--answer review: the value is {TOO_DEEP}"):
        parse_answers([f"review={DEEP}"])
    assert parse_answers(['review={"approved": true}']) == {"review": {"approved": True}}


def test_the_terminal_prompt_refuses_a_deep_value_and_asks_again():
    """A value typed as JSON (here: the whole value, an array) at the terminal."""
    screen = io.StringIO()
    console = Console(file=screen, width=200, color_system=None)
    value = ask_value({"type": "array", "items": {"type": "integer"}},
                      console_reader(console, io.StringIO(f"{DEEP}\n[1, 2]\n")), console, node="review")
    assert value == [1, 2]
    assert f"the value is {TOO_DEEP}" in screen.getvalue()


async def test_piped_answers_refuse_a_deep_value_and_the_run_takes_the_next(scripted, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f'{DEEP}\n{{"approved": true}}\n'))
    screen = io.StringIO()
    result, _ = await run_example(load_example(REVIEW), {"topic": "rain"}, scripted({"draft": "Rain on the roofs."}),
                                  trace_path=tmp_path / "t.jsonl", console=Console(file=screen, width=300), live=False)
    assert result.status == "done" and result.output is True
    assert TOO_DEEP in screen.getvalue()  # the refusal says why
