"""The embedded executor: runs a tool's Python function in this process.

async functions run on the event loop; sync ones each on a daemon thread so a blocking tool does
not stall the loop. Timeouts and retries are the registry's; cancelling the call cancels an async
tool, while a sync one cannot be interrupted (Python cannot stop a thread): at its timeout the
call fails and the thread is abandoned. It runs on until the function returns, its result
dropped, without holding one of the executor's `max_threads` slots and without keeping the
process alive (a daemon thread ends with the process; a pool's worker would be joined at exit).
A tool that must be stopped for real belongs in a worker process (agentrt worker, MQTT).
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import traceback
from typing import Any

import pydantic_core
from pydantic import ValidationError

from agentrt.tools.errors import ToolArgumentsError, ToolCallError, ToolDefinitionError, ToolOutputError, ToolRaisedError
from agentrt.tools.tool import Tool, is_coroutine_tool

log = logging.getLogger(__name__)


def bind_arguments(t: Tool, args: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Validated JSON arguments -> (positional, keyword) Python arguments. For typed functions
    pydantic converts the JSON (nested models, dates, ...) into the declared types."""
    sig = t.signature
    if sig is None:
        return [], dict(args)
    try:
        model = sig.args_model.model_validate(args)
    except ValidationError as e:
        raise ToolArgumentsError(t.name, f"tool '{t.name}': invalid arguments: {e}") from e
    kwargs = {name: getattr(model, name) for name in type(model).model_fields}
    if sig.var_keyword and model.model_extra:
        kwargs.update(model.model_extra)
    positional = [kwargs.pop(name) for name in sig.positional_only]
    return positional, kwargs


def to_json_value(t: Tool, raw: Any) -> Any:
    """The tool's return value in JSON form (what crosses the wire and reaches the model)."""
    try:
        adapter = t.signature.output_adapter if t.signature else None
        if adapter is not None:
            return adapter.dump_python(raw, mode="json", warnings=False)
        return pydantic_core.to_jsonable_python(raw)
    except Exception as e:  # noqa: BLE001 - pydantic raises several serialization errors
        raise ToolOutputError(
            t.name, f"tool '{t.name}' returned a value that cannot be turned into JSON ({type(raw).__name__}): {e}"
        ) from e


def _raised(t: Tool, e: BaseException) -> ToolRaisedError:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    return ToolRaisedError(t.name, f"tool '{t.name}' raised {type(e).__name__}: {e}{at}")


def _run_sync(fn: Any, positional: list[Any], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    # Runs in a worker thread; SystemExit is caught too so a tool cannot end the runtime.
    try:
        return True, fn(*positional, **kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        return False, e


async def _in_daemon_thread(name: str, call: Any, on_end: Any) -> tuple[bool, Any]:
    """call() on a new daemon thread; its result, or CancelledError with the thread left running.
    on_end(): on the loop once the thread has finished, whether or not anyone still waits."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def finished(result: tuple[bool, Any]) -> None:
        if not fut.done():  # else cancelled: the call timed out and was abandoned
            fut.set_result(result)
        on_end()

    def target() -> None:
        try:
            result = call()
        except BaseException as e:  # noqa: BLE001 - whatever ends the thread, the caller hears of it
            result = (False, e)
        try:
            loop.call_soon_threadsafe(finished, result)
        except RuntimeError:  # the loop closed while the tool ran
            pass

    threading.Thread(target=target, name=f"agentrt-tool-{name}", daemon=True).start()
    return await fut


class InProcessExecutor:
    """max_threads: how many sync tools may run at once. A call past its timeout stops counting,
    and its thread runs on, abandoned; at most max_threads abandoned threads may run at once:
    past that a sync call fails (retryable) until one of them ends, so a hung tool cannot make
    threads without bound."""

    def __init__(self, *, max_threads: int = 32) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.abandoned = 0  # sync calls given up while their thread still ran, ever
        self.abandoned_running = 0  # of those, the threads still running
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # a semaphore belongs to one loop
            self._slots = (loop, asyncio.Semaphore(self.max_threads))
        return self._slots[1]

    async def _run_in_thread(self, tool: Tool, call: Any) -> tuple[bool, Any]:
        async with self._semaphore():
            if self.abandoned_running >= self.max_threads:
                raise ToolCallError(tool.name, f"tool '{tool.name}': {self.abandoned_running} sync calls outlived their "
                                               "timeouts and still run; no new thread starts until one ends",
                                    retryable=True)
            abandoned = False

            def on_end() -> None:
                if abandoned:
                    self.abandoned_running -= 1

            try:
                return await _in_daemon_thread(tool.name, call, on_end)
            except asyncio.CancelledError:
                abandoned = True
                self.abandoned += 1
                self.abandoned_running += 1
                log.warning("tool '%s' outlived its call: its thread runs on, abandoned (%d running)", tool.name,
                            self.abandoned_running)
                raise

    async def execute(self, tool: Tool, args: dict[str, Any], *, timeout: float | None = None) -> Any:
        if tool.fn is None:
            raise ToolDefinitionError(f"tool '{tool.name}' has no Python function to run in-process")
        positional, kwargs = bind_arguments(tool, args)
        if is_coroutine_tool(tool):
            try:
                raw = await tool.fn(*positional, **kwargs)
            except ToolCallError:
                raise
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a failing tool fails its call only
                raise _raised(tool, e) from e
        else:
            ctx = contextvars.copy_context()
            call = functools.partial(ctx.run, _run_sync, tool.fn, positional, kwargs)
            ok, raw = await self._run_in_thread(tool, call)
            if not ok:
                if isinstance(raw, ToolCallError):
                    raise raw
                raise _raised(tool, raw) from raw
        return to_json_value(tool, raw)

    async def aclose(self) -> None:
        """Nothing to release: threads still running are daemons, abandoned with the executor."""
