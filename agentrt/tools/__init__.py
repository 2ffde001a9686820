"""The tool layer: typed tool declarations, one registry, and executors that run tools in this
process, behind HTTP endpoints, or on MQTT workers anywhere.

    from agentrt.tools import ToolRegistry, tool

    @tool
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    registry = ToolRegistry([add])
    result = await registry.call("add", {"a": 1, "b": 2})   # ToolResult(ok=True, value=3, ...)

MQTT (imported lazily, so the embedded path needs no broker): agentrt.tools.mqtt_client.MqttDispatcher,
agentrt.tools.mqtt_worker.MqttWorker, agentrt.tools.mqtt_protocol.MqttConfig.
"""
from agentrt.retry import RetryPolicy
from agentrt.tools.errors import (
    BrokerConnectionError,
    HttpToolError,
    NoExecutorError,
    NoWorkerError,
    PayloadTooLargeError,
    ToolArgumentsError,
    ToolCallError,
    ToolDefinitionError,
    ToolOutputError,
    ToolRaisedError,
    ToolTimeoutError,
    UnknownToolError,
    WorkerLostError,
)
from agentrt.tools.registry import Executor, RemoteValue, ToolRegistry
from agentrt.tools.result import ToolAttempt, ToolResult
from agentrt.tools.tool import HttpEndpoint, Tool, tool

__all__ = [
    "BrokerConnectionError", "Executor", "HttpEndpoint", "HttpToolError", "NoExecutorError", "NoWorkerError",
    "PayloadTooLargeError", "RemoteValue", "RetryPolicy", "Tool", "ToolArgumentsError", "ToolAttempt", "ToolCallError",
    "ToolDefinitionError", "ToolOutputError", "ToolRaisedError", "ToolRegistry", "ToolResult", "ToolTimeoutError",
    "UnknownToolError", "WorkerLostError", "tool",
]
