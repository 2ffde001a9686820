"""EngineBackend: the runtime's LLMBackend over agentrt.engine.AsyncEngine.

Step records arrive on the engine thread; one listener hops each to every event loop that has
requests or lane subscribers there (call_soon_threadsafe), where it is split per request. The
engine delivers a request's final token event after the listener ran for that step, and both
hops go through the same loop's FIFO callback queue, so a request sees all its steps before its
result.

KV holds: `pin(response, ttl_s)` asks the engine (on its thread, through the AsyncEngine command
queue) to keep the cached KV of that call's prompt and output for ttl_s seconds; responses are
`EngineResponse`s, which carry the token ids a pin and its later outcome need.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from agentrt.errors import RequestError
from agentrt.jsonutil import parse_json
from agentrt.runtime.backend import (AheadResult, EngineStep, KVPin, LLMRequest, LLMResponse, LLMStepEvent, PromptRecord, StepCallback,
                                     Usage)
from agentrt.structured.tool_formats import ToolCallFormat

if TYPE_CHECKING:  # the runtime imports torch only when it runs an engine
    from agentrt.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineResponse(LLMResponse):
    """An LLMResponse with the engine's token ids (for KV holds)."""

    prompt_token_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass
class _LoopState:
    """What one event loop listens to: per-request step callbacks and engine-lane subscribers."""

    requests: dict[int, StepCallback] = field(default_factory=dict)
    lanes: list[Callable[[EngineStep], None]] = field(default_factory=list)

    def dispatch(self, record: Any) -> None:
        if self.lanes:
            step = engine_step(record)
            for fn in list(self.lanes):
                fn(step)
        for i, rid in enumerate(record.request_ids):
            cb = self.requests.get(rid)
            if cb is not None:
                cb(LLMStepEvent(step=record.step, start=record.start, duration_s=record.duration_s,
                                batch_size=record.batch_size, num_new=_at(record.num_new, i, 1),
                                k=_at(record.k, i, 0), accepted=_at(record.accepted, i, 0)))
        for rid in record.preempted:
            cb = self.requests.get(rid)
            if cb is not None:
                cb(LLMStepEvent(step=record.step, start=record.start, duration_s=0.0,
                                batch_size=record.batch_size, num_new=0, preempted=True))

    @property
    def idle(self) -> bool:
        return not self.requests and not self.lanes


@dataclass
class _Started:
    """Called by the engine with a request's id once it is queued (AsyncEngine on_start)."""

    state: _LoopState
    on_step: StepCallback | None
    on_start: Callable[[Any], None] | None
    request_id: int | None = None

    def __call__(self, seq_id: int) -> None:
        self.request_id = seq_id
        if self.on_step is not None:
            self.state.requests[seq_id] = self.on_step
        if self.on_start is not None:
            self.on_start(seq_id)


def _params(request: LLMRequest) -> Any:
    """The engine's SamplingParams for a runtime request."""
    from agentrt.engine.sampling_params import SamplingParams

    rf = dict(request.response_format)
    fixed = {"max_tokens", "temperature", "response_format"}
    unknown = sorted(set(request.sampling) - set(SamplingParams.__dataclass_fields__) | (set(request.sampling) & fixed))
    if unknown:
        raise RequestError(f"sampling: unknown or reserved field(s) {', '.join(unknown)}")
    return SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                          response_format=None if rf.get("type", "text") == "text" else rf, **request.sampling)


def _meta(request: LLMRequest) -> dict[str, Any]:
    return {"run_id": request.node.run_id, "program": request.node.program, "node": request.node.node,
            **request.hints}


def _at(values: list, i: int, default: Any) -> Any:
    return values[i] if i < len(values) else default


def engine_step(record: Any) -> EngineStep:
    """An engine StepRecord as a lane entry."""
    return EngineStep(
        step=record.step, start=record.start, duration_s=record.duration_s, batch_size=record.batch_size,
        num_tokens=record.num_tokens, num_prefill_tokens=record.num_prefill_tokens, kv_tokens=record.kv_tokens,
        drafted=sum(record.k), accepted=sum(record.accepted), max_k=max(record.k, default=0),
        preempted=len(record.preempted), predicted_s=record.predicted_s, draft_s=record.draft_s,
        ks=tuple(record.k), accepted_ks=tuple(record.accepted),
    )


def reusable_tokens(held: tuple[int, ...], prompt: tuple[int, ...], block_size: int) -> int:
    """The prompt tokens a later call could take from a KV hold: the full blocks its prompt
    shares with the held tokens (at least one prompt token is always computed)."""
    common = 0
    for a, b in zip(held, prompt[: max(0, len(prompt) - 1)]):
        if a != b:
            break
        common += 1
    return common // block_size * block_size


def chat_messages(messages: tuple[Mapping[str, Any], ...]) -> list[dict[str, Any]]:
    """The DSL's OpenAI-style messages for a chat template. An assistant turn that only called a
    tool (content None) also gets the call as JSON text: templates without tool support (SmolLM2's)
    concatenate `content` and would otherwise fail on None."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": parse_json(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            m["content"] = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
        elif m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


class EngineBackend:
    """EngineBackend(AsyncEngine(LLMEngine(EngineConfig()))). close() detaches the step listener
    (the engine itself belongs to the caller)."""

    def __init__(self, engine: AsyncEngine, model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.info.model
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._lock = threading.Lock()
        engine.add_step_listener(self._on_engine_step)

    # -- the engine thread --
    def _on_engine_step(self, record: Any) -> None:
        with self._lock:
            targets = list(self._loops.items())
        for loop, state in targets:
            try:
                loop.call_soon_threadsafe(state.dispatch, record)
            except RuntimeError:  # that loop is closed
                with self._lock:
                    self._loops.pop(loop, None)

    # -- the caller's loop --
    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._lock:
            return self._loops.setdefault(loop, _LoopState())

    def _release(self, state: _LoopState) -> None:
        if state.idle:
            with self._lock:
                for loop, s in list(self._loops.items()):
                    if s is state:
                        del self._loops[loop]

    @contextlib.contextmanager
    def _listening(self, on_step: StepCallback | None, on_start: Callable[[Any], None] | None,
                   late_steps: bool = False) -> Iterator[_Started]:
        """The on_start hook of one engine request: it routes the request's steps to on_step on
        this loop until the block ends (late_steps: and, when the block is cancelled, until the
        engine has seen the request's abort)."""
        state = self._state()
        started = _Started(state, on_step, on_start)

        def stop_listening(_: Any = None) -> None:
            if started.request_id is not None:
                state.requests.pop(started.request_id, None)
            self._release(state)

        try:
            yield started
        except BaseException:
            # the caller stopped listening (cancelled) while the request may be in a step: keep routing
            # its steps until the engine thread has run every command queued so far (its abort among
            # them), so a step that computed tokens for it is still heard (prefill-ahead counts them)
            if not late_steps or started.request_id is None or started.on_step is None:
                stop_listening()
            else:
                self.engine.call_on_engine_thread(lambda: None).add_done_callback(stop_listening)
            raise
        else:
            stop_listening()

    async def complete(self, request: LLMRequest, *, on_step: StepCallback | None = None,
                       on_start: Callable[[Any], None] | None = None,
                       on_text: Callable[[str], None] | None = None,
                       on_logprobs: Callable[[list[dict[str, Any]]], None] | None = None) -> LLMResponse:
        """on_logprobs (when sampling asked for logprobs): each engine event's token logprobs,
        in LLMResponse.logprobs' shape, before on_text gets that event's text."""
        params, meta = _params(request), _meta(request)
        result = None
        messages = chat_messages(request.messages)
        with self._listening(on_step, on_start) as started:
            async for ev in self.engine.stream(messages, params, priority=request.priority,
                                               meta=meta, on_start=started):
                if on_logprobs is not None and ev.logprobs:
                    on_logprobs([self._logprob_entry(lp) for lp in ev.logprobs])
                if on_text is not None and ev.text:
                    on_text(ev.text)
                if ev.finished:
                    result = ev.result
        if result is None:
            return LLMResponse("", None, "error", Usage(0, 0), request_id=started.request_id,
                               error="the engine ended the stream without a result")
        prompt = self._prompt_record(messages, params.response_format, result.prompt_text)
        return EngineResponse(
            text=result.text, parsed=result.parsed, finish_reason=result.finish_reason,
            usage=Usage(result.prompt_tokens, len(result.token_ids), getattr(result, "cached_tokens", 0) or 0),
            spec=result.spec,
            request_id=result.request_id, error=result.error,
            prompt_token_ids=tuple(result.prompt_token_ids), token_ids=tuple(result.token_ids),
            # replayed by a call that continues this one; None: sent as given, or the tools went to
            # the chat template (not replayable as messages)
            sent_messages=None if prompt.tools is not None or list(prompt.messages) == messages else prompt.messages,
            logprobs=None if result.logprobs is None else tuple(self._logprob_entry(lp) for lp in result.logprobs),
            prompt=prompt,
        )

    async def prefill_ahead(self, request: LLMRequest, marker: str, ttl_s: float, *,
                            on_step: StepCallback | None = None) -> AheadResult | None:
        """Compute, cache and pin (ttl_s seconds) the KV of the known start of a call that waits on
        inputs: request.messages as the call will send them, with `marker` where the first unknown
        value starts (AsyncEngine.prefill_ahead). Runs only while the engine has nothing else to
        run; cancelling the awaiting task aborts it. None: nothing to compute (all cached)."""
        with self._listening(on_step, None, late_steps=True) as started:
            result = await self.engine.prefill_ahead(chat_messages(request.messages), _params(request), marker, ttl_s,
                                                     meta=_meta(request), on_start=started)
        if result is None:
            return None
        return AheadResult(result.prompt_tokens, result.prompt_tokens - result.cached_tokens, result.finish_reason)

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        # one token decoded alone: a piece of a multi-byte character comes out as U+FFFD
        text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprob_entry(self, lp: Any) -> dict[str, Any]:
        return {**self._token(lp.token_id, lp.logprob), "top_logprobs": [self._token(t, v) for t, v in lp.top]}

    def _prompt_record(self, messages: list[dict[str, Any]], response_format: Any, text: str | None) -> PromptRecord:
        """The messages and tools the engine encoded this request from (as LLMEngine.prepare
        formats them), the text it tokenized (GenerationResult.prompt_text) and the tokens of each
        part (none when counting them fails: the trace's account never fails the call)."""
        from agentrt.engine.chat.messages import normalize_messages
        from agentrt.engine.chat.prompt_parts import prompt_parts
        from agentrt.structured.output_format import parse_response_format

        asked = normalize_messages(messages)
        sent, tools = self.engine.format_messages(asked, parse_response_format(response_format))
        try:
            parts = prompt_parts(self.engine.tokenizer, asked, sent, tools)
        except Exception:  # noqa: BLE001
            log.warning("counting the prompt's tokens by part failed", exc_info=True)
            parts = []
        return PromptRecord(tuple(sent), text, tuple(parts), None if tools is None else tuple(tools))

    @property
    def tool_format(self) -> ToolCallFormat:
        """The syntax the model writes tool calls in (the server's chat API streams them by it)."""
        return self.engine.info.tool_format

    # -- KV holds --
    @property
    def block_size(self) -> int:
        return self.engine.info.block_size

    def pin(self, response: LLMResponse, ttl_s: float,
            on_pinned: Callable[[KVPin], None] | None = None) -> KVPin | None:
        """Hold the KV of this call's prompt and output for ttl_s seconds (its program waits on a
        tool and will send them again). Runs on the engine thread between steps; on_pinned(pin)
        follows on this loop once pin.blocks is known. None: not an engine response, or the
        engine keeps no prefix cache."""
        if not isinstance(response, EngineResponse) or not self.engine.info.prefix_caching:
            return None
        pin = KVPin(response.request_id, response.prompt_token_ids + response.token_ids, float(ttl_s))

        def done(pinned: asyncio.Future) -> None:
            if pinned.cancelled() or pinned.exception() is not None:
                return
            pin.blocks = pinned.result()
            if on_pinned is not None:
                on_pinned(pin)

        self.engine.pin_prefix(pin.tokens, pin.ttl_s).add_done_callback(done)
        return pin

    def reuse(self, pin: KVPin, response: LLMResponse) -> tuple[int, int]:
        """(reusable, reused) prompt tokens of a later call against a hold: reusable = the full
        blocks its prompt shares with the held tokens (at least one prompt token is always
        computed), reused = what the engine took from its cache (cached_input_tokens)."""
        prompt = response.prompt_token_ids if isinstance(response, EngineResponse) else ()
        return reusable_tokens(pin.tokens, prompt, self.block_size), response.usage.cached_input_tokens

    def set_priority(self, handle: Any, priority: float) -> None:
        self.engine.set_priority(handle, priority)

    async def kv_blocks(self) -> dict[str, int]:
        """The engine's KV blocks by state (LLMEngine.kv_blocks), read on its thread between steps."""
        return await self.engine.kv_blocks()

    def subscribe_steps(self, fn: Callable[[EngineStep], None]) -> Callable[[], None]:
        state = self._state()
        state.lanes.append(fn)

        def unsubscribe() -> None:
            if fn in state.lanes:
                state.lanes.remove(fn)
            self._release(state)

        return unsubscribe

    def close(self) -> None:
        self.engine.remove_step_listener(self._on_engine_step)
