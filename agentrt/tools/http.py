"""HTTP tools: an endpoint called with aiohttp.

Connection errors, read timeouts and 5xx answers are retryable (the tool's retries and backoff
apply); 4xx answers are not (the request itself is wrong). A tool not declared idempotent is
retried, unless its retry_on says otherwise, only when connecting failed
(aiohttp.ClientConnectorError: refused, unresolvable, TLS failed), the one failure where the
request was certainly never sent; a timeout or a 5xx may come after the endpoint acted. Bodies
over the endpoint's max_response_bytes are refused while reading, before they are held in memory.
"""
from __future__ import annotations

import json
from typing import Any

import aiohttp

from agentrt.jsonutil import parse_json
from agentrt.retry import RetryOn
from agentrt.tools.errors import HttpToolError, PayloadTooLargeError, ToolDefinitionError
from agentrt.tools.tool import DEFAULT_TIMEOUT_S, HttpEndpoint, Tool

_SNIPPET = 300  # bytes of an error body quoted in the error message


def http_tool(
    name: str,
    url: str,
    *,
    description: str,
    parameters: dict[str, Any] | None = None,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    output_schema: dict[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    retries: int = 2,
    backoff_s: float = 0.2,
    idempotent: bool = False,
    retry_on: RetryOn | None = None,
    max_response_bytes: int = 1 << 20,
) -> Tool:
    """A tool served by an HTTP endpoint. POST/PUT/PATCH send the arguments as a JSON body;
    GET/DELETE send them as query parameters (non-string values JSON-encoded)."""
    if not url.startswith(("http://", "https://")):
        raise ToolDefinitionError(f"tool '{name}': url must start with http:// or https://, got {url!r}")
    method = method.upper()
    if method not in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        raise ToolDefinitionError(f"tool '{name}': unsupported HTTP method {method!r}")
    return Tool(
        name=name, description=description,
        parameters=parameters if parameters is not None else {"type": "object", "properties": {}},
        output_schema=output_schema, idempotent=idempotent, timeout_s=timeout_s, retries=retries,
        backoff_s=backoff_s, executor="http",
        retry_on=(aiohttp.ClientConnectorError,) if retry_on is None and not idempotent else retry_on,
        http=HttpEndpoint(url=url, method=method, headers=tuple((headers or {}).items()),  # type: ignore[arg-type]
                          max_response_bytes=max_response_bytes),
    )


def _query(args: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}


async def _read_limited(t: Tool, resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise PayloadTooLargeError(
            t.name, f"tool '{t.name}': response from {resp.url} is {resp.content_length} bytes, over the limit of {limit} bytes"
        )
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(
                t.name, f"tool '{t.name}': response from {resp.url} is over the limit of {limit} bytes"
            )
    return bytes(body)


def _decode(t: Tool, resp: aiohttp.ClientResponse, body: bytes) -> Any:
    text = body.decode(resp.charset or "utf-8", errors="replace")
    if resp.content_type == "application/json" or resp.content_type.endswith("+json"):
        try:
            return parse_json(text) if text.strip() else None
        except ValueError as e:
            raise HttpToolError(t.name, f"tool '{t.name}': {resp.url} sent invalid JSON: {e}", status=resp.status) from e
    return text


class HttpExecutor:
    """One aiohttp session (connection pool) for all HTTP tools, opened on first use."""

    def __init__(self, *, session: aiohttp.ClientSession | None = None, connect_timeout_s: float = 10.0) -> None:
        self._session = session
        self._owns_session = session is None
        self.connect_timeout_s = connect_timeout_s

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        return self._session

    async def execute(self, tool: Tool, args: dict[str, Any], *, timeout: float | None = None) -> Any:
        ep = tool.http
        if ep is None:
            raise ToolDefinitionError(f"tool '{tool.name}' has no HTTP endpoint (build it with http_tool())")
        # The registry bounds the whole attempt; these bound the phases when it is called
        # without one (timeout=None), so a stalled connect still ends.
        client_timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=timeout)
        body_args = {"json": args} if ep.method in ("POST", "PUT", "PATCH") else {"params": _query(args)}
        try:
            async with self._client().request(
                ep.method, ep.url, headers=dict(ep.headers), timeout=client_timeout, **body_args
            ) as resp:
                body = await _read_limited(tool, resp, ep.max_response_bytes)
                if resp.status >= 400:
                    snippet = body[:_SNIPPET].decode("utf-8", errors="replace")
                    retryable = resp.status >= 500
                    raise HttpToolError(
                        tool.name,
                        f"tool '{tool.name}': {ep.method} {ep.url} answered {resp.status} {resp.reason}: {snippet}"
                        + ("" if retryable else " (client error, not retried)"),
                        status=resp.status, retryable=retryable,
                    )
                return _decode(tool, resp, body)
        except TimeoutError as e:  # aiohttp's own phase timeouts (connect, sock_read)
            raise HttpToolError(tool.name, f"tool '{tool.name}': {ep.url} timed out: {e or 'no answer'}", retryable=True) from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise HttpToolError(
                tool.name, f"tool '{tool.name}': cannot reach {ep.url}: {type(e).__name__}: {e}", retryable=True
            ) from e

    async def aclose(self) -> None:
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None
