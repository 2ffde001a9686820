"""An MQTT worker against callers it must not trust, on a real mosquitto and a real worker
process: raw requests published straight to its call topics (no dispatcher-side checks)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.jsonutil import MAX_JSON_DEPTH
from agentrt.tools.mqtt_client import MqttDispatcher
from agentrt.tools import ToolRegistry
from agentrt.tools.mqtt_protocol import decode, encode, message_property, reply_properties, request_properties
from agentrt.tools.tool import tool as make_tool


class RawCaller:
    """Publishes hand-made requests and waits for the worker's final reply to each."""

    def __init__(self, client, config):
        self.client, self.config = client, config
        self.reply_topic = config.reply_topic(f"raw-{uuid.uuid4().hex[:6]}")

    async def ask(self, topic_tool: str, payload: bytes, timeout: float = 15.0) -> tuple[dict, float]:
        cid = uuid.uuid4().hex
        t0 = time.monotonic()
        await self.client.publish(self.config.call_topic(topic_tool), payload, qos=1,
                                  properties=request_properties(self.reply_topic, cid, None))
        async with asyncio.timeout(timeout):
            async for m in self.client.messages:
                body = decode(m.payload) or {}
                if message_property(m, "CorrelationData") == cid.encode() and body.get("kind") == "result":
                    return body, time.monotonic() - t0
        raise AssertionError("no reply")


@pytest.fixture
async def raw(broker, start_workers):
    start_workers(1)
    async with MqttDispatcher(broker.config(), worker_wait_s=10.0) as d:
        await d.wait_for_workers(1)
    config = broker.config()
    async with config.client(f"raw-{uuid.uuid4().hex[:6]}") as client:
        caller = RawCaller(client, config)
        await client.subscribe(caller.reply_topic, qos=1)
        yield caller


def call(tool: str, args, **extra) -> bytes:
    return json.dumps({"call_id": uuid.uuid4().hex, "tool": tool, "args": args, **extra}).encode()


@pytest.mark.parametrize("timeout_s", [None, 1e9, "NaN", -1, 0, "5"])
async def test_the_declared_timeout_holds_whatever_the_caller_asks(raw, timeout_s):
    """`limited` declares 1 s; a 3 s call fails at ~1 s however the caller's timeout_s is
    missing, huge, NaN, negative, zero or not a number (NaN travels as JSON's NaN literal)."""
    extra = {} if timeout_s is None else {"timeout_s": float(timeout_s) if timeout_s == "NaN" else timeout_s}
    body, elapsed = await raw.ask("limited", call("limited", {"seconds": 3}, **extra))
    assert not body["ok"] and body["error"]["kind"] == "timeout", body
    assert 0.8 < elapsed < 2.8


async def test_a_caller_may_ask_for_less(raw):
    body, elapsed = await raw.ask("limited", call("limited", {"seconds": 3}, timeout_s=0.3))
    assert body["error"]["kind"] == "timeout" and elapsed < 0.9
    ok, _ = await raw.ask("limited", call("limited", {"seconds": 0.05}, timeout_s=0.5))
    assert ok["ok"] and ok["value"] == "done"


async def test_a_body_without_a_tool_runs_the_topic_s_tool(raw):
    body, _ = await raw.ask("echo", json.dumps({"args": {"x": 3}}).encode())
    assert body["ok"] and body["value"] == {"x": 3, "text": ""}


async def test_topic_and_body_must_agree(raw, tmp_path):
    marker = tmp_path / "ran"
    body, _ = await raw.ask("echo", call("record", {"text": "x", "marker": str(marker)}))
    assert not body["ok"] and "'record'" in body["error"]["message"] and "'echo'" in body["error"]["message"]
    assert not marker.exists()


@pytest.mark.parametrize("depth", [200, 5000])
async def test_deeply_nested_arguments_get_an_error_reply(raw, depth):
    """200 levels in the arguments, 5000 in the body (past Python's recursive JSON parser): both
    refused by the JSON depth limit, which the reply names."""
    args = "[" * depth + "]" * depth
    payload = ('{"call_id": "c", "tool": "echo", "args": {"x": 1, "text": ' + args + "}}").encode()
    body, _ = await raw.ask("echo", payload)
    assert not body["ok"] and body["error"]["kind"] == "invalid_arguments"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in body["error"]["message"]
    ok, _ = await raw.ask("echo", call("echo", {"x": 2}))  # the worker serves on
    assert ok["ok"] and ok["value"] == {"x": 2, "text": ""}


async def test_a_reply_nested_past_the_limit_fails_the_call_and_the_dispatcher_serves_on(broker):
    """A worker (hand-made here) answers once with a reply 5000 levels deep, then with a good one:
    the first call fails naming the depth limit, the second gets its value."""
    config = broker.config()
    depth_tool = make_tool(lambda: None, name="deep", description="answers with a deep value")

    async def hostile_worker(client) -> None:
        await client.subscribe(config.call_topic("deep"), qos=1)
        status = {"worker": "hostile", "status": "online", "tools": [depth_tool.declaration()]}
        await client.publish(config.status_topic("hostile"), encode(status), qos=1, retain=True)
        replies = [b'{"kind": "result", "ok": true, "value": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                   encode({"kind": "result", "worker": "hostile", "ok": True, "value": [1]})]
        async for m in client.messages:
            await client.publish(message_property(m, "ResponseTopic"), replies.pop(0), qos=1,
                                 properties=reply_properties(message_property(m, "CorrelationData")))
            if not replies:
                return

    async with config.client("hostile") as client:
        worker = asyncio.create_task(hostile_worker(client))
        async with MqttDispatcher(config, worker_wait_s=10.0) as d:
            await d.wait_for_workers(1, tool="deep")
            registry = ToolRegistry()
            registry.add_executor("mqtt", d)
            registry.register(d.remote_tools()[0])
            failed = await registry.call("deep", {}, timeout_s=10)
            assert failed.error is not None and failed.error.kind == "invalid_output", failed
            assert f"deeper than {MAX_JSON_DEPTH} levels" in failed.error.message
            served = await registry.call("deep", {}, timeout_s=10)
            assert served.ok and served.value == [1], served.error
        await worker
        await client.publish(config.status_topic("hostile"), b"", qos=1, retain=True)


async def test_a_body_that_is_not_a_json_object_gets_an_error_reply(raw):
    for payload in (b"not json", b"[1, 2]", b"\xff\xfe"):
        body, _ = await raw.ask("echo", payload)
        assert not body["ok"] and "JSON object" in body["error"]["message"]


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10, 10**12), st.floats(allow_nan=False),
                                     st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                           max_leaves=10)
bodies = st.fixed_dictionaries({}, optional={
    "call_id": st.one_of(st.text(max_size=6), st.integers()), "tool": st.sampled_from(["echo", "boom", "limited", "nope", 5]),
    "args": st.one_of(json_values, st.fixed_dictionaries({"x": json_values}, optional={"text": json_values}),
                      st.fixed_dictionaries({"seconds": st.floats(0, 0.3)})),
    "timeout_s": st.one_of(st.none(), st.floats(allow_nan=False), st.text(max_size=3), st.integers(-5, 10**9))})
payloads = st.one_of(st.binary(max_size=40), bodies.map(lambda b: json.dumps(b).encode()))


@pytest.fixture
def worker_config(broker, start_workers):
    start_workers(1)

    async def up():
        async with MqttDispatcher(broker.config(), worker_wait_s=10.0) as d:
            await d.wait_for_workers(1)

    asyncio.run(up())
    return broker.config()


async def _fuzz_once(config, topic: str, payload: bytes) -> None:
    async with config.client(f"fuzz-{uuid.uuid4().hex[:6]}") as client:
        caller = RawCaller(client, config)
        await client.subscribe(caller.reply_topic, qos=1)
        body, elapsed = await caller.ask(topic, payload, timeout=10)
        assert body["ok"] or {"kind", "message"} <= set(body["error"]), body
        assert elapsed < 2.5  # nothing outlives `limited`'s declared 1 s by much
        ok, _ = await caller.ask("echo", call("echo", {"x": 1}), timeout=10)  # the worker serves on
        assert ok["ok"], ok


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(topic=st.sampled_from(["echo", "boom", "limited"]), payload=payloads)
def test_fuzzed_payloads_get_a_reply_and_the_worker_serves_on(worker_config, topic, payload):
    asyncio.run(_fuzz_once(worker_config, topic, payload))
