"""ScriptedBackend: an LLMBackend that replies from a script, stepping like a batched engine.

For the runtime's tests and for dry runs of a program's plumbing without a model. Replies come
from a function of the request or a {node-id pattern: reply} dict (fnmatch patterns, first match
wins). A reply is a str (the text), a dict or list (structured output: as if the engine had
decoded it under a grammar; {"name", "arguments"} for a tool call), an LLMResponse (returned as
is, e.g. with an error), or an exception (raised from complete()).

Requests go through a simulated engine: every `step_s` one step runs the `max_batch` requests of
smallest (priority, arrival); a request first prefills its prompt (chars/4 tokens, in chunks of
`prefill_chunk`), then decodes one word of its reply per step, plus `accepted` of `k` drafts
(streamed to on_text as they are decoded).
"""
from __future__ import annotations

import asyncio
import fnmatch
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from agentrt.runtime.backend import EngineStep, KVPin, LLMRequest, LLMResponse, LLMStepEvent, StepCallback, Usage
from agentrt.spec.report import SpecFigures, SpecReport

Reply = Any  # str | dict | list | LLMResponse | BaseException | Callable[[LLMRequest], Reply]


@dataclass
class _Active:
    seq_id: int
    request: LLMRequest
    text: str
    parsed: Any
    prompt_tokens: int
    output_tokens: int
    future: asyncio.Future
    on_step: StepCallback | None
    priority: float
    prefilled: int = 0
    emitted: int = 0
    on_text: Callable[[str], None] | None = None  # gets each emitted word with the space before it
    words: list[str] = field(default_factory=list)  # text as emitted words, each with its leading space
    stats: dict[str, int] = field(default_factory=lambda: dict(drafted=0, accepted=0, forced=0, target_passes=0, emitted=0))


class ScriptedBackend:
    def __init__(self, replies: Callable[[LLMRequest], Reply] | Mapping[str, Reply] | None = None, *,
                 step_s: float = 0.002, max_batch: int = 8, k: int = 0, accepted: int = 0,
                 prefill_chunk: int = 256, model_name: str = "scripted") -> None:
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted must be in [0, k={k}], got {accepted}")
        self.replies = replies
        self.step_s, self.max_batch, self.k, self.accepted = step_s, max_batch, k, accepted
        self.prefill_chunk = prefill_chunk
        self.model_name = model_name
        self.requests: list[LLMRequest] = []  # every request, in arrival order
        self.aborted: list[str] = []  # node ids of requests cancelled before their end
        self.priority_changes: list[tuple[int, float]] = []
        self._ids = itertools.count()
        self._active: dict[int, _Active] = {}
        self._lanes: list[Callable[[EngineStep], None]] = []
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._step_no = 0

    # -- the script --
    def _reply(self, request: LLMRequest) -> Reply:
        reply = self.replies
        if isinstance(reply, Mapping):
            found = next((v for k, v in reply.items() if fnmatch.fnmatchcase(request.node.node, k)), None)
            if found is None:
                raise KeyError(f"ScriptedBackend has no reply for node '{request.node.node}'")
            reply = found
        elif reply is None:
            reply = "ok"
        while callable(reply) and not isinstance(reply, type):
            reply = reply(request)
        return reply

    # -- LLMBackend --
    async def complete(self, request: LLMRequest, *, on_step: StepCallback | None = None,
                       on_start: Callable[[Any], None] | None = None,
                       on_text: Callable[[str], None] | None = None) -> LLMResponse:
        self.requests.append(request)
        reply = self._reply(request)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, LLMResponse):
            return reply
        text, parsed = (reply, None) if isinstance(reply, str) else (json.dumps(reply), reply)
        prompt_chars = sum(len(str(m.get("content") or "")) for m in request.messages)
        out_tokens = min(request.max_tokens, max(1, len(text.split())))
        seq = _Active(next(self._ids), request, text, parsed, max(2, prompt_chars // 4), out_tokens,
                      asyncio.get_running_loop().create_future(), on_step, request.priority, on_text=on_text,
                      words=re.findall(r"\s*\S+", text) if on_text is not None else [])
        self._active[seq.seq_id] = seq
        self._ensure_loop()
        if on_start is not None:
            on_start(seq.seq_id)
        try:
            return await seq.future
        except asyncio.CancelledError:
            if self._active.pop(seq.seq_id, None) is not None:
                self.aborted.append(request.node.node)
            raise

    def set_priority(self, handle: Any, priority: float) -> None:
        self.priority_changes.append((handle, priority))
        if handle in self._active:
            self._active[handle].priority = priority

    def subscribe_steps(self, fn: Callable[[EngineStep], None]) -> Callable[[], None]:
        self._lanes.append(fn)
        return lambda: self._lanes.remove(fn) if fn in self._lanes else None

    def pin(self, response: LLMResponse, ttl_s: float,
            on_pinned: Callable[[KVPin], None] | None = None) -> KVPin | None:
        return None  # the simulation keeps no KV cache

    def reuse(self, pin: KVPin, response: LLMResponse) -> tuple[int, int]:
        return 0, 0

    async def kv_blocks(self) -> Mapping[str, int] | None:
        return None

    async def aclose(self) -> None:
        """Stop the simulated engine's task (requests still active are cancelled)."""
        for seq in self._active.values():
            seq.future.cancel()
        self._active.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # -- the simulated engine --
    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._engine_loop(), name="scripted-engine")
        assert self._wake is not None
        self._wake.set()

    async def _engine_loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = sorted(self._active.values(), key=lambda s: (s.priority, s.seq_id))[: self.max_batch]
            start = time.monotonic()
            await asyncio.sleep(self.step_s)
            self._step(batch, start, time.monotonic() - start)

    def _step(self, batch: list[_Active], start: float, duration: float) -> None:
        rows = []
        for seq in batch:
            if seq.seq_id not in self._active:  # cancelled during the step
                continue
            left = seq.prompt_tokens - seq.prefilled
            if left > 0:
                num_new = min(left, self.prefill_chunk)
                seq.prefilled += num_new
                k = acc = 0
                emit = 1 if seq.prefilled == seq.prompt_tokens else 0
            else:
                num_new = 1
                k = min(self.k, max(0, seq.output_tokens - seq.emitted - 1))
                acc = min(self.accepted, k)
                emit = acc + 1
            emit = min(emit, seq.output_tokens - seq.emitted)
            if emit and seq.on_text is not None:
                seq.on_text("".join(seq.words[seq.emitted : seq.emitted + emit]))
            seq.emitted += emit
            if emit:
                st = seq.stats
                st["drafted"] += k
                st["accepted"] += acc
                st["target_passes"] += 1
                st["emitted"] += emit
            rows.append((seq, num_new, k, acc))
        step = EngineStep(self._step_no, start, duration, len(rows), sum(n + k for _, n, k, _ in rows),
                          sum(n for _, n, _, _ in rows if n > 1), drafted=sum(k for *_, k, _ in rows),
                          accepted=sum(a for *_, a in rows), max_k=max((k for *_, k, _ in rows), default=0),
                          ks=tuple(k for *_, k, _ in rows), accepted_ks=tuple(a for *_, a in rows))
        self._step_no += 1
        for fn in list(self._lanes):
            fn(step)
        for seq, num_new, k, acc in rows:
            if seq.on_step is not None:
                seq.on_step(LLMStepEvent(step.step, start, duration, len(rows), num_new, k, acc))
            if seq.emitted >= seq.output_tokens and seq.prefilled >= seq.prompt_tokens:
                del self._active[seq.seq_id]
                if not seq.future.done():
                    seq.future.set_result(self._response(seq))

    def _response(self, seq: _Active) -> LLMResponse:
        words = seq.text.split()
        truncated = seq.output_tokens < len(words)
        text = " ".join(words[: seq.output_tokens]) if truncated else seq.text
        return LLMResponse(text, None if truncated else seq.parsed, "length" if truncated else "stop",
                           Usage(seq.prompt_tokens, seq.output_tokens), SpecReport(seq.seq_id, SpecFigures(**seq.stats)),
                           request_id=seq.seq_id)
