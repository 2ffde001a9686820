"""A run as the server holds it: its status, its event log (recorded in the store before any
client reads it) and how a client waits for the next event."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from agentrt.runtime.store import NullRunStore, RunStore
from agentrt.server.replicas import follow_store

ENDED = ("done", "failed", "cancelled")


@dataclass
class ServedRun:
    run_id: str
    program: str
    inputs: dict[str, Any]
    metadata: dict[str, str]
    priority: float
    created_at: float  # unix seconds
    seq: int  # submission order (list order, cursors)
    idempotency_key: str | None = None
    request_digest: str = ""
    status: str = "queued"
    started_at: float | None = None
    ended_at: float | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    trace_path: Path | None = None
    events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)  # (id, type, data)
    task: asyncio.Task | None = None
    handle: Any = None  # the runtime's RunHandle once started
    store: RunStore = field(default_factory=NullRunStore)  # where its events are recorded
    interrupted: bool = False  # stopped by a shutdown, to be resumed by the next start
    store_lost: bool = False  # a write of it failed (the store unavailable): stopping, resumed when it is back
    remote: bool = False  # another replica owns it: what is shown is read back from the store
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def add_event(self, type: str, data: Mapping[str, Any]) -> None:
        event = (len(self.events) + 1, type, dict(data))
        self.store.add_event(self.run_id, *event)  # recorded before any client can read it
        self.events.append(event)
        self._changed.set()

    async def changed(self, after: int, timeout: float | None = None) -> bool:
        """Wait until the log has an event past id `after` or the run ended; False on timeout."""
        if self.remote:
            return await follow_store(self, after, timeout)
        while len(self.events) <= after and not self.ended:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                return False
        return True
