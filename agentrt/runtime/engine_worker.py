"""An engine worker: serves one in-process engine's LLM calls to RemoteEngineBackends over MQTT 5.

It takes calls from the group's shared subscription (the broker spreads those over all workers)
and from its own call topic (callers route there for KV affinity and load), runs each through an
EngineBackend, and streams back to the caller's reply topic: an ack, the text deltas, the
request's engine steps, then the EngineResponse's fields (or an error). Cancel, priority and pin
(KV hold) messages for its calls come on its control topic. Every status_interval_s it publishes
a retained status (running and waiting requests, KV blocks, the hashes of recently cached
conversations); its MQTT 5 last will marks it offline if it dies, so callers retry its calls
elsewhere at once. Each engine step also goes to its steps topic (the callers' engine lanes).
Topics and shapes: remote_protocol.py.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable

import aiomqtt

from agentrt.errors import AgentRTError, RunConfigError
from agentrt.runtime.backend import EngineStep, LLMStepEvent, Usage
from agentrt.runtime.engine_backend import EngineBackend, EngineResponse
from agentrt.runtime.remote_protocol import (LLMTopics, conversation_hash, engine_step_to_dict, request_from_dict,
                                             response_to_dict, step_event_to_dict)
from agentrt.tools.mqtt_protocol import (MqttConfig, decode, encode, message_property, refused_for_good, reply_properties,
                                      will_properties)

log = logging.getLogger("agentrt.engine_worker")

RECENT_CONVERSATIONS = 64  # conversation hashes reported for KV affinity


class EngineWorker:
    """EngineWorker(EngineBackend(AsyncEngine(...)), MqttConfig(...)).run(stop_event)."""

    def __init__(self, backend: EngineBackend, config: MqttConfig, *, worker_id: str | None = None,
                 status_interval_s: float = 1.0, reconnect_max_s: float = 2.0,
                 on_status: Callable[[dict[str, Any]], None] | None = None,
                 on_response: Callable[[EngineResponse], None] | None = None) -> None:
        """on_status: each status message as it is published; on_response: each call's response
        (the process's metrics, `agentrt engine-worker --metrics-port`)."""
        self.backend = backend
        self.config = config
        self.topics = LLMTopics(config)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.status_interval_s = status_interval_s
        self.reconnect_max_s = reconnect_max_s
        self.since = time.time()
        self._outbox: asyncio.Queue[tuple[str, bytes, Any, bool]] | None = None
        self._calls: dict[str, asyncio.Task] = {}
        self._handles: dict[str, Any] = {}
        self._recent: collections.deque[str] = collections.deque(maxlen=RECENT_CONVERSATIONS)
        self.served = 0
        self.on_status, self.on_response = on_status, on_response  # settable after construction

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until stop is set; reconnects (with backoff) when the broker goes away, failing the
        calls in flight (their callers retry them on another worker)."""
        backoff = 0.05
        while not stop.is_set():
            try:
                await self._serve(stop)
                backoff = 0.05
            except aiomqtt.MqttError as e:
                if refused_for_good(e):  # bad credentials, not authorised: retrying cannot help
                    raise RunConfigError(f"engine worker {self.worker_id}: the MQTT broker at {self.config.url} "
                                         f"refused the connection: {e}") from None
                log.warning("engine worker %s: no broker at %s (%s); reconnecting", self.worker_id, self.config.url, e)
            for task in list(self._calls.values()):
                task.cancel()
            if stop.is_set():
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_s)

    async def _serve(self, stop: asyncio.Event) -> None:
        will = aiomqtt.Will(self.topics.status(self.worker_id), encode({"status": "offline", "worker": self.worker_id}),
                            qos=1, retain=True, properties=will_properties())
        async with self.config.client(f"agentrt-engine-{self.worker_id}", will=will) as client:
            self._outbox = asyncio.Queue()
            for topic in (self.topics.shared_call, self.topics.worker_call(self.worker_id), self.topics.control(self.worker_id)):
                await client.subscribe(topic, qos=1)
            unsubscribe = self.backend.subscribe_steps(self._on_engine_step)
            tasks = [asyncio.create_task(self._send_loop(client)), asyncio.create_task(self._status_loop()),
                     asyncio.create_task(self._receive(client))]
            stopped = asyncio.create_task(stop.wait())
            try:
                done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not stopped and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            finally:
                unsubscribe()
                stopped.cancel()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, stopped, return_exceptions=True)
            if stop.is_set():  # a clean stop: callers learn at once that this worker is gone
                for task in list(self._calls.values()):
                    task.cancel()
                await client.publish(self.topics.status(self.worker_id),
                                     encode({"status": "offline", "worker": self.worker_id}), qos=1, retain=True)

    def _publish(self, topic: str, payload: dict[str, Any], correlation: bytes | None = None, retain: bool = False) -> None:
        """Queue a message: one sender keeps a call's deltas, steps and result in order."""
        if self._outbox is not None:
            self._outbox.put_nowait((topic, encode(payload), correlation, retain))

    async def _send_loop(self, client: aiomqtt.Client) -> None:
        assert self._outbox is not None
        while True:
            topic, payload, correlation, retain = await self._outbox.get()
            await client.publish(topic, payload, qos=1, retain=retain,
                                 properties=reply_properties(correlation) if correlation else None)

    async def _status_loop(self) -> None:
        counts: dict[str, Any] = {"kv": {}, "running": 0, "waiting": 0}
        counting: asyncio.Task | None = None
        while True:
            # the counts are read on the engine thread between steps: a long step must not delay
            # the heartbeat (callers would count this worker lost), so the last counts go
            if counting is None:
                counting = asyncio.create_task(self._engine_counts())
            await asyncio.wait([counting], timeout=self.status_interval_s / 2)
            if counting.done():
                counts, counting = counting.result(), None
            status = self.status(counts)
            self._publish(self.topics.status(self.worker_id), status, retain=True)
            if self.on_status is not None:
                self.on_status(status)
            await asyncio.sleep(self.status_interval_s)

    async def _engine_counts(self) -> dict[str, Any]:
        engine = self.backend.engine
        kv, load = await asyncio.gather(engine.kv_blocks(), engine.load())
        return {"kv": kv, **load}

    def status(self, counts: dict[str, Any]) -> dict[str, Any]:
        info = self.backend.engine.info
        return {"status": "online", "worker": self.worker_id, "pid": os.getpid(), "host": socket.gethostname(),
                "model": self.backend.model_name, "precision": info.precision,
                "tool_format": info.tool_format.name, "block_size": info.block_size,
                "prefix_caching": info.prefix_caching, "max_num_seqs": info.max_num_seqs,
                "running": counts["running"], "waiting": counts["waiting"],
                "calls": len(self._calls), "kv": counts["kv"], "prefixes": list(self._recent),
                "served": self.served, "interval_s": self.status_interval_s, "since": self.since, "ts": time.time()}

    def _on_engine_step(self, step: EngineStep) -> None:
        self._publish(self.topics.steps(self.worker_id), engine_step_to_dict(step))

    # -- incoming -------------------------------------------------------------------------------
    async def _receive(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            topic = str(message.topic)
            body = decode(message.payload)
            try:
                if topic == self.topics.control(self.worker_id):
                    self._on_control(body or {}, message)
                else:
                    self._on_call(body, message)
            except Exception:  # noqa: BLE001 - one odd message must not stop the worker
                log.exception("engine worker %s: dropped a message on %s", self.worker_id, topic)

    def _on_call(self, body: dict[str, Any] | None, message: aiomqtt.Message) -> None:
        reply_to = message_property(message, "ResponseTopic")
        correlation = message_property(message, "CorrelationData")
        if not reply_to or not correlation:
            log.warning("engine worker %s: a call without a response topic or correlation data", self.worker_id)
            return
        call_id = correlation.decode(errors="replace")
        if body is None:
            self._publish(reply_to, {"kind": "error", "worker": self.worker_id,
                                     "error": "the call is not a JSON object"}, correlation)
            return
        if call_id in self._calls:  # a duplicate delivery (QoS 1 may deliver twice)
            return
        self._publish(reply_to, {"kind": "ack", "worker": self.worker_id}, correlation)
        task = asyncio.create_task(self._run_call(call_id, body, reply_to, correlation))
        self._calls[call_id] = task
        task.add_done_callback(lambda _t: (self._calls.pop(call_id, None), self._handles.pop(call_id, None)))

    async def _run_call(self, call_id: str, body: dict[str, Any], reply_to: str, correlation: bytes) -> None:
        def send(kind: str, **payload: Any) -> None:
            self._publish(reply_to, {"kind": kind, "worker": self.worker_id, **payload}, correlation)

        def on_step(ev: LLMStepEvent) -> None:
            send("step", step=step_event_to_dict(ev))

        def on_start(handle: Any) -> None:
            self._handles[call_id] = handle
            send("started", handle=handle)

        try:
            request = request_from_dict(body.get("request") or {})
            ahead = body.get("ahead")
            if isinstance(ahead, dict):  # compute, cache and pin the known start of a later call
                result = await self.backend.prefill_ahead(request, str(ahead["marker"]), float(ahead["ttl_s"]),
                                                          on_step=on_step)
                send("ahead", result=None if result is None else {
                    "tokens": result.tokens, "computed": result.computed, "finish_reason": result.finish_reason})
                return
            wants_logprobs = request.sampling.get("logprobs") is not None
            response = await self.backend.complete(
                request, on_step=on_step, on_start=on_start, on_text=lambda text: send("text", text=text),
                on_logprobs=(lambda entries: send("logprobs", entries=entries)) if wants_logprobs else None)
        except asyncio.CancelledError:
            send("error", error=f"engine worker {self.worker_id} cancelled the call", cancelled=True)
            raise
        except (AgentRTError, ValueError) as e:
            send("error", error=str(e), invalid=True)
            return
        except Exception as e:  # noqa: BLE001 - the caller gets an answer, not silence
            log.exception("engine worker %s: call %s failed", self.worker_id, call_id)
            send("error", error=f"engine worker {self.worker_id}: {type(e).__name__}: {e}")
            return
        self.served += 1
        if self.on_response is not None:
            self.on_response(response)
        sent = list(response.sent_messages or request.messages)
        self._recent.append(conversation_hash([*sent, {"role": "assistant", "content": response.text}]))
        send("result", response=response_to_dict(response))

    def _on_control(self, body: dict[str, Any], message: aiomqtt.Message) -> None:
        op, call_id = body.get("op"), str(body.get("call_id", ""))
        if op == "cancel":
            task = self._calls.get(call_id)
            if task is not None:
                task.cancel()
        elif op == "priority":
            handle = self._handles.get(call_id)
            if handle is not None:
                self.backend.set_priority(handle, float(body["priority"]))
        elif op == "pin":
            self._pin(body, message)
        else:
            log.warning("engine worker %s: unknown control op %r", self.worker_id, op)

    def _pin(self, body: dict[str, Any], message: aiomqtt.Message) -> None:
        reply_to = message_property(message, "ResponseTopic")
        correlation = message_property(message, "CorrelationData")
        held = EngineResponse("", None, "stop", Usage(0, 0), request_id=body.get("request_id"),
                              prompt_token_ids=tuple(int(t) for t in body.get("tokens", ())))

        def pinned(pin: Any) -> None:
            if reply_to:
                self._publish(reply_to, {"kind": "pinned", "worker": self.worker_id, "blocks": pin.blocks}, correlation)

        if self.backend.pin(held, float(body.get("ttl_s", 0.0)), pinned) is None and reply_to:
            self._publish(reply_to, {"kind": "pinned", "worker": self.worker_id, "blocks": None}, correlation)
