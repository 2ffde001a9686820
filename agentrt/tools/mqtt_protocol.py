"""What the dispatcher and the workers agree on: broker settings, topics, message shapes.

Topics (PREFIX and GROUP from MqttConfig):
  PREFIX/GROUP/call/TOOL            requests; workers subscribe $share/GROUP/PREFIX/GROUP/call/TOOL,
                                    so the broker hands each call to one worker of the group
  PREFIX/GROUP/reply/CLIENT         replies (MQTT 5 response topic + correlation data = call id):
                                    {"kind": "ack"} on receipt, then {"kind": "result"}
  PREFIX/GROUP/workers/WORKER       retained availability: online (with tool declarations), or
                                    offline (the last will); emptied on a clean shutdown
  PREFIX/GROUP/workers/WORKER/cancel  call ids whose caller gave up
All payloads are JSON; every message is QoS 1.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import ssl
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlsplit

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agentrt.jsonutil import parse_json
from agentrt.tools.errors import MqttConfigError

_SEGMENT = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
STATUS_EXPIRY_S = 3600  # an offline notice left by a dead worker disappears after this


@dataclass(frozen=True)
class MqttConfig:
    """Broker address and credentials, plus the topic prefix and the worker group.
    keepalive_s bounds how long a silently vanished peer (machine gone, no TCP reset) stays
    "online": the broker drops it after 1.5 x keepalive and publishes its last will."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_insecure: bool = False
    keepalive_s: int = 10
    prefix: str = "agentrt"
    group: str = "default"

    def __post_init__(self) -> None:
        for what in ("prefix", "group"):
            if not _SEGMENT.match(getattr(self, what)):
                raise MqttConfigError(f"MQTT {what} {getattr(self, what)!r}: use letters, digits, '_', '-', '.'")
        if not 0 < self.port < 65536:
            raise MqttConfigError(f"MQTT port {self.port} is out of range")

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> MqttConfig:
        """mqtt://[USER[:PASSWORD]@]HOST[:PORT] (default port 1883), mqtts://... for TLS (8883)."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parts.hostname:
            raise MqttConfigError(f"broker URL {url!r}: expected mqtt://HOST:PORT or mqtts://HOST:PORT")
        tls = parts.scheme in ("mqtts", "ssl")
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError as e:
            raise MqttConfigError(f"broker URL {url!r}: {e}") from e
        base = cls(
            host=parts.hostname, port=port, tls=tls,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
        )
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return replace(base, **overrides)

    @property
    def url(self) -> str:
        """The broker URL without the password (for messages and logs)."""
        user = f"{self.username}@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"

    # -- topics -------------------------------------------------------------------------------
    def call_topic(self, tool: str) -> str:
        return f"{self.prefix}/{self.group}/call/{tool}"

    def shared_call_filter(self, tool: str) -> str:
        return f"$share/{self.group}/{self.call_topic(tool)}"

    def reply_topic(self, client_id: str) -> str:
        return f"{self.prefix}/{self.group}/reply/{client_id}"

    def status_topic(self, worker: str) -> str:
        return f"{self.prefix}/{self.group}/workers/{worker}"

    def status_filter(self) -> str:
        return f"{self.prefix}/{self.group}/workers/+"

    def cancel_topic(self, worker: str) -> str:
        return f"{self.status_topic(worker)}/cancel"

    # -- clients ------------------------------------------------------------------------------
    def tls_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_insecure:  # skip the host-name check only; the certificate chain is still verified
            ctx.check_hostname = False
        return ctx

    def client(self, identifier: str, *, will: aiomqtt.Will | None = None, timeout_s: float = 10.0) -> aiomqtt.Client:
        client = aiomqtt.Client(
            self.host, self.port, username=self.username, password=self.password, identifier=identifier,
            protocol=aiomqtt.ProtocolVersion.V5, will=will, keepalive=self.keepalive_s, clean_start=True,
            tls_context=self.tls_context(), timeout=timeout_s,
            # Small request/reply messages: Nagle's algorithm would hold them back.
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        )
        client.pending_calls_threshold = 1 << 30  # many calls in flight is normal here, not a warning
        return client


# CONNACK reason codes that retrying cannot fix (MQTT 3: 1, 2, 4, 5; MQTT 5: 0x84-0x87, 0x8C).
_FATAL_CONNACK = {1, 2, 4, 5, 0x84, 0x85, 0x86, 0x87, 0x8C}


def refused_for_good(error: Exception) -> bool:
    """The broker refused the connection for a reason a retry will not fix (credentials, ...)."""
    if not isinstance(error, aiomqtt.MqttCodeError) or type(error).__name__ != "MqttConnectError":
        return False
    rc = getattr(error.rc, "value", error.rc)
    return rc in _FATAL_CONNACK


def check_segment(what: str, value: str) -> str:
    if not _SEGMENT.match(value):
        raise MqttConfigError(f"{what} {value!r}: use 1-128 letters, digits, '_', '-', '.'")
    return value


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def decode_object(data: bytes | bytearray | str | None) -> dict[str, Any]:
    """The JSON object of a payload; ValueError saying why there is none (JsonDepthError when it
    nests past the JSON depth limit)."""
    if not data:
        raise ValueError("the payload is empty")
    value = parse_json(data)
    if not isinstance(value, dict):
        raise ValueError(f"the payload is a JSON {type(value).__name__}, not an object")
    return value


def decode(data: bytes | bytearray | str | None) -> dict[str, Any] | None:
    """A JSON object, or None for an empty, malformed or too deeply nested payload."""
    try:
        return decode_object(data)
    except ValueError:
        return None


def request_properties(reply_topic: str, call_id: str, timeout_s: float | None) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = reply_topic
    props.CorrelationData = call_id.encode()
    if timeout_s is not None:  # a call nobody can answer in time should not run later
        props.MessageExpiryInterval = max(1, math.ceil(timeout_s))
    return props


def reply_properties(correlation: bytes | None) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    if correlation:
        props.CorrelationData = correlation
    return props


def will_properties() -> Properties:
    props = Properties(PacketTypes.WILLMESSAGE)
    props.MessageExpiryInterval = STATUS_EXPIRY_S
    return props


def message_property(message: aiomqtt.Message, name: str) -> Any:
    return getattr(message.properties, name, None) if message.properties is not None else None


class ClientSignals:
    """For an MQTT client object with a `_changed` asyncio.Condition (what it knows changed: the
    connection, the workers online) and a `_background` set of fire-and-forget tasks."""

    _changed: asyncio.Condition | None
    _background: set[asyncio.Task]

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, predicate: Any) -> None:
        assert self._changed is not None
        async with self._changed:
            await self._changed.wait_for(predicate)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
