"""Errors of the tool layer. Each names the tool at fault and says what went wrong.

A failed call does not raise out of `ToolRegistry.call`: the error becomes `ToolResult.error`
(the agent program decides what to do with it) and `ToolResult.unwrap()` raises it.
`kind` is a stable string for traces and for errors that cross the wire (MQTT workers).
"""
from __future__ import annotations

from agentrt.errors import AgentRTError
from agentrt.retry import exception_names


class ToolDefinitionError(AgentRTError, ValueError):
    """A tool is declared wrongly (bad schema, unsupported signature, duplicate name)."""


class MqttConfigError(AgentRTError, ValueError):
    """A bad broker URL or MQTT option."""


class ToolCallError(AgentRTError):
    """A tool call failed. `retryable`: another attempt may succeed (the tool's retries apply).
    `lost`: the call was lost by the infrastructure (worker died, broker went away), so an
    idempotent tool is re-dispatched whatever its retry count."""

    kind = "tool_error"
    retryable = False
    lost = False
    worker: str | None = None  # the MQTT worker that reported or lost the call, if any

    def __init__(self, tool: str, message: str, *, retryable: bool | None = None, lost: bool | None = None) -> None:
        super().__init__(message)
        self.tool = tool
        self.message = message
        if retryable is not None:
            self.retryable = retryable
        if lost is not None:
            self.lost = lost

    raised: tuple[str, ...] = ()  # a remote tool's exception, by name (retry.exception_names)

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "message": self.message, "retryable": self.retryable}
        names = exception_names(self.__cause__) if self.__cause__ is not None else self.raised
        if names:
            out["raised"] = list(names)  # so that the caller's retry_on can match it by name
        return out


class UnknownToolError(ToolCallError, KeyError):
    kind = "unknown_tool"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class ToolArgumentsError(ToolCallError, ValueError):
    """The arguments do not match the tool's parameter schema; the tool was not executed."""

    kind = "invalid_arguments"


class NoExecutorError(ToolCallError):
    """The tool is bound to an executor the registry does not have."""

    kind = "no_executor"


class PayloadTooLargeError(ToolCallError, ValueError):
    kind = "payload_too_large"


class ToolTimeoutError(ToolCallError):
    kind = "timeout"
    retryable = True


class ToolRaisedError(ToolCallError):
    """The tool's own code raised. Retryable: the tool's `retries` decide how often."""

    kind = "tool_raised"
    retryable = True


class ToolOutputError(ToolCallError, ValueError):
    """The tool returned a value that is not JSON or breaks its output schema."""

    kind = "invalid_output"


class HttpToolError(ToolCallError):
    """An HTTP tool's endpoint answered with an error status or could not be reached."""

    kind = "http_error"

    def __init__(self, tool: str, message: str, *, status: int | None = None, retryable: bool | None = None) -> None:
        super().__init__(tool, message, retryable=retryable)
        self.status = status


class NoWorkerError(ToolCallError):
    """No MQTT worker serving the tool is online."""

    kind = "no_worker"
    retryable = True


class WorkerLostError(ToolCallError):
    """The worker running the call went offline (or no worker took the call)."""

    kind = "worker_lost"
    lost = True


class BrokerConnectionError(ToolCallError):
    """The MQTT broker could not be reached, or the connection dropped with the call in flight."""

    kind = "broker_lost"
    lost = True


class RemoteToolError(ToolCallError):
    """An error reported by a remote worker whose kind this side does not know."""


_KINDS: dict[str, type[ToolCallError]] = {
    cls.kind: cls
    for cls in (
        UnknownToolError, ToolArgumentsError, NoExecutorError, PayloadTooLargeError, ToolTimeoutError, ToolRaisedError,
        ToolOutputError, HttpToolError, NoWorkerError, WorkerLostError, BrokerConnectionError,
    )
}


def error_from_dict(tool: str, data: dict) -> ToolCallError:
    """Rebuild an error that a worker sent as `ToolCallError.to_dict()`."""
    cls = _KINDS.get(str(data.get("kind")), RemoteToolError)
    err = cls(tool, str(data.get("message", "remote tool error")), retryable=bool(data.get("retryable", False)))
    if cls is RemoteToolError:
        err.kind = str(data.get("kind", "tool_error"))
    raised = data.get("raised")
    if isinstance(raised, list):
        err.raised = tuple(str(n) for n in raised[:64])
    return err
