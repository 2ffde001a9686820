"""A tool declaration: name, schemas, execution policy and the executor it is bound to.

Built from a typed function with `@tool`, or from an explicit OpenAI-format schema with
`Tool.from_openai`. Declarations cross process boundaries (MQTT availability messages) as
`declaration()` dicts, checked with pydantic on the way in.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import jsonschema
from pydantic import BaseModel, ValidationError

from agentrt.retry import RetryOn, RetryPolicy, retry_on_names, unsafe_retry
from agentrt.tools.errors import ToolDefinitionError
from agentrt.tools.schema import FunctionSchema, check_schema, function_schema

# OpenAI's rule for function names, plus '.' between parts (an MCP server's tools are `server.tool`);
# it also keeps MQTT topics clean
_NAME = re.compile(r"^(?=.{1,64}$)[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpEndpoint:
    """Where an HTTP tool lives. POST sends the arguments as a JSON body, GET as query parameters."""

    url: str
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    max_response_bytes: int = 1 << 20


@dataclass(frozen=True)
class McpEndpoint:
    """Where an MCP tool lives: its server (agentrt.tools.mcp.McpServerSpec) and its name there.
    policy: what the program declared for the server's tools ((field, value) pairs: idempotent,
    timeout_s, retries), applied again when the server's tool list changes."""

    server: Any
    tool: str
    policy: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, eq=False)
class Tool:
    """executor: the name of the executor that runs it in a ToolRegistry ("inprocess", "http",
    "mqtt", or one you add). idempotent: safe to run twice, so a call lost with its worker or
    broker is re-dispatched. timeout_s bounds each attempt; retries are extra attempts after a
    retryable failure, spaced by backoff_s doubling up to backoff_max_s; retry_on: the failures
    retried (exception types or their names, or a predicate; None: every retryable failure), which
    a tool not idempotent must name to be retried at all (`retry_policy`, agentrt.retry)."""

    name: str
    description: str
    parameters: dict[str, Any]
    output_schema: dict[str, Any] | None = None
    idempotent: bool = False
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    retries: int = 0
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0
    retry_on: RetryOn | None = None
    executor: str = "inprocess"
    fn: Callable[..., Any] | None = field(default=None, repr=False)
    http: HttpEndpoint | None = None
    mcp: McpEndpoint | None = None
    signature: FunctionSchema | None = field(default=None, repr=False)
    args_validator: jsonschema.protocols.Validator = field(init=False, repr=False)
    output_validator: jsonschema.protocols.Validator | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ToolDefinitionError(f"tool name {self.name!r} must be 1-64 characters of letters, digits, '_' or '-' "
                                      "(parts may be joined by '.')")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ToolDefinitionError(f"tool '{self.name}': timeout_s must be > 0 or None, got {self.timeout_s}")
        if self.retries < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ToolDefinitionError(f"tool '{self.name}': retries and backoff must be >= 0")
        try:
            object.__setattr__(self, "retry_on", RetryPolicy(retry_on=self.retry_on).retry_on)
        except ValueError as e:
            raise ToolDefinitionError(f"tool '{self.name}': {e}") from None
        problem = unsafe_retry(self.name, self.idempotent, self.retry_policy,
                               f"tool '{self.name}': retries={self.retries}")
        if problem:
            raise ToolDefinitionError(problem)
        if self.parameters.get("type", "object") != "object":
            raise ToolDefinitionError(f"tool '{self.name}': parameters must be an object schema")
        object.__setattr__(self, "args_validator", check_schema(self.parameters, tool=self.name, what="parameters"))
        out = None
        if self.output_schema is not None:
            out = check_schema(self.output_schema, tool=self.name, what="output_schema")
        object.__setattr__(self, "output_validator", out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A decorated function stays callable as plain Python."""
        if self.fn is None:
            raise ToolDefinitionError(f"tool '{self.name}' has no Python function (it runs on '{self.executor}')")
        return self.fn(*args, **kwargs)

    @property
    def retry_policy(self) -> RetryPolicy:
        """The tool's own retries as a policy (a node's `retry=` is laid over it)."""
        return RetryPolicy(max_attempts=self.retries + 1, backoff_s=self.backoff_s, backoff_factor=2.0,
                           max_backoff_s=self.backoff_max_s, retry_on=self.retry_on)

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def declaration(self) -> dict[str, Any]:
        """What a worker announces about the tool (JSON)."""
        return ToolDeclaration(
            name=self.name, description=self.description, parameters=self.parameters,
            output_schema=self.output_schema, idempotent=self.idempotent, timeout_s=self.timeout_s,
            retries=self.retries, backoff_s=self.backoff_s, backoff_max_s=self.backoff_max_s,
            # a predicate cannot cross: the worker applies it (failures it rejects come back not
            # retryable), so what it lets through comes back as the tool having raised
            retry_on=["agentrt.tools.errors.ToolRaisedError"] if callable(self.retry_on)
            else retry_on_names(self.retry_on),
        ).model_dump()

    def bind(self, executor: str, **changes: Any) -> Tool:
        """The same declaration run by another executor (e.g. a local tool served by MQTT workers)."""
        return dataclasses.replace(self, executor=executor, **changes)

    @classmethod
    def from_declaration(cls, data: Any, *, executor: str) -> Tool:
        try:
            d = ToolDeclaration.model_validate(data)
        except ValidationError as e:
            raise ToolDefinitionError(f"bad tool declaration: {e}") from e
        return cls(
            name=d.name, description=d.description, parameters=d.parameters, output_schema=d.output_schema,
            idempotent=d.idempotent, timeout_s=d.timeout_s, retries=d.retries, backoff_s=d.backoff_s,
            backoff_max_s=d.backoff_max_s, retry_on=None if d.retry_on is None else tuple(d.retry_on),
            executor=executor,
        )

    @classmethod
    def from_openai(cls, spec: Any, *, fn: Callable[..., Any] | None = None, executor: str | None = None, **policy: Any) -> Tool:
        """From {"type": "function", "function": {name, description, parameters}} (or the inner
        object). `fn`, if given, is called with the validated arguments as keywords."""
        try:
            inner = spec.get("function", spec) if isinstance(spec, dict) else spec
            s = OpenAIFunction.model_validate(inner)
        except (ValidationError, AttributeError) as e:
            raise ToolDefinitionError(f"bad OpenAI tool schema: {e}") from e
        return cls(
            name=s.name, description=s.description, parameters=s.parameters, fn=fn,
            executor=executor or "inprocess", **policy,
        )


class OpenAIFunction(BaseModel):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}


class ToolDeclaration(BaseModel):
    name: str
    description: str = ""
    parameters: dict[str, Any]
    output_schema: dict[str, Any] | None = None
    idempotent: bool = False
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    retries: int = 0
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0
    retry_on: list[str] | None = None  # exception type names


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    idempotent: bool = False,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    retries: int = 0,
    backoff_s: float = 0.1,
    retry_on: RetryOn | None = None,
    output_schema: dict[str, Any] | None = None,
    executor: str = "inprocess",
) -> Any:
    """Declare a tool from a typed function: `@tool`, `@tool(idempotent=True)` or `tool(fn)`.

    Type hints (pydantic models, Annotated[..., Field(description=...)], Literal, ...) become the
    parameter schema; the docstring becomes the description (an `Args:` section describes the
    parameters); the return annotation becomes the output schema unless one is given."""

    def build(f: Callable[..., Any]) -> Tool:
        if not callable(f):
            raise ToolDefinitionError(f"@tool needs a function, got {f!r}")
        tool_name = name or getattr(f, "__name__", "")
        sig = function_schema(f, name=tool_name)
        if not (description or sig.description):
            raise ToolDefinitionError(f"tool '{tool_name}': give it a docstring or description= (the model reads it)")
        return Tool(
            name=tool_name, description=description or sig.description, parameters=sig.parameters,
            output_schema=output_schema if output_schema is not None else sig.output_schema,
            idempotent=idempotent, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, retry_on=retry_on,
            executor=executor, fn=f, signature=sig,
        )

    if fn is not None:
        return build(fn)
    return build


def is_coroutine_tool(t: Tool) -> bool:
    fn = t.fn
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
