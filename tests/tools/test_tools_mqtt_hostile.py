"""An MQTT worker against callers it must not trust, on a real mosquitto and a real worker
process: raw requests published straight to its call topics (no dispatcher-side checks)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from agentrt.tools.mqtt_client import MqttDispatcher
from agentrt.tools.mqtt_protocol import decode, message_property, request_properties


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


async def test_topic_and_body_must_agree(raw, tmp_path):
    marker = tmp_path / "ran"
    body, _ = await raw.ask("echo", call("record", {"text": "x", "marker": str(marker)}))
    assert not body["ok"] and "'record'" in body["error"]["message"] and "'echo'" in body["error"]["message"]
    assert not marker.exists()


@pytest.mark.parametrize("depth", [200, 5000])
async def test_deeply_nested_arguments_get_an_error_reply(raw, depth):
    """200 levels: parsed, refused by the depth limit; 5000: past Python's JSON parser."""
    args = "[" * depth + "]" * depth
    payload = ('{"call_id": "c", "tool": "echo", "args": {"x": 1, "text": ' + args + "}}").encode()
    body, _ = await raw.ask("echo", payload)
    assert not body["ok"] and body["error"]["kind"] == "invalid_arguments"
    assert "deeper" in body["error"]["message"] or "JSON object" in body["error"]["message"]
    ok, _ = await raw.ask("echo", call("echo", {"x": 2}))  # the worker serves on
    assert ok["ok"] and ok["value"] == {"x": 2, "text": ""}


async def test_a_body_that_is_not_a_json_object_gets_an_error_reply(raw):
    for payload in (b"not json", b"[1, 2]", b"\xff\xfe"):
        body, _ = await raw.ask("echo", payload)
        assert not body["ok"] and "JSON object" in body["error"]["message"]
