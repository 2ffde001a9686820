"""One registry for every executor: look a tool up, validate its arguments, dispatch, retry.

`call()` never raises for a failed call (unknown tool, bad arguments, a tool that raised, a lost
worker): the failure is the ToolResult's error, so one bad tool call cannot take the runtime
down. Cancelling the task running `call()` cancels the call.

The embedded default: a tool bound to an executor this registry does not have (say "mqtt"
with no broker configured) runs in this process when it has a Python function, so the same
tool module works with and without workers.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, runtime_checkable

from agentrt.jsonutil import MAX_JSON_DEPTH, JsonDepthError, json_depth
from agentrt.retry import RetryPolicy
from agentrt.tools.errors import (
    NoExecutorError,
    ToolCallError,
    ToolDefinitionError,
    ToolOutputError,
    ToolRaisedError,
    ToolTimeoutError,
    UnknownToolError,
)
from agentrt.tools.progress import CALL_PROGRESS, ToolProgress
from agentrt.tools.result import ToolAttempt, ToolResult
from agentrt.tools.schema import check_size, describe_errors, parse_arguments, validate_arguments
from agentrt.tools.tool import Tool, tool as make_tool

_UNSET: Any = object()


@runtime_checkable
class Executor(Protocol):
    async def execute(self, tool: Tool, args: dict[str, Any], *, timeout: float | None) -> Any:
        """Run one attempt and return the JSON-compatible value (or a RemoteValue); raise a
        ToolCallError subclass on failure. `timeout` is a hint to pass on (the registry enforces it)."""
        ...


@dataclass(frozen=True)
class RemoteValue:
    """What an executor returns when it knows who ran the call and when, on that side's clock."""

    value: Any
    worker: str | None = None
    started: float | None = None
    finished: float | None = None


_BUILTIN = ("inprocess", "http", "mcp")  # created on first use


def _default_executor(name: str, registry: ToolRegistry) -> Any:
    if name == "inprocess":
        from agentrt.tools.inprocess import InProcessExecutor

        return InProcessExecutor()
    if name == "http":
        from agentrt.tools.http import HttpExecutor

        return HttpExecutor()
    if name == "mcp":  # it keeps the registry in step with its servers' tool lists
        from agentrt.tools.mcp.executor import McpExecutor

        return McpExecutor(registry)
    return None


class ToolRegistry:
    """max_args_bytes / max_result_bytes: JSON-encoded size limits (None: no limit).
    max_redispatches: how often a lost call of an idempotent tool is sent again."""

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        *,
        executors: Mapping[str, Executor] | None = None,
        max_args_bytes: int | None = 1 << 20,
        max_result_bytes: int | None = 1 << 20,
        max_redispatches: int = 3,
    ) -> None:
        self._tools: dict[str, Tool] = {}
        self._gone: dict[str, str] = {}  # tools their source withdrew -> why (for the unknown-tool error)
        self._executors: dict[str, Any] = dict(executors or {})
        self.max_args_bytes = max_args_bytes
        self.max_result_bytes = max_result_bytes
        self.max_redispatches = max_redispatches
        for t in tools:
            self.register(t)

    # -- declarations -------------------------------------------------------------------------
    def register(self, t: Tool | Callable[..., Any], *, executor: str | None = None, replace: bool = False) -> Tool:
        """Add a Tool (or a plain typed function, made a Tool with @tool defaults). `executor`
        rebinds it, e.g. register(get_weather, executor="mqtt") to run it on workers."""
        if not isinstance(t, Tool):
            t = make_tool(t)
        if executor is not None and executor != t.executor:
            t = t.bind(executor)
        if t.name in self._tools and not replace:
            raise ToolDefinitionError(f"tool '{t.name}' is already registered (pass replace=True to replace it)")
        self._tools[t.name] = t
        self._gone.pop(t.name, None)
        return t

    def unregister(self, name: str, *, reason: str | None = None) -> None:
        """Remove a tool; `reason` (e.g. "MCP server 'files' no longer lists it") is what a later
        call of it is told."""
        self.get(name)
        del self._tools[name]
        if reason is not None:
            self._gone[name] = reason

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            if name in self._gone:
                raise UnknownToolError(name, f"tool '{name}' is gone: {self._gone[name]}") from None
            known = ", ".join(sorted(self._tools)) or "none"
            raise UnknownToolError(name, f"unknown tool '{name}' (known tools: {known})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def names(self) -> list[str]:
        return list(self._tools)

    def openai_schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The tools in OpenAI format, for the model's prompt."""
        return [self.get(n).openai_schema() for n in (self._tools if names is None else names)]

    # -- executors ----------------------------------------------------------------------------
    def add_executor(self, name: str, executor: Executor) -> None:
        if not isinstance(executor, Executor):
            raise ToolDefinitionError(f"executor '{name}' has no async execute(tool, args, *, timeout) method")
        self._executors[name] = executor

    def executor(self, name: str) -> Any:
        """The executor called `name` (inprocess and http are created on first use)."""
        ex = self._executors.get(name)
        if ex is None:
            ex = _default_executor(name, self)
            if ex is None:
                known = ", ".join(sorted(set(self._executors) | set(_BUILTIN)))
                raise NoExecutorError(name, f"no executor named '{name}' (configured: {known}); add it with add_executor()")
            self._executors[name] = ex
        return ex

    async def aclose(self) -> None:
        for ex in self._executors.values():
            close = getattr(ex, "aclose", None)
            if close is not None:
                await close()

    async def __aenter__(self) -> ToolRegistry:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- calls --------------------------------------------------------------------------------
    async def call(
        self,
        name: str,
        args: Any = None,
        *,
        call_id: str | None = None,
        timeout_s: float | None = _UNSET,
        retries: int | None = None,
        retry: RetryPolicy | None = None,
        on_attempt: Callable[[ToolAttempt], None] | None = None,
        on_progress: Callable[[ToolProgress], None] | None = None,
    ) -> ToolResult:
        """Validate `args` (a dict or the model's JSON text), then run the tool on its executor.
        timeout_s overrides the tool's timeout for this call; retry (a node's policy) is laid over
        the tool's own (Tool.retry_policy), and retries, if given, sets the attempts after the
        first. on_attempt(attempt) is called as each attempt ends, the last one included;
        on_progress(ToolProgress) as the tool reports progress (executors that carry it: mcp)."""
        queued = time.time()
        call_id = call_id or uuid.uuid4().hex
        attempts: list[ToolAttempt] = []

        def result(value: Any = None, error: ToolCallError | None = None) -> ToolResult:
            return ToolResult(
                call_id=call_id, tool=name, ok=error is None, value=value, error=error, attempts=tuple(attempts),
                queued=queued, started=attempts[0].started if attempts else None, finished=time.time(),
            )

        try:
            t = self.get(name)
            args = parse_arguments(name, args)
            check_size(name, "arguments", args, self.max_args_bytes)
            validate_arguments(name, t.args_validator, args)
            where, executor = self._resolve(t)
        except ToolCallError as e:
            return result(error=e)
        timeout = t.timeout_s if timeout_s is _UNSET else timeout_s
        policy = t.retry_policy if retry is None else retry.over(t.retry_policy)
        if retries is not None:
            policy = replace(policy, max_attempts=retries + 1)
        failures = redispatches = 0
        while True:
            started = time.time()
            try:
                remote = await self._attempt(t, executor, args, timeout, len(attempts) + 1, on_progress)
            except ToolCallError as e:
                failed = ToolAttempt(
                    index=len(attempts) + 1, executor=where, started=started, finished=time.time(), ok=False,
                    error_kind=e.kind, error=e.message, worker=e.worker,
                )
                if e.lost and t.idempotent and redispatches < self.max_redispatches:
                    redispatches += 1
                    wait = 0.0
                else:
                    why = _not_retried(t, policy, e, failures)
                    if why is not None:
                        attempts.append(replace(failed, not_retried=why))
                        if on_attempt is not None:
                            on_attempt(attempts[-1])
                        return result(error=e)
                    failures += 1
                    wait = policy.backoff(failures)
                attempts.append(replace(failed, backoff_s=wait))
                if on_attempt is not None:
                    on_attempt(attempts[-1])
                if wait:
                    await asyncio.sleep(wait)
                continue
            attempts.append(ToolAttempt(
                index=len(attempts) + 1, executor=where, started=started, finished=time.time(), ok=True,
                worker=remote.worker, remote_started=remote.started, remote_finished=remote.finished,
            ))
            if on_attempt is not None:
                on_attempt(attempts[-1])
            return result(value=remote.value)

    def _resolve(self, t: Tool) -> tuple[str, Any]:
        if t.executor not in self._executors and t.executor not in _BUILTIN and t.fn is not None:
            return "inprocess", self.executor("inprocess")  # the embedded default, see the module docstring
        return t.executor, self.executor(t.executor)

    async def _attempt(self, t: Tool, executor: Any, args: dict[str, Any], timeout: float | None, n: int,
                       on_progress: Callable[[ToolProgress], None] | None = None) -> RemoteValue:
        timer = asyncio.timeout(timeout)
        progress = CALL_PROGRESS.set(on_progress)  # the executor, awaited in this task, reads it
        try:
            async with timer:
                raw = await executor.execute(t, args, timeout=timeout)
        except ToolCallError:
            raise
        except TimeoutError as e:
            if timer.expired():
                raise ToolTimeoutError(t.name, f"tool '{t.name}' timed out after {timeout:g}s (attempt {n})") from None
            raise ToolRaisedError(t.name, f"tool '{t.name}' raised TimeoutError: {e}") from e
        except Exception as e:  # noqa: BLE001 - an executor that did not classify its error
            raise ToolRaisedError(t.name, f"tool '{t.name}' failed on executor '{t.executor}': {type(e).__name__}: {e}") from e
        finally:
            CALL_PROGRESS.reset(progress)
        remote = raw if isinstance(raw, RemoteValue) else RemoteValue(raw)
        self.check_output(t, remote.value)
        return remote

    def check_output(self, t: Tool, value: Any) -> None:
        """Depth, output schema and size limit; ToolOutputError / PayloadTooLargeError (not retried)."""
        if json_depth(value) > MAX_JSON_DEPTH:  # the validator and the size check below recurse
            raise ToolOutputError(t.name, f"tool '{t.name}' returned a value {JsonDepthError(MAX_JSON_DEPTH)}")
        if t.output_validator is not None:
            errors = list(t.output_validator.iter_errors(value))
            if errors:
                detail = describe_errors(errors, noun="field")
                raise ToolOutputError(t.name, f"tool '{t.name}' returned a value that breaks its output schema: {detail}")
        check_size(t.name, "the result", value, self.max_result_bytes)


def _not_retried(t: Tool, policy: RetryPolicy, error: ToolCallError, failures: int) -> str | None:
    """Why this failed attempt ends the call, or None when it is tried again."""
    if error.lost and not error.retryable:
        return ("the call was lost and re-dispatched as often as allowed" if t.idempotent else
                f"the call was lost and '{t.name}' is not declared idempotent, so it is not sent again")
    if not error.retryable:
        return f"a failure of kind {error.kind} is not retried"
    if failures >= policy.retries:
        return f"no attempts left (max_attempts={policy.retries + 1})"
    if not policy.allows(error):
        raised = type(error.__cause__).__name__ if error.__cause__ is not None else \
            error.raised[0] if error.raised else None  # a remote tool's, by name
        cause = f" (raised {raised})" if raised else ""
        return f"retry_on ({policy.describe_retry_on()}) does not cover {type(error).__name__}{cause}"
    return None
