"""Each API call as a description (method, path, body, how to read the answer) that the sync and
async clients carry out, the records they return, and the server and run URLs they take."""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import quote, urlsplit

import httpx2

from agentrt.client.errors import BadUrl, RunFailed, RunNotEnded
from agentrt.client.schemas import ProgramList, RunCreate, RunInfo, RunInput, RunList

DEFAULT_TIMEOUT = httpx2.Timeout(30.0, connect=10.0)
WAIT_CHUNK_S = 30  # one GET .../wait holds at most this long; wait() asks again until its own deadline


@dataclass(frozen=True)
class RunEvent:
    """One event of a run's log: id (1, 2, ... in order; resume after it with Last-Event-ID), type
    (run_queued, node_started, token, node_finished, input_wanted, run_finished, ...) and data."""

    id: int
    type: str
    data: dict[str, Any]


@dataclass(frozen=True)
class StartedRun:
    """A started run: created is False when its Idempotency-Key named a run started before."""

    run_id: str
    status: str
    created: bool
    idempotency_key: str


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    read: Callable[[httpx2.Response], Any]
    params: Mapping[str, Any] | None = None
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout: httpx2.Timeout | None = None
    retry_safe: bool = False  # sending it twice does no harm (a GET, a POST with an Idempotency-Key)


def _path(*parts: str) -> str:
    return "/v1/" + "/".join(quote(p, safe="") for p in parts)


def _info(r: httpx2.Response) -> RunInfo:
    return RunInfo.model_validate(r.json())


def list_programs() -> Call:
    return Call("GET", "/v1/programs", lambda r: ProgramList.model_validate(r.json()).data, retry_safe=True)


def start_run(program: str, inputs: Mapping[str, Any] | None, priority: float | None,
              metadata: Mapping[str, str] | None, idempotency_key: str | None) -> Call:
    # a key of our own when none is given, so a retried POST cannot start a second run
    key = idempotency_key if idempotency_key is not None else f"agentrt-client-{uuid.uuid4().hex}"
    body = RunCreate(inputs=dict(inputs or {}), priority=priority,
                     metadata=None if metadata is None else dict(metadata))
    return Call("POST", _path("programs", program, "runs"),
                lambda r: StartedRun(r.json()["run_id"], r.json()["status"], r.status_code == 201, key),
                json=body.model_dump(exclude_none=True), headers={"Idempotency-Key": key}, retry_safe=True)


def get_run(run_id: str) -> Call:
    return Call("GET", _path("runs", run_id), _info, retry_safe=True)


def list_runs(program: str | None, status: str | None, limit: int, cursor: str | None) -> Call:
    params = {k: v for k, v in {"program": program, "status": status, "limit": limit, "cursor": cursor}.items()
              if v is not None}
    return Call("GET", "/v1/runs", lambda r: RunList.model_validate(r.json()), params=params, retry_safe=True)


def wait_once(run_id: str, seconds: float) -> Call:
    hold = max(0, min(WAIT_CHUNK_S, math.ceil(seconds)))
    return Call("GET", _path("runs", run_id, "wait"), _info, params={"timeout": hold},
                timeout=httpx2.Timeout(hold + 30.0, connect=10.0), retry_safe=True)


def provide_input(run_id: str, node: str, value: Any, by: str | None) -> Call:
    # not retry-safe: a value the run took once must not be offered again
    body = {**RunInput(value=value).model_dump(), **({"by": by} if by is not None else {})}
    return Call("POST", _path("runs", run_id, "input", node), _info, json=body)


def cancel(run_id: str) -> Call:
    return Call("POST", _path("runs", run_id, "cancel"), _info)


def trace(run_id: str) -> Call:
    return Call("GET", _path("runs", run_id, "trace"), read_jsonl, retry_safe=True)


def events_path(run_id: str) -> str:
    return _path("runs", run_id, "events")


def read_jsonl(r: httpx2.Response) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def output_of(info: RunInfo) -> Any:
    if info.status == "done":
        return info.output
    if info.ended:
        raise RunFailed(info)
    raise RunNotEnded(f"run '{info.run_id}' has not ended (status {info.status}): it has no output yet")


def base_url(url: str) -> str:
    """The server's base URL, checked: http(s)://HOST[:PORT][/PREFIX]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadUrl(f"not a server URL: {url!r} (write http://HOST:PORT)")
    return url.rstrip("/")


def split_run_url(url: str) -> tuple[str, str]:
    """(server base URL, run id) from a run's URL, http://HOST:PORT/v1/runs/RUN_ID."""
    head, sep, tail = url.rstrip("/").rpartition("/v1/runs/")
    run_id = tail.split("/")[0] if sep else ""
    if not sep or not run_id:
        raise BadUrl(f"not a run URL: {url!r} (write http://HOST:PORT/v1/runs/RUN_ID)")
    return base_url(head), run_id
