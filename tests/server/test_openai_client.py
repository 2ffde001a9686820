"""`agentrt serve` as a real process on a free port, driven by the official openai client (sync
and async) and by aiohttp for the programs API, on the embedded model (its quantized GGUF weights,
greedy unless said otherwise, short outputs)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

from agentrt.server.process import start_server
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).parents[2]
PROGRAM = Path(__file__).parent / "calc_program.py"
MODEL = "smollm2-135m-instruct"
QUANTIZED = "GGUF Q4_1/Q8_0, int8 kernels, float32 activations, bfloat16 K/V"  # LoadedModel.precision of the embedded GGUF
KEY = "test-key-123"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, runs = free_port(), tmp_path_factory.mktemp("served")
    key_file = runs / "keys"
    key_file.write_text(f"# test keys\n{KEY}\n")
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.py"))
    proc, url = start_server([str(PROGRAM), *examples, "--program-max-tokens", "128", "--runs-dir", str(runs / "runs"),
                              "--api-key-file", str(key_file), "--max-tokens", "256", "--shutdown-grace", "5"],
                             runs, port, ROOT, timeout_s=120)
    yield url, runs
    proc.terminate()
    assert proc.wait(timeout=30) == 0, (runs / "server.log").read_text()
    out = (runs / "server.log").read_text()
    assert "ready at" in out and "stopped" in out
    assert f"model: {MODEL} ({QUANTIZED}; cpu," in out
    assert KEY not in out  # keys are never logged


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_plain_chat_stream_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Name a color."), max_tokens=12, temperature=0)
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    # "length" only when the reply used its whole max_tokens
    assert choice.finish_reason == "stop" or (choice.finish_reason == "length" and r.usage.completion_tokens == 12)
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert {"drafted", "accepted", "alpha", "tokens_per_pass"} <= set(r.model_extra["agentrt"])
    # streamed, the same greedy text
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask("Name a color."), max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the repeated prompt's KV came from the prefix cache
    again = client.chat.completions.create(model=MODEL, messages=ask("Name a color."), max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_tool_call_and_its_stream(client):
    msgs = ask("What is the weather in Oslo?")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=40, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str)
    streamed = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=40,
                                                   temperature=0, stream=True))
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == call.function.name
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # a named function is the one called
    named = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0)
    assert [c.function.name for c in named.choices[0].message.tool_calls][0] == "get_time"


def test_parallel_tool_calls_are_each_valid(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Weather and local time in Oslo and in Rome?"),
                                       tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    if r.choices[0].finish_reason == "tool_calls":
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Invent a person."), max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_errors_in_openai_shape(client, server):
    with pytest.raises(openai.BadRequestError, match="max_tokens=100000: over the limit max_tokens=256"):
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=MODEL, messages=ask("hi"), top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=MODEL, messages=ask("hi"), frequency_penalty=5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=ask("hi"))
    with pytest.raises(openai.BadRequestError, match="context|too long|tokens"):
        client.chat.completions.create(model=MODEL, messages=ask("word " * 9000), max_tokens=4)
    bad_key = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert [m.model_extra["precision"] for m in client.models.list()] == [QUANTIZED]  # what runs, as the banner says


def test_async_client_concurrent_and_n(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
        rs = await asyncio.gather(*(aclient.chat.completions.create(
            model=MODEL, messages=ask(f"Count to {i}."), max_tokens=8, temperature=0) for i in (2, 3, 4)))
        many = await aclient.chat.completions.create(model=MODEL, messages=ask("Say hi."), max_tokens=6, n=2,
                                                     temperature=0.8, seed=7)
        await aclient.close()
        return rs, many

    rs, many = asyncio.run(main())
    assert all(r.choices[0].message.content for r in rs)
    assert [c.index for c in many.choices] == [0, 1]


def test_served_run_matches_a_local_run(server, tmp_path):
    """The same program, greedy, served and under `agentrt run`: the same output."""
    import urllib.request

    url, _ = server
    req = urllib.request.Request(f"{url}/v1/programs/calc/runs", method="POST",
                                 data=json.dumps({"inputs": {"question": "What is 4 + 5?"}}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        run_id = json.loads(r.read())["run_id"]
    waited = urllib.request.Request(f"{url}/v1/runs/{run_id}/wait?timeout=120", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(waited) as r:
        served = json.loads(r.read())
    assert served["status"] == "done", served
    local = subprocess.run([sys.executable, "-m", "agentrt.cli", "run", str(PROGRAM), "--no-live",
                            "--input", "question=What is 4 + 5?", "--trace", str(tmp_path / "local.jsonl")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    from agentrt.runtime.trace import read_trace

    [program] = [r for r in read_trace(tmp_path / "local.jsonl") if r["type"] == "program"]
    assert program["output"] == served["output"]


def test_submit_cli_and_inspect_url(server):
    url, _ = server
    env = {**os.environ, "AGENTRT_API_KEY": KEY, "COLUMNS": "120"}
    sub = subprocess.run([sys.executable, "-m", "agentrt.cli", "submit", "calc", "--server", url,
                          "--input", "question=What is 1 + 2?"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    for line in ("▶ plan", "✔ plan", "✔ sum", "✔ answer"):
        assert line in sub.stdout, sub.stdout
    run_url = next(w for w in sub.stdout.split() if "/v1/runs/" in w and not w.endswith("/trace")).rstrip(")")
    inspected = subprocess.run([sys.executable, "-m", "agentrt.cli", "inspect", run_url, "--json"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0, inspected.stderr
    [run] = json.loads(inspected.stdout)["runs"]
    assert run["status"] == "done" and run["run_id"] == run_url.rsplit("/", 1)[1]
    bad = subprocess.run([sys.executable, "-m", "agentrt.cli", "submit", "calc", "--server", url, "--input", "nope=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not an input of program 'calc'" in bad.stderr


@pytest.mark.parametrize("example", ["trip_planner", "research", "sql_agent"])
def test_each_example_served_with_its_events(server, example):
    """Each example runs to the end over HTTP with its events streamed, the stream dropped after a
    few events and resumed (Last-Event-ID) without gaps or duplicates."""
    import aiohttp

    url, _ = server

    async def main():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            programs = (await (await http.get(f"{url}/v1/programs")).json())["data"]
            assert {p["name"] for p in programs} >= {"calc", "trip_planner", "research", "sql_agent"}
            r = await http.post(f"{url}/v1/programs/{example}/runs", json={})
            assert r.status == 201, await r.text()
            run_id = (await r.json())["run_id"]
            seen: list[tuple[int, str]] = []
            async with http.get(f"{url}/v1/runs/{run_id}/events") as stream:  # read a few, then drop it
                async for raw in stream.content:
                    line = raw.decode().strip()
                    if line.startswith("id: "):
                        seen.append((int(line[4:]), ""))
                    elif line.startswith("event: "):
                        seen[-1] = (seen[-1][0], line[7:])
                    if len(seen) >= 5 and seen[-1][1]:
                        break
            async with http.get(f"{url}/v1/runs/{run_id}/events", headers={"Last-Event-ID": str(seen[-1][0])}) as stream:
                text = await stream.text()
            for block in text.strip().split("\n\n"):
                fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
                if "id" in fields:
                    seen.append((int(fields["id"]), fields["event"]))
            info = await (await http.get(f"{url}/v1/runs/{run_id}")).json()
            return seen, info

    seen, info = asyncio.run(main())
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert seen[-1][1] == "run_finished" and info["status"] == "done", info["error"]
    assert info["summary"]["runs"][0]["nodes"]


def test_penalties_and_logit_bias_steer_the_output(client):
    from agentrt.engine.loading.registry import resolve_model
    from agentrt.engine.chat.tokenizer import Tokenizer

    msgs = ask("Count from 1 to 20.")  # a repetitive answer, so the penalties have tokens to act on
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    penalized = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                               presence_penalty=2.0, frequency_penalty=1.0)
    assert penalized.choices[0].message.content != plain.choices[0].message.content
    tok = Tokenizer.from_dir(resolve_model(MODEL, progress=False).path)
    first = tok.encode(plain.choices[0].message.content)[0]
    biased = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                            logit_bias={str(first): -100})
    assert tok.encode(biased.choices[0].message.content)[0] != first
    at_least = client.chat.completions.create(model=MODEL, messages=ask("Say OK."), max_tokens=12, temperature=0,
                                              extra_body={"min_tokens": 10})
    assert at_least.usage.completion_tokens >= 10


def test_metrics_of_the_real_engine(server, client):
    import urllib.request

    for _ in range(2):  # the second one's prompt comes from the prefix cache
        client.chat.completions.create(model=MODEL, messages=ask("Give JSON for a cat."), max_tokens=16,
                                       temperature=0, response_format={"type": "json_object"})
    req = urllib.request.Request(f"{server[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    # every sample names the replica (HOST:PORT), the engine's the engine (the server's own here)
    labels = f'engine="in-process",replica="{socket.gethostname()}:{server[0].rsplit(":", 1)[1]}"'  # in name order
    assert values[f'agentrt_kv_blocks{{{labels},state="total"}}'] > 0
    assert values[f"agentrt_engine_steps_total{{{labels}}}"] > 0 and values[f"agentrt_output_tokens_total{{{labels}}}"] > 0
    assert (values[f"agentrt_prompt_tokens_total{{{labels}}}"]
            >= values[f"agentrt_prefix_cache_hit_tokens_total{{{labels}}}"] > 0)
    assert any(k.startswith("agentrt_spec_drafted_tokens_total{drafter=") and k.endswith(f",{labels}}}") for k in values)
    assert all("replica=" in k for k in values if k.startswith("agentrt_"))


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Name a fruit."), max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content[:3])
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3 and bytes(c.bytes).decode("utf-8", "replace") == c.token
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely one
    plain = client.chat.completions.create(model=MODEL, messages=ask("Name a fruit."), max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = list(client.chat.completions.create(model=MODEL, messages=ask("Name a fruit."), max_tokens=8,
                                                   temperature=0, logprobs=True, top_logprobs=3, stream=True))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(c.token, round(c.logprob, 4)) for c in content]
