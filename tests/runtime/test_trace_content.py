"""What a trace keeps of each node: the exact prompt the engine tokenized (its parts and their
token counts), the raw output, the parsed value, a tool's arguments and result, as JSON values,
cut at a size or redacted; `agentrt inspect --node` shows one node in full."""
from __future__ import annotations

import json

import pytest

from agentrt.cli import main
from agentrt.dag import JsonSchema, Program
from agentrt.engine.chat.messages import normalize_messages
from agentrt.errors import RunConfigError
from agentrt.runtime import EngineBackend, Runtime
from agentrt.runtime.trace_content import REDACTED_ATTR, TRUNCATED_ATTR, TraceContent
from agentrt.tools import tool

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


@tool
def weather(city: str) -> dict:
    """The weather in a city."""
    return {"city": city, "sky": "clear", "notes": ["warm"] * 3}


def weather_program() -> Program:
    p = Program("weather", inputs={"request": str}, tools=[weather])
    where = p.llm("where", prompt="Which city does this ask about? {request}", output=JsonSchema(CITY),
                  system="You extract places.", max_tokens=24)
    p.output(p.tool("forecast", "weather", args={"city": where["city"]}))
    return p


def spans(rt: Runtime) -> dict[str, dict]:
    return {r["attributes"]["agentrt.node"]: r for r in rt.trace.records() if r["type"] == "span" and r["parent_id"] is None}


def test_trace_content_keeps_json_values_cuts_long_ones_and_redacts():
    attrs: dict = {}
    TraceContent().put(attrs, "a", {"k": (1, 2)})
    assert attrs["a"] == {"k": [1, 2]} and TRUNCATED_ATTR not in attrs  # a JSON value, not JSON text
    TraceContent(max_chars=20).put(attrs, "b", "x" * 100)
    assert attrs["b"] == json.dumps("x" * 100)[:20] + "…" and attrs[TRUNCATED_ATTR] == ["b"]
    TraceContent(redact=True).put(attrs, "c", {"secret": "hunter2"})
    assert "hunter2" not in json.dumps(attrs["c"]) and attrs[REDACTED_ATTR] == ["c"]
    with pytest.raises(RunConfigError, match="max_chars"):
        TraceContent(max_chars=0)


async def test_the_trace_holds_the_exact_prompt_the_engine_tokenized(engine, tmp_path):
    rt = Runtime(EngineBackend(engine), tools=[weather])
    result = await rt.run(weather_program(), {"request": "Is it warm in Lisbon today?"})
    assert result.status == "done", result.error
    where, forecast = spans(rt)["where"]["attributes"], spans(rt)["forecast"]["attributes"]
    llm = engine.engine
    sent = where["agentrt.prompt.messages"]
    # the engine's own rendering of the messages it was sent, and the tokens it counted
    assert where["agentrt.prompt.text"] == llm.tokenizer.apply_chat_template(normalize_messages(sent),
                                                                             add_generation_prompt=True)
    assert len(llm.tokenizer.encode(where["agentrt.prompt.text"])) == where["gen_ai.usage.input_tokens"]
    parts = where["agentrt.prompt.parts"]
    assert [p["part"] for p in parts] == ["0:system", "1:user", "generation prompt"]
    assert sum(p["tokens"] for p in parts) == where["gen_ai.usage.input_tokens"]
    # the system message carries the format instructions the engine added; the user's text is the author's
    assert sent[0]["content"].startswith("You extract places.") and "JSON schema" in sent[0]["content"]
    assert parts[0]["added"] > 0 and parts[1]["added"] == 0
    assert json.loads(where["agentrt.output.text"]) == where["agentrt.value"] == {"city": result.output["city"]}
    assert forecast["gen_ai.tool.call.arguments"] == {"city": result.output["city"]}
    assert forecast["gen_ai.tool.call.result"] == result.output

    path = rt.trace.write(tmp_path / "w.jsonl")
    assert main(["inspect", str(path), "--node", "where", "--json"]) == 0


async def test_inspect_node_shows_one_node_in_full(scripted, tmp_path, capsys):
    rt = Runtime(scripted({"where": {"city": "Oslo"}}), tools=[weather])
    assert (await rt.run(weather_program(), {"request": "Oslo?"})).status == "done"
    path = rt.trace.write(tmp_path / "w.jsonl")
    assert main(["inspect", str(path), "--node", "where"]) == 0
    out = capsys.readouterr().out
    assert "messages sent" in out and "Which city does this ask about? Oslo?" in out and '"city": "Oslo"' in out
    assert main(["inspect", str(path), "--node", "forecast"]) == 0
    out = capsys.readouterr().out
    assert "arguments" in out and '"sky": "clear"' in out
    assert main(["inspect", str(path), "--node", "forecast", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["attributes"]["gen_ai.tool.call.result"]["notes"] == ["warm"] * 3
    assert main(["inspect", str(path), "--node", "forcast"]) != 0
    err = capsys.readouterr().err
    assert "no node 'forcast'" in err and "did you mean 'forecast'" in err


async def test_redacted_traces_keep_sizes_not_content(scripted, tmp_path):
    rt = Runtime(scripted({"where": {"city": "Reykjavik"}}), tools=[weather], trace_content=TraceContent(redact=True))
    assert (await rt.run(weather_program(), {"request": "secret plans for Reykjavik"})).status == "done"
    text = rt.trace.write(tmp_path / "w.jsonl").read_text()
    assert "Reykjavik" not in text and "secret plans" not in text
    attrs = spans(rt)["where"]["attributes"]
    assert attrs["gen_ai.usage.input_tokens"] > 0 and "agentrt.value" in attrs[REDACTED_ATTR]


async def test_redaction_drops_the_raw_output_errors_quote(scripted, tmp_path):
    rt = Runtime(scripted({"where": "Reykjavik is not JSON"}), tools=[weather], trace_content=TraceContent(redact=True))
    result = await rt.run(weather_program(), {"request": "secret"})
    assert result.status == "failed" and result.failed_node == "where"
    text = rt.trace.write(tmp_path / "w.jsonl").read_text()
    assert "Reykjavik" not in text and "[redacted]" in text


def test_trace_values_are_copies():
    attrs: dict = {}
    value = {"a": [1]}
    TraceContent().put(attrs, "v", value)
    value["a"].append(2)
    assert attrs["v"] == {"a": [1]}
