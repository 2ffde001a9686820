"""A tool worker: serves a set of tools to MQTT dispatchers, one call at a time per slot.

It announces itself with a retained availability message (its tool declarations) and leaves a
last will that marks it offline if it dies; it takes calls from shared subscriptions, so the
broker spreads a group's calls over all its workers, on any number of machines. A call still
unanswered ack_delay_s after receipt is acknowledged (the dispatcher then knows whom to blame if
this worker dies); fast calls skip the ack and just answer, which saves a message each way.
Calls run through a local ToolRegistry: arguments validated, timeout applied, output checked.

The worker trusts no caller: a call runs under the tool's declared timeout, or a shorter one the
caller asks for (a missing, non-finite or non-positive request changes nothing); a body naming
another tool than its topic, a body that is not a JSON object or nests deeper than the JSON depth
limit (agentrt/jsonutil.py), or arguments nested deeper than max_args_depth get an error reply
(when the request carries a response topic), as does any failure while serving a call.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from typing import Any, Iterable

import aiomqtt

from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, json_depth
from agentrt.tools.errors import BrokerConnectionError, ToolArgumentsError, ToolCallError, ToolDefinitionError
from agentrt.tools.inprocess import InProcessExecutor
from agentrt.tools.mqtt_protocol import (
    MqttConfig,
    check_segment,
    decode,
    decode_object,
    encode,
    message_property,
    refused_for_good,
    reply_properties,
    will_properties,
)
from agentrt.tools.registry import ToolRegistry
from agentrt.tools.tool import Tool

log = logging.getLogger("agentrt.tools.worker")


class MqttWorker:
    """concurrency: calls run at once (async tools as tasks, sync tools on that many threads);
    more calls wait, acknowledged, in arrival order. ack_delay_s: see the module docstring."""

    def __init__(
        self,
        tools: Iterable[Tool],
        config: MqttConfig,
        *,
        worker_id: str | None = None,
        concurrency: int = 8,
        max_payload_bytes: int | None = 1 << 20,
        reconnect_min_s: float = 0.05,
        reconnect_max_s: float = 2.0,
        drain_timeout_s: float = 30.0,
        ack_delay_s: float = 0.005,
        max_args_depth: int = MAX_JSON_DEPTH,
    ) -> None:
        if concurrency < 1:
            raise ToolDefinitionError(f"worker concurrency must be >= 1, got {concurrency}")
        self.config = config
        self.worker_id = check_segment("worker id", worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.concurrency = concurrency
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.drain_timeout_s = drain_timeout_s
        self.ack_delay_s = ack_delay_s
        self.max_args_depth = max_args_depth
        self.registry = ToolRegistry(
            executors={"inprocess": InProcessExecutor(max_threads=concurrency)},
            max_args_bytes=max_payload_bytes, max_result_bytes=max_payload_bytes,
        )
        for t in tools:
            if t.fn is None:
                raise ToolDefinitionError(f"tool '{t.name}' has no Python function, so a worker cannot serve it")
            self.registry.register(t.bind("inprocess"))
        if not len(self.registry):
            raise ToolDefinitionError("a worker needs at least one tool")
        self._client: aiomqtt.Client | None = None
        self._slots: asyncio.Semaphore | None = None
        self._running: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self.calls_served = 0
        self._ever_connected = False

    def _status(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id, "status": "online", "tools": [t.declaration() for t in self.registry],
            "pid": os.getpid(), "host": socket.gethostname(), "concurrency": self.concurrency, "since": time.time(),
        }

    def _will(self) -> aiomqtt.Will:
        return aiomqtt.Will(
            self.config.status_topic(self.worker_id), encode({"worker": self.worker_id, "status": "offline"}),
            qos=1, retain=True, properties=will_properties(),
        )

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set, reconnecting with backoff whenever the broker goes away;
        then stop taking calls, finish the running ones and leave cleanly."""
        stop = stop or asyncio.Event()
        self._slots = asyncio.Semaphore(self.concurrency)
        backoff = self.reconnect_min_s
        while not stop.is_set():
            try:
                async with self.config.client(self.worker_id, will=self._will()) as client:
                    self._client = client
                    self._ever_connected = True
                    await self._announce(client)
                    backoff = self.reconnect_min_s
                    if await self._serve_until(client, stop):
                        await self._leave(client)
                        return
            except aiomqtt.MqttError as e:
                if refused_for_good(e) and not self._ever_connected:
                    raise BrokerConnectionError("*", f"the MQTT broker at {self.config.url} refused worker "
                                                     f"{self.worker_id}: {e}") from e
                log.warning("worker %s: MQTT broker %s unavailable (%s); retrying in %.2fs",
                            self.worker_id, self.config.url, e, backoff)
            finally:
                self._client = None
            try:
                await asyncio.wait_for(stop.wait(), backoff)
            except TimeoutError:
                pass
            backoff = min(backoff * 2, self.reconnect_max_s)
        await self._drain()

    async def _announce(self, client: aiomqtt.Client) -> None:
        # Subscriptions first, so a dispatcher that hears of this worker can reach it at once.
        # Calls arriving meanwhile wait in the client's queue until _read starts, so the
        # availability message goes out before any acknowledgement: the dispatcher always
        # hears of this worker (incarnation) before it sees one of its acks.
        await client.subscribe(self.config.cancel_topic(self.worker_id), qos=1)
        for name in self.registry.names():
            await client.subscribe(self.config.shared_call_filter(name), qos=1)
        await client.publish(self.config.status_topic(self.worker_id), encode(self._status()), qos=1, retain=True)
        log.info("worker %s serving %s at %s (group %s, concurrency %d)", self.worker_id,
                 ", ".join(self.registry.names()), self.config.url, self.config.group, self.concurrency)

    async def _serve_until(self, client: aiomqtt.Client, stop: asyncio.Event) -> bool:
        """True when stopped; raises MqttError when the connection drops."""
        reader = asyncio.create_task(self._read(client))
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not reader.done():
                reader.cancel()
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()  # type: ignore[misc]
        return stop.is_set()

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            self._on_message(client, message)

    def _on_message(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        try:
            if str(message.topic) == self.config.cancel_topic(self.worker_id):
                body = decode(message.payload) or {}
                task = self._running.get(str(body.get("call_id")))
                if task is not None:
                    task.cancel()
            else:
                self._on_request(client, message)
        except Exception:  # noqa: BLE001 - one odd message must not stop the worker
            log.exception("worker %s: dropped a message on %s", self.worker_id, message.topic)

    def _on_request(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        reply_to = message_property(message, "ResponseTopic")
        correlation = message_property(message, "CorrelationData")
        if not reply_to:
            log.warning("worker %s: dropped a request on %s without a response topic", self.worker_id, message.topic)
            return
        topic_tool = str(message.topic).rsplit("/", 1)[-1]
        try:
            body: dict[str, Any] | None = decode_object(message.payload)
        except JsonDepthError as e:
            body, problem = None, f"the request body is {e}"
        except ValueError as e:
            body, problem = None, f"the request body is not a JSON object ({e})"
        else:
            problem = self._refuse(topic_tool, body)
        if problem is not None:
            log.warning("worker %s: refused a request on %s: %s", self.worker_id, message.topic, problem)
            self._spawn(self._reply(client, reply_to, correlation, self._error_reply(
                ToolArgumentsError(topic_tool, f"tool '{topic_tool}': {problem}"))))
            return
        assert body is not None
        call_id = str(body.get("call_id") or (correlation or b"").decode(errors="replace") or uuid.uuid4().hex)
        ack = asyncio.get_running_loop().call_later(self.ack_delay_s, self._send_ack, client, reply_to, correlation)
        task = asyncio.create_task(self._serve(reply_to, correlation, call_id, topic_tool, body, ack))
        self._running[call_id] = task
        task.add_done_callback(lambda _t: self._running.pop(call_id, None))

    def _refuse(self, topic_tool: str, body: dict[str, Any]) -> str | None:
        """Why a request cannot be served, or None."""
        if str(body.get("tool", topic_tool)) != topic_tool:
            return f"the body names tool '{body.get('tool')}' but was sent on the topic of '{topic_tool}'"
        if json_depth(body.get("args"), self.max_args_depth) > self.max_args_depth:
            return f"arguments nested deeper than {self.max_args_depth} levels"
        return None

    def _error_reply(self, error: ToolCallError) -> dict[str, Any]:
        return {"kind": "result", "worker": self.worker_id, "ok": False, "error": error.to_dict()}

    def _timeout(self, name: str, requested: Any) -> float | None:
        """The tool's declared timeout, or the caller's if it is shorter (and a usable number)."""
        declared = self.registry.get(name).timeout_s if name in self.registry else None
        if isinstance(requested, bool) or not isinstance(requested, (int, float)):
            return declared
        if not (math.isfinite(requested) and requested > 0):
            return declared
        return float(requested) if declared is None else min(declared, float(requested))

    def _send_ack(self, client: aiomqtt.Client, reply_to: str, correlation: bytes | None) -> None:
        self._spawn(self._reply(client, reply_to, correlation, {"kind": "ack", "worker": self.worker_id}))

    async def _serve(self, reply_to: str, correlation: bytes | None, call_id: str, name: str, body: dict[str, Any],
                     ack: asyncio.TimerHandle) -> None:
        """name: the tool of the call's topic (the body agrees, or names none)."""
        assert self._slots is not None
        try:
            async with self._slots:
                result = await self.registry.call(name, body.get("args"), call_id=call_id, retries=0,
                                                  timeout_s=self._timeout(name, body.get("timeout_s")))
        except asyncio.CancelledError:
            ack.cancel()
            log.info("worker %s: call %s to %s cancelled by its caller", self.worker_id, call_id, name)
            return
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the caller hears of it
            ack.cancel()
            log.exception("worker %s: call %s to %s failed in the worker", self.worker_id, call_id, name)
            if self._client is not None:
                await self._reply(self._client, reply_to, correlation, self._error_reply(
                    ToolCallError(name, f"tool '{name}': the worker failed serving the call: {type(e).__name__}: {e}")))
            return
        ack.cancel()  # answered in time: the result is the acknowledgement
        self.calls_served += 1
        reply: dict[str, Any] = {"kind": "result", "worker": self.worker_id, "ok": result.ok,
                                 "started": result.started, "finished": result.finished}
        if result.ok:
            reply["value"] = result.value
        else:
            assert result.error is not None
            reply["error"] = result.error.to_dict()
            policy = self.registry.get(name).retry_policy if name in self.registry else None
            if policy is not None and callable(policy.retry_on) and not policy.allows(result.error):
                reply["error"]["retryable"] = False  # a retry_on predicate runs here: it cannot cross
        client = self._client
        if client is None:
            log.warning("worker %s: result of call %s dropped: no broker connection", self.worker_id, call_id)
            return
        await self._reply(client, reply_to, correlation, reply)

    async def _reply(self, client: aiomqtt.Client, topic: str, correlation: bytes | None, body: dict[str, Any]) -> None:
        try:
            await client.publish(topic, encode(body), qos=1, properties=reply_properties(correlation))
        except aiomqtt.MqttError as e:
            log.warning("worker %s: could not send a %s to %s: %s", self.worker_id, body.get("kind"), topic, e)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _leave(self, client: aiomqtt.Client) -> None:
        """Clean shutdown: take no more calls, finish the running ones, clear the availability."""
        log.info("worker %s stopping: finishing %d running call(s)", self.worker_id, len(self._running))
        for name in self.registry.names():
            try:
                await client.unsubscribe(self.config.shared_call_filter(name))
            except aiomqtt.MqttError:
                break
        queued = client.messages  # calls delivered before the unsubscriptions took effect: serve them
        while len(queued):
            self._on_message(client, await queued.__anext__())
        await self._drain()
        try:
            await client.publish(self.config.status_topic(self.worker_id), b"", qos=1, retain=True)
        except aiomqtt.MqttError as e:
            log.warning("worker %s: could not clear its availability message: %s", self.worker_id, e)
        log.info("worker %s stopped after %d calls", self.worker_id, self.calls_served)

    async def _drain(self) -> None:
        running = list(self._running.values())
        if running:
            done, pending = await asyncio.wait(running, timeout=self.drain_timeout_s)
            for task in pending:
                task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=5.0)
        await self.registry.aclose()

