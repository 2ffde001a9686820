"""asyncio front of the engine. Steps run on one background thread (torch releases the GIL in
its kernels), so the event loop stays free for tools and I/O while the model computes."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from agentrt.engine.calibration import fit_cost_model_when_idle
from agentrt.engine.llm_engine import EngineConfig, LLMEngine
from agentrt.engine.outputs import GenerationResult, TokenEvent
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.step.sequence import Sequence
from agentrt.structured.tool_formats import ToolCallFormat

T = TypeVar("T")


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, fixed when it is built, so any thread may read it."""
    model: str                   # the model it was loaded from (a name or a path)
    precision: str               # its weights' number format, as `agentrt models` labels it
    tool_format: ToolCallFormat  # the syntax the model writes tool calls in
    block_size: int              # tokens per KV block
    prefix_caching: bool         # whether it keeps (and can pin) the KV of earlier prompts
    max_num_seqs: int            # sequences it runs at once


class AsyncEngine:
    """Example:
        engine = AsyncEngine.from_config(EngineConfig())
        result = await engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))

    The rule: the LLMEngine's state changes on one thread only, the engine thread, between steps;
    every other thread goes through the command queue (submit, run_on_engine_thread, and the
    methods below built on them: kv_blocks, pin_prefix, add/remove_step_listener, load) or
    reads `info`, which never changes.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.info = EngineInfo(str(getattr(engine.config, "model", "model")), engine.loaded.precision,
                               engine.tool_format, engine.block_size, engine.prefix_caching,
                               engine.config.max_num_seqs)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="agentrt-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig = EngineConfig()) -> "AsyncEngine":
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closed:
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                events = self._fail_running(f"engine step failed: {type(e).__name__}: {e}")
            for ev in events:
                self._deliver(ev)

    def _fail_running(self, message: str) -> list[TokenEvent]:
        return [self.engine.fail(seq, message) for seq in self.engine.unfinished()]

    def _deliver(self, ev: TokenEvent) -> None:
        target = self._streams.get(ev.request_id)
        if target is None:
            return
        loop, q = target
        if ev.finished:
            self._streams.pop(ev.request_id, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:  # the caller's loop is gone
            pass

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn() on the engine thread between steps (the only place engine state may change)."""
        self._commands.put(fn)
        self._wake.set()

    # ---- the caller's side ------------------------------------------------------------------
    async def stream(
        self,
        prompt: str | list[dict] | list[int],
        params: SamplingParams = SamplingParams(),
        priority: float = 0.0,
        meta: dict | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Yield TokenEvents as the engine emits them; the last one has finished=True.
        Invalid requests raise RequestError here, before anything is queued."""
        seq = self.engine.prepare(prompt, params, priority, meta)
        async for ev in self._events(seq, on_start):
            yield ev

    async def _events(self, seq: Sequence, on_start: Callable[[int], None] | None) -> AsyncIterator[TokenEvent]:
        """Admit a prepared sequence and yield its events to the finished one; abort it if the
        caller stops listening first (cancelled or abandoned)."""
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[seq.seq_id] = (asyncio.get_running_loop(), q)
        self.submit(lambda: self.engine.add(seq))
        if on_start:
            on_start(seq.seq_id)
        try:
            while True:
                ev = await q.get()
                yield ev
                if ev.finished:
                    return
        finally:
            if seq.seq_id in self._streams:
                self._streams.pop(seq.seq_id, None)
                self.abort(seq.seq_id)

    async def prefill_ahead(self, messages: list[dict], params: SamplingParams, cut_at: str, ttl_s: float,
                            meta: dict | None = None,
                            on_start: Callable[[int], None] | None = None) -> GenerationResult | None:
        """Compute, cache and pin the KV of a call's known prompt start (LLMEngine.prepare_ahead)
        while the engine has nothing else to run. The result's finish_reason is "prefilled", or
        "dropped" (no room), or "abort" (cancelled: cancelling the awaiting task aborts it); None:
        nothing to compute."""
        seq = self.engine.prepare_ahead(messages, params, cut_at, ttl_s, meta)
        if seq is None:
            return None
        async for ev in self._events(seq, on_start):
            if ev.finished:
                return ev.result
        raise RuntimeError("prefill-ahead ended without a final event")

    async def generate(
        self, prompt: str | list[dict] | list[int], params: SamplingParams = SamplingParams(), priority: float = 0.0, meta: dict | None = None
    ) -> GenerationResult:
        async for ev in self.stream(prompt, params, priority, meta):
            if ev.finished:
                return ev.result
        raise RuntimeError("stream ended without a final event")

    async def warm_up(self) -> float:
        """Pay a fresh engine's one-off costs (first touch of the weights and KV cache, the grammar
        compiler's tokenizer tables, the kernels' first calls) on one short constrained request,
        before any caller's request does; with speculation on the quantized path and no cached
        step-cost fit, fit one on a few forwards first (calibration.fit_cost_model_when_idle).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        if self.engine.config.prefault_kv:  # memory taken at start: the kernels' step buffers too
            await self.run_on_engine_thread(self.engine.reserve_step_buffers)
        await self.run_on_engine_thread(lambda: fit_cost_model_when_idle(self.engine))
        await self.generate([{"role": "user", "content": "Hi"}],
                            SamplingParams(max_tokens=2, temperature=0, response_format={"type": "json_object"}))
        return time.perf_counter() - t0

    async def run_on_engine_thread(self, fn: Callable[[], T]) -> T:
        """fn()'s result (or its exception), fn run on the engine thread between steps."""
        return await self.call_on_engine_thread(fn)

    def call_on_engine_thread(self, fn: Callable[[], T]) -> asyncio.Future:
        """Queue fn() now (in order with every other command) and return the future its result
        (or its exception) settles on the calling loop; nobody needs to await it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(set_outcome, value) -> None:  # on the loop; the caller may have gone (cancelled)
            if not done.done():
                set_outcome(value)

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(settle, done.set_exception, e)
            else:
                loop.call_soon_threadsafe(settle, done.set_result, result)

        self.submit(run)
        return done

    # ---- what the runtime reads and holds -----------------------------------------------------
    def format_messages(self, messages: list[dict], response_format: Any) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools a chat request is encoded from (LLMEngine.format_messages:
        reads only what `info` fixes, so any thread may call it)."""
        return self.engine.format_messages(messages, response_format)

    async def kv_blocks(self) -> dict[str, int]:
        """The KV cache's blocks by state (LLMEngine.kv_blocks), read between steps."""
        return await self.run_on_engine_thread(self.engine.kv_blocks)

    async def load(self) -> dict[str, int]:
        """Sequences running and waiting, read between steps."""
        return await self.run_on_engine_thread(
            lambda: {"running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting)})

    def pin_prefix(self, token_ids: list[int], ttl_s: float) -> asyncio.Future:
        """Hold the cached KV of this token prefix for ttl_s seconds (LLMEngine.pin_prefix); the
        future gives the blocks pinned."""
        tokens = list(token_ids)
        return self.call_on_engine_thread(lambda: self.engine.pin_prefix(tokens, ttl_s))

    def add_step_listener(self, fn: Callable[[Any], None]) -> None:
        """Call fn(StepRecord) on the engine thread after every step from the next one on."""
        self.submit(lambda: self.engine.step_listeners.append(fn))

    def remove_step_listener(self, fn: Callable[[Any], None]) -> None:
        def remove() -> None:
            if fn in self.engine.step_listeners:
                self.engine.step_listeners.remove(fn)
        self.submit(remove)

    def abort(self, request_id: int) -> None:
        self.submit(lambda: self._deliver_abort(request_id))

    def _deliver_abort(self, request_id: int) -> None:
        ev = self.engine.abort(request_id)
        if ev is not None:
            self._deliver(ev)

    def set_priority(self, request_id: int, priority: float) -> None:
        self.submit(lambda: self.engine.set_priority(request_id, priority))

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
