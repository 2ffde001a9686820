"""The server's settings: one frozen dataclass, filled from `agentrt serve`'s flags."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from agentrt.runtime.store_location import PostgresLocation


@dataclass(frozen=True)
class Limits:
    """Caps on what one client can ask for; over a cap the request gets a 4xx naming it."""

    max_body_bytes: int = 4 * 1024 * 1024  # 413 past this
    max_messages: int = 256  # chat messages per request
    max_tokens: int = 4096  # a chat request's max_tokens (and the default when it gives none: 1024)
    default_max_tokens: int = 1024
    max_tool_schema_bytes: int = 64 * 1024  # the request's `tools` and response_format schema, as JSON
    max_n: int = 8  # choices per chat request
    max_sse_connections: int = 256  # open event streams (run events and streamed chat completions)
    max_running_runs: int = 64  # program runs executing at once
    max_queued_runs: int = 256  # program runs admitted but waiting for a running slot; past this 429
    max_inflight_chats: int = 256  # chat completions being generated at once; past this 429
    retry_after_s: int = 1  # the Retry-After of a 429


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never printed
    limits: Limits = Limits()
    runs_dir: Path = Path("runs/serve")  # each finished run's trace, as `agentrt inspect` reads it
    # finished runs kept in memory, each with its event log and summary (~130 KB for the example
    # programs); older ones are read back from the run store or their trace file when asked for
    keep_runs: int = 200
    # the run store: a SQLite file or a PostgreSQL database (None: runs live in memory only)
    db: Path | PostgresLocation | None = Path("runs/serve/agentrt.db")
    store_retry_s: float = 1.0  # while the store is unavailable, how often a run it stopped tries to resume
    # on a PostgreSQL store: how long a replica's hold on its runs lasts unless renewed (it beats
    # every lease_s/3); a replica dead this long has its runs taken over by another
    lease_s: float = 10.0
    allow_changed_programs: bool = False  # resume runs whose program file changed since they started
    prune_after_s: float | None = None  # delete ended runs (store rows and traces) this long after they end
    prune_keep: int | None = None  # ... and beyond the newest this many ended runs
    cors_origins: tuple[str, ...] = ()  # CORS off unless origins are given
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight work gets this long, then is cancelled
    access_log: bool = True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
