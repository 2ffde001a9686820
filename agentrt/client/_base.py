"""What Client and AsyncClient share besides the calls (_calls.py): the settings and key, the
rule that says whether a failed call is tried again, and the state of following a run's events
(where to resume, how long the server has been gone)."""
from __future__ import annotations

import json
import time
import warnings

import httpx2

from agentrt.client._calls import Call, RunEvent, base_url, events_path
from agentrt.client.errors import ApiError, ConnectionFailed, ServiceUnavailable, api_error
from agentrt.client.keys import env_api_key

DEFAULT_TIMEOUT = httpx2.Timeout(30.0, connect=10.0)
STREAM_TIMEOUT = httpx2.Timeout(10.0, read=60.0)  # the server pings an open stream every 15 s
RETRY_STATUSES = (429, 503)  # over a limit, or the model still loading: worth asking again after Retry-After
STREAM_LOST = (httpx2.TransportError, ServiceUnavailable, ConnectionFailed)  # the stream is picked up again
RECONNECT_PAUSE_S = 0.2


class ClientBase:
    """base_url: http://HOST:PORT. api_key: sent as a bearer token (None: $AGENTRT_API_KEY; ""
    sends none). max_retries: how often a call that failed to connect, or got 429/503, is tried
    again (a POST only when sending it twice does no harm: a start with its Idempotency-Key).
    reconnect_s: how long events() waits for a server that went away to come back."""

    def __init__(self, base_url_: str, api_key: str | None, max_retries: int, reconnect_s: float) -> None:
        if api_key is None:
            api_key, note = env_api_key()
            if note:
                warnings.warn(note, stacklevel=3)
        self.base_url, self.max_retries, self.reconnect_s = base_url(base_url_), max_retries, reconnect_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _retry_after(self, call: Call, attempt: int, *, response: httpx2.Response | None = None, text: str = "",
                     exc: Exception | None = None) -> float:
        """The pause before trying a failed call again; raises its error when it is not to be tried
        again. A call that failed to connect sent nothing, so any call may be tried again."""
        error: ApiError | ConnectionFailed
        if response is None:
            error = ConnectionFailed(f"{call.method} {self.base_url}{call.path}: cannot reach the server "
                                     f"({exc or type(exc).__name__})")
            may = call.retry_safe or isinstance(exc, httpx2.ConnectError)
            retry_after = None
        else:
            error = self._error_of(response, text)
            may, retry_after = response.status_code in RETRY_STATUSES, error.retry_after
        if not may or attempt >= self.max_retries:
            raise error from None
        return min(retry_after if retry_after is not None else 0.25 * 2 ** attempt, 10.0)

    def _error_of(self, response: httpx2.Response, text: str) -> ApiError:
        return api_error(response.status_code, text, method=response.request.method, url=str(response.request.url),
                         retry_after=response.headers.get("Retry-After"))


class EventFollower:
    """Following one run's events: the Last-Event-ID to resume after, and since when the server
    has been unreachable (ConnectionFailed past reconnect_s)."""

    def __init__(self, client: ClientBase, run_id: str, last_event_id: int) -> None:
        self.client, self.run_id, self.last = client, run_id, last_event_id
        self.lost_since: float | None = None
        self.path = events_path(run_id)

    @property
    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": str(self.last)}

    def take(self, sse: httpx2.ServerSentEvent) -> RunEvent | None:
        """The run event a server-sent event carries (None for one that is not a run event)."""
        if not sse.id or not sse.data:
            return None
        event = RunEvent(int(sse.id), sse.event, json.loads(sse.data))
        self.last, self.lost_since = event.id, None
        return event

    def lost(self, e: Exception) -> None:
        self.lost_since = self.lost_since or time.monotonic()
        if time.monotonic() - self.lost_since > self.client.reconnect_s:
            raise ConnectionFailed(f"the events of run '{self.run_id}' on {self.client.base_url}: the server was "
                                   f"gone for over {self.client.reconnect_s:g} s ({e or type(e).__name__})") from None
