"""RemoteEngineBackend: the runtime's LLMBackend over engine workers (`agentrt engine-worker`) on MQTT 5.

The runtime sees what it sees with an in-process engine: a call's text deltas, its engine steps
(on_step: phases, service, α) and an EngineResponse with token ids (KV holds), plus every
worker's engine lane (subscribe_steps, as RemoteEngineStep records naming the worker).

Routing (remote_routing.py; `routing=`). In the default mode, "affinity", each call goes to one
worker's own call topic:
- KV affinity: a call whose prefill-ahead ran on a worker, a call that continues an earlier call of its run (hints["continues"], set by the
  runtime for `continues=`), or whose messages begin with a conversation a worker recently cached
  (its own record of where calls ran, and the conversation hashes workers report), goes to that
  worker while it has room (fewer requests than its max_num_seqs, free KV blocks);
- otherwise to the least-loaded worker: fewest calls in flight (this backend's own count, or the
  worker's reported running + waiting when higher), then most free KV blocks.
"round-robin" sends calls to the workers in turn; "broker" to the group's shared subscription,
where the broker picks the worker (the ack names it).

Lost workers. A worker is lost when its last will (or clean stop) says offline, when its status
goes silent for 3 status intervals, when it leaves a call unacknowledged for accept_timeout_s, or
when the broker connection drops. Its calls are sent again to another worker (up to max_retries
times). Text already streamed is not streamed twice: the retry's deltas are delivered only past
the number of characters already delivered. A greedy call reproduces its tokens, and so does a
sampled one, because a call without a seed gets one drawn here before it is first sent (the same
model and dtype on every worker assumed); if the retried text still differs from what was
streamed, a warning is logged and the response carries the retry's text. Steps of the lost
attempt stay counted (that work was done).
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import aiomqtt

from agentrt.errors import AgentRTError, RequestError
from agentrt.runtime.backend import AheadResult, EngineStep, KVPin, LLMRequest, LLMResponse, StepCallback, Usage
from agentrt.runtime.engine_backend import reusable_tokens
from agentrt.runtime.remote_protocol import (LLMTopics, RemoteResponse, engine_step_from_dict, request_to_dict,
                                             response_from_dict, step_event_from_dict)
from agentrt.runtime.remote_routing import Router, WorkerState
from agentrt.tools.mqtt_protocol import ClientSignals, MqttConfig, decode, encode, message_property, request_properties

log = logging.getLogger("agentrt.remote_engine")

PENDING_PINS = 4096  # pin answers awaited at most (a worker that died never sends its answers)


class NoEngineWorkerError(AgentRTError):
    """No engine worker is online (or none came online in time)."""


@dataclass
class RemoteHandle:
    """What on_start hands the runtime (set_priority takes it): the call as it runs now."""

    call_id: str
    worker: str


@dataclass(eq=False)
class _Attempt:
    call_id: str
    worker: str
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)


class RemoteEngineBackend(ClientSignals):
    """RemoteEngineBackend(MqttConfig.from_url("mqtt://HOST:PORT")); `await start()`, then use as an
    LLMBackend; `await aclose()` at the end."""

    def __init__(self, config: MqttConfig, *, client_id: str | None = None, worker_wait_s: float = 30.0,
                 accept_timeout_s: float = 5.0, max_retries: int = 2, connect_timeout_s: float = 10.0,
                 model_name: str | None = None, routing: str = "affinity") -> None:
        self.config = config
        self.topics = LLMTopics(config)
        self.client_id = client_id or f"agentrt-llm-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.reply_topic = self.topics.reply(self.client_id)
        self.worker_wait_s = worker_wait_s
        self.accept_timeout_s = accept_timeout_s
        self.max_retries = max_retries
        self.connect_timeout_s = connect_timeout_s
        self._model_name = model_name
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task | None = None
        self._changed: asyncio.Condition | None = None
        self.router = Router(routing)
        self._workers = self.router.workers  # the same dict: online workers by id
        self._attempts: dict[str, _Attempt] = {}
        self._pins: dict[str, tuple[KVPin, Callable[[KVPin], None] | None]] = {}
        self._lanes: list[Callable[[EngineStep], None]] = []
        self._background: set[asyncio.Task] = set()
        self._closing = False
        self.retried = 0  # calls sent again after their worker was lost

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> RemoteEngineBackend:
        """Connect (NoEngineWorkerError naming the broker if that fails within connect_timeout_s)."""
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._run(), name=f"remote-engine {self.client_id}")
        self._spawn(self._watch_staleness())
        try:
            await asyncio.wait_for(self._wait(lambda: self._client is not None), self.connect_timeout_s)
        except TimeoutError:
            await self.aclose()
            raise NoEngineWorkerError(f"cannot connect to the MQTT broker at {self.config.url} "
                                      f"within {self.connect_timeout_s:g}s") from None
        return self

    async def aclose(self) -> None:
        self._closing = True
        for task in [self._task, *self._background]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._background] if t is not None), return_exceptions=True)
        self._task = None

    async def wait_for_workers(self, count: int = 1, timeout: float = 30.0) -> list[str]:
        try:
            await asyncio.wait_for(self._wait(lambda: len(self._workers) >= count), timeout)
        except TimeoutError:
            raise NoEngineWorkerError(f"only {len(self._workers)} of {count} engine workers came online at "
                                      f"{self.config.url} (group '{self.config.group}') within {timeout:g}s") from None
        return sorted(self._workers)

    def workers(self) -> dict[str, dict[str, Any]]:
        """The online workers' last status messages, by worker id."""
        return {w: dict(s.status) for w, s in self._workers.items()}

    @property
    def model_name(self) -> str:
        if self._model_name:
            return self._model_name
        return next((str(s.status.get("model")) for s in self._workers.values()), "remote")

    @property
    def affinity_routed(self) -> int:
        """Calls sent to a worker for the KV it holds (not for its load)."""
        return self.router.affinity_routed

    @property
    def precision(self) -> str:
        """The workers' precision (their status reports), "remote" before any reported one."""
        found = sorted({str(s.status.get("precision")) for s in self._workers.values() if s.status.get("precision")})
        return "/".join(found) or "remote"

    @property
    def tool_format(self) -> Any:
        from agentrt.structured.tool_formats import FORMATS, HOUSE

        names = [s.status.get("tool_format") for s in self._workers.values()]
        return FORMATS.get(names[0], HOUSE) if names else HOUSE

    # -- the connection -------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            try:
                async with self.config.client(self.client_id) as client:
                    for topic in (self.reply_topic, self.topics.status_filter, self.topics.steps_filter):
                        await client.subscribe(topic, qos=1)
                    self._client = client
                    backoff = 0.05
                    await self._notify()
                    async for message in client.messages:
                        try:
                            self._on_message(message)
                        except Exception:  # noqa: BLE001 - one odd message must not stop the backend
                            log.exception("dropped a message on %s", message.topic)
            except aiomqtt.MqttError as e:
                log.warning("remote engines: lost the MQTT broker at %s (%s); reconnecting", self.config.url, e)
            finally:
                self._client = None
                self._workers.clear()  # the broker re-sends the retained statuses on reconnect
                for attempt in list(self._attempts.values()):
                    attempt.inbox.put_nowait({"kind": "lost", "why": "the connection to the MQTT broker was lost"})
            if self._closing:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _watch_staleness(self) -> None:
        """A worker whose status stops coming (machine gone, no TCP reset yet) counts as lost."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for w, s in list(self._workers.items()):
                if now - s.seen > self._stale_after(s.status):
                    self._worker_gone(w, f"engine worker '{w}' sent no status for {now - s.seen:.1f}s")

    @staticmethod
    def _stale_after(status: Mapping[str, Any]) -> float:
        """Seconds without a status after which a worker counts as lost: 3 of its intervals."""
        return 3 * float(status.get("interval_s") or 1.0) + 0.5

    def _worker_gone(self, worker: str, why: str) -> None:
        if self._workers.pop(worker, None) is not None:
            log.warning("remote engines: %s", why)
        for attempt in list(self._attempts.values()):
            if attempt.worker == worker:
                attempt.inbox.put_nowait({"kind": "lost", "why": why})
        self._spawn(self._notify())

    # -- incoming -------------------------------------------------------------------------------
    def _on_message(self, message: aiomqtt.Message) -> None:
        topic = str(message.topic)
        worker = topic.rsplit("/", 1)[-1]
        body = decode(message.payload)
        if topic == self.reply_topic:
            correlation = message_property(message, "CorrelationData")
            key = correlation.decode(errors="replace") if correlation else ""
            if body is None:
                return
            if key in self._attempts:
                attempt = self._attempts[key]
                if not attempt.worker and body.get("kind") == "ack":  # a shared call: the broker chose it
                    # set here, in arrival order, so that the worker's loss (a later message) finds it
                    attempt.worker = str(body.get("worker", ""))
                    if attempt.worker in self._workers:
                        self._workers[attempt.worker].in_flight += 1
                attempt.inbox.put_nowait(body)
            elif key in self._pins and body.get("kind") == "pinned":
                pin, on_pinned = self._pins.pop(key)
                pin.blocks = body.get("blocks")
                if on_pinned is not None:
                    on_pinned(pin)
        elif topic.startswith(self.topics.status("")):
            if body is not None and body.get("status") == "online":
                age = time.time() - float(body.get("ts") or 0.0)
                if age > self._stale_after(body):  # a retained status of a worker that vanished
                    return
                state = self._workers.get(worker)
                if state is None:
                    self._workers[worker] = WorkerState(worker, body, time.monotonic())
                else:
                    state.status, state.seen = body, time.monotonic()
                self._spawn(self._notify())
            else:
                self._worker_gone(worker, f"engine worker '{worker}' went offline")
        elif topic.startswith(self.topics.steps("")) and body is not None and self._lanes:
            step = engine_step_from_dict(body, worker)
            for fn in list(self._lanes):
                fn(step)

    # -- routing --------------------------------------------------------------------------------
    async def _pick_worker(self, request: LLMRequest, avoid: set[str]) -> str:
        worker = self.router.route(request, avoid) if self._client is not None else None
        if worker is not None:
            return worker
        try:
            await asyncio.wait_for(self._wait(lambda: self._client is not None and bool(self._workers)), self.worker_wait_s)
        except TimeoutError:
            raise NoEngineWorkerError(f"no engine worker is online at {self.config.url} (group '{self.config.group}') "
                                      f"after waiting {self.worker_wait_s:g}s: start one with `agentrt engine-worker "
                                      f"--broker {self.config.url}`") from None
        return self.router.route(request, avoid) or await self._pick_worker(request, avoid)

    # -- calls ----------------------------------------------------------------------------------
    async def complete(self, request: LLMRequest, *, on_step: StepCallback | None = None,
                       on_start: Callable[[Any], None] | None = None,
                       on_text: Callable[[str], None] | None = None,
                       on_logprobs: Callable[[list[dict[str, Any]]], None] | None = None) -> LLMResponse:
        """on_logprobs (when sampling asked for logprobs): the token logprobs as the worker's
        engine reports them, before the text of those tokens (as EngineBackend.complete)."""
        if request.temperature > 0 and request.sampling.get("seed") is None:  # so that a retry reproduces it
            request = replace(request, sampling={**request.sampling, "seed": random.randrange(2**63)})
        streamed: list[str] = []  # the text delivered to on_text so far, over all attempts
        logprobs_sent = 0  # token logprob entries delivered so far, over all attempts
        handle: RemoteHandle | None = None
        avoid: set[str] = set()
        why = ""
        for retry in range(self.max_retries + 1):
            worker = await self._pick_worker(request, avoid)
            if self.router.mode == "broker" and retry == 0:
                worker = ""  # the shared subscription: the ack says which worker took it
            attempt = _Attempt(uuid.uuid4().hex, worker)
            self._attempts[attempt.call_id] = attempt
            if worker:
                self._workers[worker].in_flight += 1
            produced: list[str] = []
            logprobs_seen = 0
            try:
                await self._send_call(attempt, request)
                acked = False
                while True:
                    timeout = None if acked else self.accept_timeout_s
                    try:
                        msg = await asyncio.wait_for(attempt.inbox.get(), timeout)
                    except TimeoutError:
                        msg = {"kind": "lost", "why": f"engine worker '{worker}' did not acknowledge the call "
                                                      f"within {self.accept_timeout_s:g}s"}
                    kind = msg.get("kind")
                    worker = attempt.worker
                    if kind == "ack":
                        acked = True
                    elif kind == "started":
                        if handle is None:
                            handle = RemoteHandle(attempt.call_id, worker)
                            if on_start is not None:
                                on_start(handle)
                        else:  # a retry: set_priority now reaches the new worker
                            handle.call_id, handle.worker = attempt.call_id, worker
                    elif kind == "text":
                        self._deliver_text(str(msg.get("text", "")), produced, streamed, on_text)
                    elif kind == "logprobs" and on_logprobs is not None:
                        entries = list(msg.get("entries") or ())
                        fresh = entries[max(0, logprobs_sent - logprobs_seen):]  # past what a lost attempt sent
                        logprobs_seen += len(entries)
                        if fresh:
                            logprobs_sent += len(fresh)
                            on_logprobs(fresh)
                    elif kind == "step" and on_step is not None:
                        on_step(step_event_from_dict(msg["step"], worker))
                    elif kind == "result":
                        response = response_from_dict(msg["response"], worker, retry)
                        self.router.placed_after(request, response)
                        return response
                    elif kind == "error":
                        if msg.get("invalid"):
                            raise RequestError(str(msg.get("error")))
                        if not msg.get("cancelled"):
                            return LLMResponse("".join(streamed), None, "error", Usage(0, 0),
                                               request_id=attempt.call_id, error=str(msg.get("error")))
                        why = str(msg.get("error"))
                        break  # the worker stopped (or lost the broker) with the call running
                    elif kind == "lost":
                        why = str(msg.get("why"))
                        # a worker only silent (or slow to acknowledge) may still run it: stop it there
                        self._cancel_on(attempt)
                        break
            except asyncio.CancelledError:
                self._cancel_on(attempt)
                raise
            finally:
                del self._attempts[attempt.call_id]
                if attempt.worker in self._workers:
                    self._workers[attempt.worker].in_flight -= 1
                worker = attempt.worker
            if self._closing:
                return LLMResponse("".join(streamed), None, "error", Usage(0, 0),
                                   error="the remote engine backend was closed with the call in flight")
            if worker:
                avoid.add(worker)
            self.retried += 1
            log.warning("remote engines: %s; sending node %s of run %s to another worker", why,
                        request.node.node, request.node.run_id)
        return LLMResponse("".join(streamed), None, "error", Usage(0, 0), error=f"{why}; gave up after "
                           f"{self.max_retries} retries on other engine workers")

    async def prefill_ahead(self, request: LLMRequest, marker: str, ttl_s: float, *,
                            on_step: StepCallback | None = None) -> AheadResult | None:
        """EngineBackend.prefill_ahead on the worker the call would go to now; the call itself then
        goes to that worker (while it has room). A lost worker ends it as "dropped" (not retried:
        it only saves time). Cancelling the awaiting task cancels it there."""
        worker = await self._pick_worker(request, set())
        self.router.remember(("ahead", request.node.run_id, request.node.node), worker)
        attempt = _Attempt(uuid.uuid4().hex, worker)
        self._attempts[attempt.call_id] = attempt
        try:
            await self._send_call(attempt, request, {"marker": marker, "ttl_s": ttl_s})
            while True:
                msg = await attempt.inbox.get()
                kind = msg.get("kind")
                if kind == "step" and on_step is not None:
                    on_step(step_event_from_dict(msg["step"], worker))
                elif kind == "ahead":
                    result = msg.get("result")
                    return None if result is None else AheadResult(int(result["tokens"]), int(result["computed"]),
                                                                    str(result["finish_reason"]))
                elif kind in ("lost", "error"):
                    if msg.get("invalid"):
                        raise RequestError(str(msg.get("error")))
                    return AheadResult(0, 0, "dropped")
        except asyncio.CancelledError:
            self._spawn(self._control(worker, {"op": "cancel", "call_id": attempt.call_id}))
            raise
        finally:
            del self._attempts[attempt.call_id]

    async def _send_call(self, attempt: _Attempt, request: LLMRequest, ahead: dict[str, Any] | None = None) -> None:
        client = self._client
        if client is None:
            attempt.inbox.put_nowait({"kind": "lost", "why": "not connected to the MQTT broker"})
            return
        topic = self.topics.worker_call(attempt.worker) if attempt.worker else self.topics.call
        try:
            await client.publish(topic, encode({"request": request_to_dict(request), "ahead": ahead}),
                                 qos=1, properties=request_properties(self.reply_topic, attempt.call_id, None))
        except aiomqtt.MqttError as e:
            attempt.inbox.put_nowait({"kind": "lost", "why": f"sending the call failed ({e})"})

    @staticmethod
    def _deliver_text(text: str, produced: list[str], streamed: list[str], on_text: Callable[[str], None] | None) -> None:
        """Deliver what this attempt wrote past the characters already streamed (by a lost attempt)."""
        before = sum(map(len, produced))
        produced.append(text)
        done = sum(map(len, streamed))
        fresh = text[max(0, done - before):]
        if done > before:  # still replaying what a lost attempt streamed: check it is the same text
            overlap = min(done, before + len(text))
            if "".join(produced)[before:overlap] != "".join(streamed)[before:overlap]:
                log.warning("remote engines: a retried call wrote other text than its lost attempt had streamed")
        if fresh:
            streamed.append(fresh)
            if on_text is not None:
                on_text(fresh)

    def _cancel_on(self, attempt: _Attempt) -> None:
        if attempt.worker:  # an unacknowledged shared call has no known worker to tell
            self._spawn(self._control(attempt.worker, {"op": "cancel", "call_id": attempt.call_id}))

    async def _control(self, worker: str, body: dict[str, Any], props: Any = None) -> None:
        client = self._client
        if client is None:
            return
        try:
            await client.publish(self.topics.control(worker), encode(body), qos=1, properties=props)
        except aiomqtt.MqttError as e:
            log.info("could not send %s to engine worker %s: %s", body.get("op"), worker, e)

    def set_priority(self, handle: Any, priority: float) -> None:
        if isinstance(handle, RemoteHandle):
            self._spawn(self._control(handle.worker, {"op": "priority", "call_id": handle.call_id, "priority": priority}))

    def subscribe_steps(self, fn: Callable[[EngineStep], None]) -> Callable[[], None]:
        self._lanes.append(fn)

        def unsubscribe() -> None:
            if fn in self._lanes:
                self._lanes.remove(fn)

        return unsubscribe

    # -- KV holds -------------------------------------------------------------------------------
    def pin(self, response: LLMResponse, ttl_s: float,
            on_pinned: Callable[[KVPin], None] | None = None) -> KVPin | None:
        """Ask the worker that ran the call to hold its KV (None: not a remote response, the
        worker is gone, or it keeps no prefix cache)."""
        if not isinstance(response, RemoteResponse) or response.worker not in self._workers:
            return None
        if not self._workers[response.worker].status.get("prefix_caching", True):
            return None
        pin = KVPin(response.request_id, response.prompt_token_ids + response.token_ids, float(ttl_s))
        pin_id = uuid.uuid4().hex
        self._pins[pin_id] = (pin, on_pinned)
        while len(self._pins) > PENDING_PINS:  # answers that never came (the worker died)
            self._pins.pop(next(iter(self._pins)))
        body = {"op": "pin", "request_id": response.request_id, "tokens": list(pin.tokens), "ttl_s": pin.ttl_s}
        self._spawn(self._control(response.worker, body, request_properties(self.reply_topic, pin_id, None)))
        return pin

    def reuse(self, pin: KVPin, response: LLMResponse) -> tuple[int, int]:
        prompt = response.prompt_token_ids if isinstance(response, RemoteResponse) else ()
        state = self._workers.get(response.worker) if isinstance(response, RemoteResponse) else None
        block = int(state.status.get("block_size", 16)) if state else 16
        return reusable_tokens(pin.tokens, prompt, block), response.usage.cached_input_tokens

    async def kv_blocks(self) -> Mapping[str, int] | None:
        """The online workers' KV blocks by state, summed (from their last status messages)."""
        reports = [s.status.get("kv") for s in self._workers.values() if s.status.get("kv")]
        if not reports:
            return None
        total: dict[str, int] = {}
        for kv in reports:
            for k, v in kv.items():
                total[k] = total.get(k, 0) + int(v)
        return total
