"""Several `agentrt serve` replicas on one PostgreSQL run store: who runs which run.

A replica (one server process) registers itself in the store, owns the runs it starts or resumes
under a lease (store_leases.py), and every lease/3 seconds beats: it renews its row and its runs'
leases, acts on the cancels and inputs other replicas recorded for its runs, stops any run another
replica took over from it (its lease had lapsed: this process was stalled past it), and takes
over the runs whose lease lapsed (their owner died) or that nobody owns (their owner shut down
cleanly), resuming them as after a restart: finished nodes are taken from the store, an
interrupted non-idempotent tool fails its node.

A run another replica owns is served from the store (`RemoteRun`): its status and events are read
back while a client follows it; a cancel or an input to it is recorded there for its owner.

With a SQLite store (one machine, one process) there is no replica: the server owns every run.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema

from agentrt.errors import InputValueError, RunConfigError
from agentrt.runtime.store import ENDED, StoreUnavailable
from agentrt.runtime.trace import new_id
from agentrt.server.errors import ApiError

if TYPE_CHECKING:
    from agentrt.runtime.store_leases import LeaseStore
    from agentrt.server.runs import RunManager, ServedRun

log = logging.getLogger("agentrt.server")
REMOTE_POLL_S = 0.25  # how often a run owned elsewhere is read back while a client follows it


@dataclass(frozen=True)
class RemoteWait:
    """A wait_for node of a run owned by another replica, as its input_wanted event gave it."""

    schema: dict[str, Any]
    prompt: str | None


def remote_waiting(run: ServedRun) -> dict[str, RemoteWait]:
    """The wait_for nodes a run's event log says wait now (wanted, not yet given)."""
    waiting: dict[str, RemoteWait] = {}
    for _, type, data in run.events:
        if type == "input_wanted":
            waiting[data["node"]] = RemoteWait(data.get("schema") or {}, data.get("prompt"))
        elif type in ("input_given", "node_finished"):
            waiting.pop(data.get("node"), None)
    return waiting


def check_forwarded_input(run: ServedRun, node: str, value: Any) -> None:
    """What the owner would refuse, refused here, before the input is recorded for it:
    RunConfigError (not waiting at that node) or InputValueError (the schema says no)."""
    waiting = remote_waiting(run) if run.status == "waiting" else {}
    if node not in waiting:
        raise RunConfigError(f"run '{run.run_id}' is not waiting for input at node '{node}' "
                             f"(nodes waiting for input: {', '.join(sorted(waiting)) or 'none'})")
    errors = sorted(jsonschema.Draft202012Validator(waiting[node].schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path)
        raise InputValueError(f"input for node '{node}'{' at ' + where if where else ''}: {errors[0].message}")


async def follow_store(run: ServedRun, after: int, timeout: float | None) -> bool:
    """ServedRun.changed() for a run another replica owns: its store rows, read back every REMOTE_POLL_S."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        read_back(run)
        if len(run.events) > after or run.ended:
            return True
        if deadline is not None and loop.time() >= deadline:
            return False
        left = REMOTE_POLL_S if deadline is None else max(0.0, deadline - loop.time())
        await asyncio.sleep(min(REMOTE_POLL_S, left))


def read_back(run: ServedRun) -> None:
    """Take the run's status and events from the store (where its owner writes them)."""
    stored = run.store.get_run(run.run_id)
    if stored is None:  # pruned
        return
    run.events = run.events + run.store.events_after(run.run_id, len(run.events))  # ids run 1, 2, ...
    # ended once its last event is recorded too (an owner records the end, then run_finished)
    if stored.status in ENDED and not any(t == "run_finished" for _, t, _ in run.events[-3:]) \
            and time.time() - (stored.ended_at or 0) < 2 * REMOTE_POLL_S + 1:
        return
    run.status, run.started_at, run.ended_at = stored.status, stored.started_at, stored.ended_at
    run.output, run.error = stored.output, stored.error


def list_from_store(runs: RunManager, program: str | None, status: str | None, limit: int,
                    cursor: str | None) -> tuple[list[ServedRun], str | None]:
    """GET /v1/runs on a replica: the runs of every replica, newest first, from the store (those
    this one holds from memory)."""
    page = runs.store.runs_page(program, status, limit + 1, cursor)
    if page is None:
        raise ApiError(400, f"cursor '{cursor}' names no run", param="cursor")
    served = [runs.runs.get(stored.run_id) or runs.view(stored) for stored in page[:limit]]
    return served, (served[-1].run_id if len(page) > limit else None)


class Replica:
    def __init__(self, runs: RunManager, store: LeaseStore, lease_s: float, replica_id: str | None = None) -> None:
        """replica_id: the same on each start of this server (its host and port: a port can be
        bound by one process at a time, so a replica starting under an id is the only one alive
        with it), so a restarted replica takes its own runs back at once; default: a new id."""
        if lease_s <= 0:
            raise RunConfigError(f"--lease-s must be positive, got {lease_s:g}")
        self.runs, self.store, self.lease_s = runs, store, lease_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.id = replica_id or f"{self.host}-{self.pid}-{new_id(4)}"
        store.fence_owner = self.id  # its writes of a run another replica took over are refused
        self._task: asyncio.Task | None = None

    def start(self) -> list[str]:
        """Register, take over the runs nobody holds, and beat from now on; the ids resumed."""
        self.store.register_replica(self.id, self.host, self.pid, self.lease_s)
        resumed = self.take_over(restarted=True)
        self._task = asyncio.get_running_loop().create_task(self._beat_forever(), name="agentrt-replica-heartbeat")
        log.info("replica %s: lease %g s, %d run(s) taken over", self.id, self.lease_s, len(resumed))
        return resumed

    async def stop(self) -> None:
        """A clean shutdown (its runs already stopped): release every lease, leave the list."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            self.store.unregister_replica(self.id)
        except StoreUnavailable as e:  # the leases lapse by themselves
            log.warning("replica %s: could not release its runs (%s); they are taken over when their leases lapse",
                        self.id, e)

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                self.beat()
            except StoreUnavailable as e:  # its runs stop on their own failed writes; leases may lapse
                log.warning("replica %s: heartbeat failed: %s", self.id, e)
            except Exception:  # noqa: BLE001 - the heartbeat goes on whatever one beat hit
                log.exception("replica %s: heartbeat failed", self.id)

    def beat(self) -> None:
        found = self.store.heartbeat(self.id, self.lease_s)
        for run in list(self.runs.runs.values()):
            if not run.ended and not run.store_lost and run.run_id not in found.owned:
                self._lost(run)
        for run_id in found.cancels:
            run = self.runs.runs.get(run_id)
            if run is not None and not run.ended:
                log.info("run %s: cancelled through another replica", run_id)
                self.runs.cancel(run)
        for given in found.inputs:
            run = self.runs.runs.get(given.run_id)
            try:
                if run is None or run.ended:
                    raise RunConfigError(f"run '{given.run_id}' is not running here")
                self.runs.provide_input(run, given.node, given.value, by=given.by)
            except (RunConfigError, InputValueError) as e:  # checked when recorded: it went stale since
                log.warning("run %s: an input for node %s given through another replica was not taken: %s",
                            given.run_id, given.node, e)
        self.take_over()

    def take_over(self, *, restarted: bool = False) -> list[str]:
        """Claim and resume the unfinished runs whose lease lapsed, as many as there is room for."""
        if not self.runs.accepting:
            return []
        limits = self.runs.limits
        room = limits.max_running_runs + limits.max_queued_runs - self.runs.running - self.runs.queued
        if room <= 0:
            return []
        resumed = []
        for run_id in self.store.claim_lapsed(self.id, self.lease_s, room, restarted=restarted):
            stored = self.store.get_run(run_id)
            if stored is None:  # pruned meanwhile
                continue
            log.info("run %s: taken over (its owner's lease lapsed), resuming it", run_id)
            self.runs.runs.pop(run_id, None)  # a view of it from before, when another replica ran it
            if self.runs.resume_stored(stored):
                resumed.append(run_id)
        return resumed

    def claim(self, run_id: str) -> bool:
        return self.store.claim_run(run_id, self.id, self.lease_s)

    def release(self, run_id: str) -> None:
        try:
            self.store.release_run(run_id, self.id)
        except StoreUnavailable as e:  # the run's end is recorded; the lease just lapses
            log.warning("run %s: its lease was not released: %s", run_id, e)

    def _lost(self, run: ServedRun) -> None:
        """Another replica took this run over (this one missed its leases): stop running it here."""
        log.warning("run %s: taken over by another replica (this one's lease lapsed); stopping it here", run.run_id)
        run.interrupted = True
        if run.handle is not None:
            self.runs.runtime.interrupt(run.run_id)
        elif run.task is not None:
            run.task.cancel()
        self.runs.runs.pop(run.run_id, None)
