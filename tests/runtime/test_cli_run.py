"""`agentrt run`: loading example files, typed --input values, and each example's plumbing and
tools on a scripted model (the real model runs them in test_examples.py)."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from agentrt.cli.run import add_arguments, run_example
from agentrt.dag import Program
from agentrt.errors import RunConfigError
from agentrt.runtime import Runtime, read_trace
from agentrt.runtime.live import LiveProgress
from agentrt.runtime.loader import coerce_input, load_example, resolve_inputs
from agentrt.tools import ToolRaisedError, tool

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("type_name, raw, value", [
    ("string", "a=b", "a=b"), ("integer", "12", 12), ("number", "2.5", 2.5), ("boolean", "Yes", True),
    ("boolean", "off", False), ("array", '["a", 1]', ["a", 1]), ("object", '{"k": [1]}', {"k": [1]}),
])
def test_inputs_are_typed_by_the_program(type_name, raw, value):
    assert coerce_input("x", type_name, raw) == value


@pytest.mark.parametrize("type_name, raw", [("integer", "1.5"), ("boolean", "maybe"), ("array", '{"a": 1}'),
                                            ("object", "[1"), ("number", "many")])
def test_bad_inputs_name_the_input(type_name, raw):
    with pytest.raises(RunConfigError, match=re.escape(f"--input x={raw!r}: not a valid {type_name}")):
        coerce_input("x", type_name, raw)


def test_resolve_inputs_merges_defaults_and_rejects_unknown_keys():
    example = load_example(EXAMPLES / "trip_planner.py")
    assert resolve_inputs(example, []) == example.default_inputs
    got = resolve_inputs(example, ["home_currency=GBP", "request=Two days in Oslo"])
    assert got == {"request": "Two days in Oslo", "home_currency": "GBP"}
    with pytest.raises(RunConfigError, match=r"--input city: not an input of program 'trip_planner' "
                                             r"\(inputs: request, home_currency\)"):
        resolve_inputs(example, ["city=Oslo"])
    with pytest.raises(RunConfigError, match="write key=value"):
        resolve_inputs(example, ["request"])


def test_load_example_errors(tmp_path):
    with pytest.raises(RunConfigError, match="no such file"):
        load_example(tmp_path / "missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(RunConfigError, match="defines no module-level `program`"):
        load_example(empty)
    no_defaults = tmp_path / "needs.py"
    no_defaults.write_text("from agentrt.dag import Program\np = Program('needs', inputs={'q': str})\n"
                           "p.output(p.llm('a', prompt='{q}'))\nprogram = p\n")
    with pytest.raises(RunConfigError, match="needs input\\(s\\) q: pass --input q="):
        resolve_inputs(load_example(no_defaults), [])


def test_run_arguments():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["examples/x.py", "-i", "a=1", "--input", "b=2", "--max-tokens", "32", "--trace", "t.jsonl"])
    assert args.input == ["a=1", "b=2"] and args.max_tokens == 32 and args.spec == "template" and args.trace == "t.jsonl"
    assert not args.verbose and parser.parse_args(["examples/x.py", "-v"]).verbose


async def test_verbose_prints_each_node_as_it_finishes(scripted, tmp_path):
    example = load_example(EXAMPLES / "trip_planner.py")
    buf = io.StringIO()
    plan = {"city": "lisbon", "month": "May", "days": 4, "budget": 900}
    result, _ = await run_example(example, resolve_inputs(example, []), scripted({"plan": plan, "itinerary": "Day 1: Alfama"}),
                                  trace_path=tmp_path / "v.jsonl", console=Console(file=buf, width=200), live=False,
                                  verbose=True)
    lines = [line for line in buf.getvalue().splitlines() if line.startswith("[")]
    finished = [line.split("] ", 1)[1].split(" ", 1)[0] for line in lines]
    assert {"plan", "weather", "money", "days", "itinerary"} <= set(finished) <= set(result.values)
    assert any(line.endswith("(llm) = Day 1: Alfama") for line in lines)
    assert any('weather (tool) = {"city": "Lisbon"' in line for line in lines)


async def run_scripted(name, replies, scripted, tmp_path):
    example = load_example(EXAMPLES / f"{name}.py")
    buf = io.StringIO()
    result, path = await run_example(example, resolve_inputs(example, []), scripted(replies, k=2, accepted=1),
                                     trace_path=tmp_path / f"{name}.jsonl", console=Console(file=buf, width=120),
                                     live=False)
    records = read_trace(path)
    nodes = {r["attributes"]["agentrt.node"]: r for r in records if r["type"] == "span" and r["parent_id"] is None}
    return result, nodes, buf.getvalue()


async def test_trip_planner_tools_read_the_shipped_data(scripted, tmp_path):
    plan = {"city": "lisbon", "month": "May", "days": 4, "budget": 900}
    result, nodes, text = await run_scripted("trip_planner", {"plan": plan, "itinerary": "Day 1: Alfama"}, scripted, tmp_path)
    assert result.status == "done" and result.output == "Day 1: Alfama"
    weather = result.values["weather"]
    assert weather == {"city": "Lisbon", "month": "May", "avg_high_c": 23, "avg_low_c": 14, "rain_days": 6,
                       "summary": "warm, some rain", "currency": "EUR"}
    money = result.values["money"]
    assert money["from"] == "USD" and money["to"] == "EUR" and money["converted"] == pytest.approx(900 / 1.03, abs=0.01)
    days = result.values["days"]
    # 1 May is a holiday and 2-3 May a wedding in the shipped calendar
    assert days == {"start": "2025-05-04", "end": "2025-05-07", "days": 4, "moved_by_days": 3,
                    "avoided": ["Labour Day", "Sister's wedding"]}
    assert "speculation per LLM node" in text and "trace:" in text
    assert nodes["weather"]["attributes"]["gen_ai.tool.call.result"]["city"] == "Lisbon"


async def test_trip_planner_falls_back_for_unknown_places(scripted, tmp_path):
    plan = {"city": "Atlantis", "month": "May", "days": 2, "budget": 10}
    result, nodes, _ = await run_scripted("trip_planner", {"plan": plan, "itinerary": "ok"}, scripted, tmp_path)
    assert result.status == "done"
    assert nodes["weather"]["status"] == "error" and "no climate data for 'Atlantis'" in nodes["weather"]["error"]
    assert nodes["money"]["status"] == "error"  # no currency without the city's data
    assert nodes["days"]["status"] == "ok"


async def test_research_searches_the_corpus_per_sub_question(scripted, tmp_path):
    replies = {"split": ["winter cluster", "varroa mites"], "answers*summary": "a finding", "synthesis": "answer"}
    result, nodes, _ = await run_scripted("research", replies, scripted, tmp_path)
    assert result.status == "done" and result.output == "answer"
    hits = [result.values[f"answers[{i}].search"] for i in range(2)]
    assert [h["doc"] for h in hits[0]] == ["winter", "winter"] and hits[1][0]["doc"] == "varroa"
    assert hits[0][0]["score"] >= hits[0][1]["score"] > 0


async def test_sql_agent_queries_and_repairs(scripted, tmp_path):
    def reply(request):
        results = [m["content"] for m in request.messages if m["role"] == "tool"]
        if not results:
            return {"name": "run_query", "arguments": {"sql": "SELECT COUNT(*) FROM order"}}
        if "SQL error" in results[-1]:
            return {"name": "run_query", "arguments": {"sql": "SELECT COUNT(*) FROM orders o JOIN customers c "
                                                              "ON c.id = o.customer_id WHERE c.city = 'Lyon'"}}
        return f"Customers from Lyon placed {json.loads(results[-1])['rows'][0][0]} orders."

    result, nodes, _ = await run_scripted("sql_agent", reply, scripted, tmp_path)
    assert result.status == "done"
    schema = result.values["schema"]
    assert set(schema) == {"customers", "orders", "products"} and schema["orders"]["rows"] == 300
    assert nodes["agent#1.tool"]["status"] == "error"
    assert nodes["agent#1.tool"]["error"] == 'SQL error: near "order": syntax error'
    rows = result.values["agent#2.tool"]["rows"]
    assert result.output == f"Customers from Lyon placed {rows[0][0]} orders." and rows[0][0] > 0


async def test_sql_agent_database_is_read_only(scripted, tmp_path):
    example = load_example(EXAMPLES / "sql_agent.py")
    run_query = next(t for t in example.tools if t.name == "run_query")
    with pytest.raises(ToolRaisedError, match="SQL error: attempt to write a readonly database"):
        run_query.fn("DELETE FROM orders")
    assert run_query.fn("SELECT COUNT(*) FROM orders")["rows"] == [[300]]


async def test_live_progress_shows_calls_and_stalls(scripted):
    gate = asyncio.Event()

    @tool
    async def wait_for_gate() -> str:
        """Wait until the test opens the gate."""
        await gate.wait()
        return "open"

    p = Program("gated", inputs={}, tools=[wait_for_gate])
    p.tool("g", "wait_for_gate")
    p.output(p.llm("after", prompt="It is {g}"))
    rt = Runtime(scripted({"after": "fine"}), tools=[wait_for_gate])
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100, color_system=None)
    async with LiveProgress(rt, console, refresh_s=0.01):
        handle = rt.submit(p, {})
        while "waits on" not in buf.getvalue():
            await asyncio.sleep(0.01)
        gate.set()
        assert (await handle).status == "done"
    text = buf.getvalue()
    assert "gated" in text and "0/2 calls" in text and "after waits on g (tool_running" in text


def test_agentrt_run_warms_the_engine_up_before_the_program(tmp_path):
    """The one-off costs of a fresh engine are paid before the program's first LLM call, and the
    trace says how long loading and warming up took."""
    import json
    import subprocess
    import sys

    from agentrt.kernels.quant_build import unsupported_reason

    trace = tmp_path / "r.jsonl"
    out = subprocess.run([sys.executable, "-m", "agentrt.cli", "run", str(EXAMPLES / "trip_planner.py"), "--no-live",
                          "--max-tokens", "24", "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 1), out.stderr
    meta = json.loads(trace.read_text().splitlines()[0])["meta"]
    assert meta["engine_load_s"] > 0 and meta["engine_warmup_s"] > 0
    # the embedded GGUF runs its blocks on the int8 kernels (where they build; else dequantized
    # into float): the trace and the terminal say so alike
    want = "GGUF Q4_1/Q8_0, int8 kernels, float32 activations, bfloat16 K/V" if unsupported_reason() is None else "(dequantized from GGUF)"
    assert meta["precision"].endswith(want) and "dtype" not in meta
    assert f"model: smollm2-135m-instruct ({meta['precision']}; cpu)" in out.stdout
