"""The embedded executor: runs a tool's Python function in this process.

async functions run on the event loop; sync ones in a thread pool so a blocking tool does not
stall the loop. Timeouts and retries are the registry's; cancelling the call cancels an async
tool, while a sync one cannot be interrupted: its thread finishes and the result is dropped.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic_core
from pydantic import ValidationError

from agentrt.tools.errors import ToolArgumentsError, ToolCallError, ToolDefinitionError, ToolOutputError, ToolRaisedError
from agentrt.tools.tool import Tool, is_coroutine_tool


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


class InProcessExecutor:
    """max_threads: how many sync tools may block at once (each holds a thread)."""

    def __init__(self, *, max_threads: int = 32) -> None:
        self.max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_threads, thread_name_prefix="agentrt-tool")
        return self._pool

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
            loop = asyncio.get_running_loop()
            ctx = contextvars.copy_context()
            call = functools.partial(ctx.run, _run_sync, tool.fn, positional, kwargs)
            ok, raw = await loop.run_in_executor(self._threads(), call)
            if not ok:
                if isinstance(raw, ToolCallError):
                    raise raw
                raise _raised(tool, raw) from raw
        return to_json_value(tool, raw)

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
