"""The runtime side of MQTT tools: sends calls to worker groups and waits for their replies.

Every call ends in a value or an error, never silence:
- a worker acknowledges a call it has not answered within a few ms of receipt; if the
  acknowledging worker goes offline (its last will), the call fails with WorkerLostError;
- a call neither acknowledged nor answered within accept_timeout_s (a worker that died on
  receipt, or hangs) fails with WorkerLostError;
- if the broker connection drops, every call in flight fails with BrokerConnectionError.
These two errors are `lost`: the registry re-dispatches them when the tool is idempotent and
returns them otherwise (the message says which). The connection is re-established with
exponential backoff; calls made meanwhile wait for it (within their timeout).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiomqtt

from agentrt.jsonutil import JsonDepthError
from agentrt.tools.errors import (
    BrokerConnectionError,
    NoWorkerError,
    PayloadTooLargeError,
    ToolCallError,
    ToolOutputError,
    WorkerLostError,
    error_from_dict,
)
from agentrt.tools.mqtt_protocol import (
    ClientSignals,
    MqttConfig,
    decode,
    decode_object,
    encode,
    message_property,
    refused_for_good,
    request_properties,
)
from agentrt.tools.registry import RemoteValue
from agentrt.tools.tool import Tool

log = logging.getLogger("agentrt.tools.mqtt")


@dataclass(frozen=True)
class WorkerInfo:
    """An online worker, as its retained availability message describes it."""

    worker: str
    tools: tuple[str, ...]
    declarations: tuple[dict[str, Any], ...]
    pid: int | None = None
    host: str | None = None
    concurrency: int | None = None
    since: float | None = None


@dataclass(eq=False)
class _Call:
    call_id: str
    tool: Tool
    future: asyncio.Future = field(repr=False)
    worker: str | None = None
    accept_timer: asyncio.TimerHandle | None = None


def _policy(tool: Tool) -> str:
    if tool.idempotent:
        return "the tool is idempotent, so the call is re-dispatched"
    return f"not re-dispatched because tool '{tool.name}' is not declared idempotent"


class MqttDispatcher(ClientSignals):
    """An executor (registry.add_executor("mqtt", dispatcher)) that runs tools on MQTT workers.

    worker_wait_s: how long a call waits for a worker serving its tool to be online.
    accept_timeout_s: how long a sent call may go unacknowledged before it counts as lost."""

    def __init__(
        self,
        config: MqttConfig,
        *,
        client_id: str | None = None,
        worker_wait_s: float = 5.0,
        accept_timeout_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        reconnect_min_s: float = 0.05,
        reconnect_max_s: float = 2.0,
        max_payload_bytes: int | None = 1 << 20,
    ) -> None:
        self.config = config
        self.client_id = client_id or f"agentrt-rt-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.worker_wait_s = worker_wait_s
        self.accept_timeout_s = accept_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.max_payload_bytes = max_payload_bytes
        self.reply_topic = config.reply_topic(self.client_id)
        self._client: aiomqtt.Client | None = None
        self._calls: dict[str, _Call] = {}
        self._workers: dict[str, WorkerInfo] = {}
        self._offline: dict[str, float] = {}  # worker -> when it was seen going offline
        self._last_error: Exception | None = None
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._closing = False
        self.reconnects = 0  # successful reconnections after the first connection
        self._ever_connected = False
        self._gave_up = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> MqttDispatcher:
        """Connect (raises BrokerConnectionError if the broker cannot be reached in time)."""
        if self._task is not None:
            return self
        self._changed = asyncio.Condition()
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=f"mqtt-dispatcher {self.client_id}")
        try:
            await asyncio.wait_for(self._wait(lambda: self.connected or self._gave_up), self.connect_timeout_s)
        except TimeoutError:
            pass
        if not self.connected:
            await self.aclose()
            raise BrokerConnectionError(
                "*", f"cannot connect to the MQTT broker at {self.config.url}"
                + (f": {self._last_error}" if self._last_error else f" within {self.connect_timeout_s:g}s")
            )
        return self

    async def aclose(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for call in list(self._calls.values()):
            self._fail(call, BrokerConnectionError(call.tool.name, f"tool '{call.tool.name}': the MQTT dispatcher was closed"))

    async def __aenter__(self) -> MqttDispatcher:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def connected(self) -> bool:
        return self._client is not None

    # -- the connection -------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = self.reconnect_min_s
        while not self._closing:
            try:
                async with self.config.client(self.client_id) as client:
                    await client.subscribe(self.reply_topic, qos=1)
                    await client.subscribe(self.config.status_filter(), qos=1)
                    self._client = client
                    self.reconnects += self._ever_connected
                    self._ever_connected = True
                    backoff = self.reconnect_min_s
                    await self._notify()
                    async for message in client.messages:
                        try:
                            await self._on_message(message)
                        except Exception:  # noqa: BLE001 - one odd message must not stop the dispatcher
                            log.exception("dropped a message on %s", message.topic)
            except aiomqtt.MqttError as e:
                self._last_error = e
                if self._client is not None:
                    log.warning("lost the MQTT broker at %s: %s; reconnecting", self.config.url, e)
                elif refused_for_good(e) and not self._ever_connected:
                    self._gave_up = True  # e.g. bad credentials: start() reports it now, not at its timeout
                    await self._notify()
                    return
            finally:
                was_connected = self._client is not None
                self._client = None
                if was_connected:
                    self._connection_lost()
            if self._closing:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_s)

    def _connection_lost(self) -> None:
        self._workers.clear()  # the broker re-sends the retained availability on reconnect
        for call in list(self._calls.values()):
            self._fail(call, BrokerConnectionError(
                call.tool.name,
                f"tool '{call.tool.name}': the connection to the MQTT broker at {self.config.url} was lost "
                f"with call {call.call_id} in flight; {_policy(call.tool)}",
            ))
        self._spawn(self._notify())

    # -- incoming -----------------------------------------------------------------------------
    async def _on_message(self, message: aiomqtt.Message) -> None:
        topic = str(message.topic)
        if topic == self.reply_topic:
            self._on_reply(message)
        elif topic.startswith(self.config.status_topic("")):
            await self._on_status(topic.rsplit("/", 1)[-1], decode(message.payload))

    def _on_reply(self, message: aiomqtt.Message) -> None:
        correlation = message_property(message, "CorrelationData")
        call = self._calls.get(correlation.decode(errors="replace")) if correlation else None
        if call is None or call.future.done():
            return  # a late reply for a call already decided (or a stranger's message)
        try:
            body = decode_object(message.payload)
        except JsonDepthError as e:  # the worker's answer cannot be read: the call has no other
            self._fail(call, ToolOutputError(call.tool.name, f"tool '{call.tool.name}': the reply to call "
                                                             f"{call.call_id} is {e}"))
            return
        except ValueError:
            return  # not a reply of ours: the call waits for its worker's
        worker = str(body.get("worker", "?"))
        if body.get("kind") == "ack":
            call.worker = worker
            if call.accept_timer is not None:
                call.accept_timer.cancel()
            if worker in self._offline:  # it went offline before its ack reached us
                self._worker_lost(call, worker)
            return
        if body.get("ok"):
            call.future.set_result(RemoteValue(body.get("value"), worker, body.get("started"), body.get("finished")))
        else:
            err = error_from_dict(call.tool.name, body.get("error") or {})
            err.worker = worker  # type: ignore[attr-defined]
            call.future.set_exception(err)

    async def _on_status(self, worker: str, body: dict[str, Any] | None) -> None:
        if body is not None and body.get("status") == "online":
            self._offline.pop(worker, None)
            decls = tuple(d for d in body.get("tools", []) if isinstance(d, dict) and "name" in d)
            self._workers[worker] = WorkerInfo(
                worker=worker, tools=tuple(d["name"] for d in decls), declarations=decls, pid=body.get("pid"),
                host=body.get("host"), concurrency=body.get("concurrency"), since=body.get("since"),
            )
        else:  # the last will, or a clean shutdown emptying the retained message
            self._workers.pop(worker, None)
            self._offline[worker] = time.time()
            while len(self._offline) > 10_000:  # remember recent departures only
                del self._offline[next(iter(self._offline))]
            for call in list(self._calls.values()):
                if call.worker == worker:
                    self._worker_lost(call, worker)
        await self._notify()

    def _worker_lost(self, call: _Call, worker: str) -> None:
        err = WorkerLostError(
            call.tool.name,
            f"worker '{worker}' went offline while running tool '{call.tool.name}' (call {call.call_id}); {_policy(call.tool)}",
        )
        err.worker = worker  # type: ignore[attr-defined]
        self._fail(call, err)

    def _fail(self, call: _Call, err: ToolCallError) -> None:
        if not call.future.done():
            call.future.set_exception(err)

    def _not_accepted(self, call: _Call) -> None:
        if call.worker is None:
            self._fail(call, WorkerLostError(
                call.tool.name,
                f"no worker acknowledged call {call.call_id} to tool '{call.tool.name}' within "
                f"{self.accept_timeout_s:g}s (a worker died on receipt or hangs); {_policy(call.tool)}",
            ))

    # -- workers ------------------------------------------------------------------------------
    def in_flight(self) -> dict[str, tuple[str, str | None]]:
        """call id -> (tool, worker that acknowledged it, or None yet)."""
        return {c.call_id: (c.tool.name, c.worker) for c in self._calls.values()}

    def workers(self) -> dict[str, WorkerInfo]:
        """The online workers of this group, by id."""
        return dict(self._workers)

    def remote_tools(self) -> list[Tool]:
        """The tools the online workers serve, as declarations bound to executor "mqtt"."""
        seen: dict[str, Tool] = {}
        for info in self._workers.values():
            for decl in info.declarations:
                if decl["name"] not in seen:
                    seen[decl["name"]] = Tool.from_declaration(decl, executor="mqtt")
        return list(seen.values())

    async def wait_for_workers(self, count: int = 1, *, tool: str | None = None, timeout: float = 10.0) -> list[WorkerInfo]:
        """Wait until `count` online workers (serving `tool`, if given) are known."""

        def ready() -> list[WorkerInfo]:
            return [w for w in self._workers.values() if tool is None or tool in w.tools]

        try:
            await asyncio.wait_for(self._wait(lambda: len(ready()) >= count), timeout)
        except TimeoutError:
            raise NoWorkerError(
                tool or "*", f"only {len(ready())} of {count} MQTT workers{f' serving {tool!r}' if tool else ''} "
                f"came online at {self.config.url} (group '{self.config.group}') within {timeout:g}s"
            ) from None
        return ready()

    # -- calls ---------------------------------------------------------------------------------
    async def execute(self, tool: Tool, args: dict[str, Any], *, timeout: float | None = None) -> RemoteValue:
        if self._task is None:
            raise BrokerConnectionError(tool.name, f"tool '{tool.name}': the MQTT dispatcher is not started")
        call_id = uuid.uuid4().hex
        payload = encode({"call_id": call_id, "tool": tool.name, "args": args, "timeout_s": timeout, "sent": time.time()})
        if self.max_payload_bytes is not None and len(payload) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                tool.name, f"tool '{tool.name}': the request is {len(payload)} bytes, over the MQTT limit of "
                f"{self.max_payload_bytes} bytes"
            )
        await self._wait_for_serving_worker(tool)
        client = self._client
        assert client is not None  # nothing awaited since the wait saw it connected
        call = _Call(call_id, tool, asyncio.get_running_loop().create_future())
        self._calls[call_id] = call
        try:
            # Sent from a task so that a broker dropping mid-publish fails the future at once
            # (_connection_lost) instead of leaving this call waiting on the publish.
            self._spawn(self._publish(client, call, payload, timeout))
            return await call.future
        except asyncio.CancelledError:
            if call.worker is not None and self._client is not None:
                self._spawn(self._publish_cancel(call.worker, call_id))
            raise
        finally:
            if call.accept_timer is not None:
                call.accept_timer.cancel()
            del self._calls[call_id]

    async def _wait_for_serving_worker(self, tool: Tool) -> None:
        def serving() -> bool:
            return self.connected and any(tool.name in w.tools for w in self._workers.values())

        if serving():
            return
        try:
            await asyncio.wait_for(self._wait(serving), self.worker_wait_s)
        except TimeoutError:
            where = f"at {self.config.url} (group '{self.config.group}')"
            if not self.connected:
                raise BrokerConnectionError(
                    tool.name, f"tool '{tool.name}': not connected to the MQTT broker {where} "
                    f"after waiting {self.worker_wait_s:g}s", retryable=True, lost=False,  # never sent
                ) from None
            online = ", ".join(sorted(self._workers)) or "none"
            raise NoWorkerError(
                tool.name, f"tool '{tool.name}': no MQTT worker serving it is online {where} "
                f"(online workers: {online})"
            ) from None

    async def _publish(self, client: aiomqtt.Client, call: _Call, payload: bytes, timeout: float | None) -> None:
        call.accept_timer = asyncio.get_running_loop().call_later(self.accept_timeout_s, self._not_accepted, call)
        try:
            props = request_properties(self.reply_topic, call.call_id, timeout)
            await client.publish(self.config.call_topic(call.tool.name), payload, qos=1, properties=props)
        except aiomqtt.MqttError as e:
            self._fail(call, BrokerConnectionError(
                call.tool.name, f"tool '{call.tool.name}': sending call {call.call_id} to the MQTT broker at "
                f"{self.config.url} failed ({e}); {_policy(call.tool)}",
            ))

    async def _publish_cancel(self, worker: str, call_id: str) -> None:
        client = self._client
        if client is None:
            return
        try:
            await client.publish(self.config.cancel_topic(worker), encode({"call_id": call_id}), qos=1)
        except aiomqtt.MqttError as e:
            log.info("could not tell worker %s to cancel call %s: %s", worker, call_id, e)
