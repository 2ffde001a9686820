"""The served program runs: admission, idempotency, each run's event log, and what is kept.

A submitted run is admitted when fewer than `max_running` run and waits (status "queued") while
fewer than `max_queued` wait; past that the submit is refused (429 with Retry-After). Each run
keeps the numbered log of its events (runtime.events plus run_queued), so an SSE client that
reconnects with Last-Event-ID gets exactly the events after that id. When a run ends its trace is
written to `runs_dir/<run_id>.jsonl` (what `agentrt inspect` reads), its summary computed once,
and its records dropped from the runtime's trace. The newest `keep_runs` finished runs stay in
memory; older ones are read back from the run store or their trace file when asked for.

With a durable run store (the runtime's `store`; without --db a NullRunStore that keeps nothing),
a run is recorded before its submit is answered, with its Idempotency-Key, and every event is
recorded before a client can read it; `recover()` (at start) resumes the runs that had not
ended, their event logs going on with the same ids. A shutdown stops the runs still going without
ending them, so the next start resumes them (without a durable store it cancels them).

When the store becomes unavailable (PostgreSQL restarting), a submit answers 503 (nothing was
recorded) and a run whose write fails stops as at a shutdown: what it did since its last recorded
write is dropped (the event that failed is not in its log either), and it is resumed from the
store once the store answers again (polled every `store_retry_s`).

On a PostgreSQL store shared by several replicas (`lease_s` given) this manager runs only the runs
its replica owns (replicas.py): it records a submitted run as its own, resumes at start only the
runs no live replica holds, releases a run's lease when it ends; a run another replica owns is
served from the store (`ServedRun.remote`), its cancel and input recorded there for its owner.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import jsonschema

from agentrt.errors import AgentRTError
from agentrt.runtime.events import RunEvent
from agentrt.runtime.loader import Example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.store import UNFINISHED, RecordedNodes, RunStore, StoredRun, StoreUnavailable, file_hash
from agentrt.runtime.summary import summarize
from agentrt.runtime.trace import new_id, read_trace, write_records
from agentrt.server.config import Limits
from agentrt.server.errors import ApiError
from agentrt.server.served_run import ENDED, ServedRun
from agentrt.server.replicas import Replica, check_forwarded_input, list_from_store, remote_waiting

log = logging.getLogger("agentrt.server")


class RunManager:
    def __init__(self, runtime: Runtime, programs: Mapping[str, Example], limits: Limits, runs_dir: Path,
                 keep_runs: int = 1000,
                 on_end: Callable[[ServedRun], None] | None = None, *,
                 allow_changed_programs: bool = False, prune_after_s: float | None = None,
                 prune_keep: int | None = None, store_retry_s: float = 1.0, lease_s: float | None = None,
                 replica_id: str | None = None) -> None:
        self.runtime, self.programs, self.limits = runtime, dict(programs), limits
        self.runs_dir, self.keep_runs, self.on_end = Path(runs_dir), keep_runs, on_end
        self.store: RunStore = runtime.store  # a NullRunStore without --db: nothing recorded, nothing found
        self.allow_changed_programs = allow_changed_programs
        self.prune_after_s, self.prune_keep = prune_after_s, prune_keep
        self.store_retry_s = store_retry_s
        self._hashes = {name: file_hash(ex.path) for name, ex in self.programs.items()}
        self.runs: OrderedDict[str, ServedRun] = OrderedDict()
        self._by_key: dict[str, str] = {}
        self._seq = itertools.count()
        self._slots = asyncio.Semaphore(limits.max_running_runs)
        self.accepting = True
        self.watchers: list[Callable[[ServedRun], None]] = []  # told when a run is queued or changes status
        self._unsubscribe = runtime.subscribe_events(self._on_event)
        # on a store several replicas share: which runs this one runs (replicas.py)
        self.replica = Replica(self, self.store, lease_s, replica_id) \
            if lease_s is not None and getattr(self.store, "supports_leases", False) else None

    # -- counts --
    @property
    def running(self) -> int:
        return sum(1 for r in self.runs.values() if r.status == "running")

    @property
    def waiting(self) -> int:
        return sum(1 for r in self.runs.values() if r.status == "waiting")

    @property
    def queued(self) -> int:
        return sum(1 for r in self.runs.values() if r.status == "queued")

    # -- submitting --
    def submit(self, program: str, inputs: dict[str, Any], *, priority: float | None = None,
               metadata: Mapping[str, str] | None = None, idempotency_key: str | None = None) -> tuple[ServedRun, bool]:
        """(the run, whether it is new). The same Idempotency-Key returns the run it made."""
        example = self.programs.get(program)
        if example is None:
            raise ApiError(404, f"no program named '{program}' (loaded: {', '.join(sorted(self.programs)) or 'none'})",
                           param="program", code="program_not_found")
        digest = json.dumps([program, inputs, priority, dict(metadata or {})], sort_keys=True, default=repr)
        if idempotency_key is not None:
            existing = self.runs.get(self._by_key.get(idempotency_key, ""))
            if existing is None:  # bound before a restart
                stored = self.store.run_by_key(idempotency_key)
                if stored is not None and stored.status in UNFINISHED and stored.run_id not in self.runs \
                        and (self.replica is None or self.replica.claim(stored.run_id)):
                    self.resume_stored(stored)  # recorded, but its first start did not get going
                existing = None if stored is None else self.get(stored.run_id)
            if existing is not None:
                if existing.request_digest != digest:
                    raise ApiError(422, "Idempotency-Key was used for a different request (program, inputs, "
                                        "priority or metadata differ)", param="Idempotency-Key",
                                   code="idempotency_key_reused")
                return existing, False
        if not self.accepting:
            raise ApiError(503, "the server is shutting down and accepts no new runs", code="shutting_down")
        full = self._check_inputs(example, inputs)
        if self.running >= self.limits.max_running_runs and self.queued >= self.limits.max_queued_runs:
            raise ApiError(429, f"too many runs: {self.running} running and {self.queued} queued "
                                f"(limits max_running_runs={self.limits.max_running_runs}, "
                                f"max_queued_runs={self.limits.max_queued_runs})", code="too_many_runs",
                           headers={"Retry-After": str(self.limits.retry_after_s)})
        run_id = f"run_{new_id(8)}"
        run = ServedRun(run_id, program, full, dict(metadata or {}), float(priority or 0.0), time.time(),
                        next(self._seq), idempotency_key, digest, store=self.store)
        stored = StoredRun(run_id, program, self._hashes[program], full, "queued", run.created_at,
                           idempotency_key=idempotency_key, request_digest=digest, priority=run.priority,
                           metadata=run.metadata)
        if self.replica is not None:  # durable before the client hears of it
            self.store.create_owned_run(stored, self.replica.id, self.replica.lease_s)
        else:
            self.store.create_run(stored)
        self.runs[run_id] = run
        if idempotency_key is not None:
            self._by_key[idempotency_key] = run_id
        try:
            run.add_event("run_queued", {"program": program, "inputs": full})
        except StoreUnavailable as e:  # the run is recorded (acknowledged): it waits for the store
            self._lost_store(run, e)
            self._resume_later(run)
        else:
            run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"agentrt-serve:{run_id}")
        self._status_changed(run)
        return run, True

    def _check_inputs(self, example: Example, inputs: dict[str, Any]) -> dict[str, Any]:
        schema = example.program.input_schema(example.default_inputs)
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(inputs), key=lambda e: list(e.path))
        if errors:
            e = errors[0]
            where = "/".join(str(p) for p in e.absolute_path)
            raise ApiError(400, f"inputs{'.' + where if where else ''}: {e.message} (program '{example.name}' "
                                f"takes {json.dumps(schema['properties'])})", param="inputs", code="invalid_inputs")
        return {**example.default_inputs, **inputs}

    async def _run(self, run: ServedRun, resume: RecordedNodes | None = None) -> None:
        try:
            async with self._slots:
                if run.ended:  # cancelled while queued
                    return
                run.status, run.started_at = "running", run.started_at or time.time()
                self._status_changed(run)
                example = self.programs[run.program]
                run.handle = self.runtime.submit(example.program, run.inputs, run_id=run.run_id,
                                                 priority=run.priority, resume=resume,
                                                 program_hash=self._hashes[run.program])
                result = await run.handle.wait()
        except asyncio.CancelledError:
            if run.interrupted:  # a shutdown: the store keeps it for the next start
                return
            if run.handle is not None:
                run.handle.cancel()
                result = await run.handle.wait()
            else:
                self._end(run, "cancelled", None, {"node": None, "message": "the run was cancelled while queued"})
                return
        except StoreUnavailable as e:  # recording its start, or its end, failed
            self._lost_store(run, e)
            self._resume_later(run)
            return
        except AgentRTError as e:  # bad program set-up (a tool missing): the run fails, the server goes on
            self._end(run, "failed", None, {"node": None, "message": str(e)})
            return
        if run.interrupted:
            self.runtime.release(run.run_id)
            return
        if run.handle.interrupted:  # a store write of the runtime's failed: it stopped, resumable
            self._resume_later(run)
            return
        self._end(run, result.status, result.output,
                  None if result.error is None else {"node": result.failed_node, "message": result.error})

    def _end(self, run: ServedRun, status: str, output: Any, error: dict[str, Any] | None) -> None:
        run.status, run.output, run.error, run.ended_at = status, output, error, time.time()
        if run.handle is None:  # never started: no runtime events, so say it here
            run.add_event("run_finished", {"status": status, "output": None, "error": error["message"],
                                           "failed_node": None})
        if run.run_id not in self.runtime.runs:  # else the runtime recorded it
            try:
                self.store.update_run(run.run_id, status=status, ended_at=run.ended_at, output=output, error=error)
            except StoreUnavailable as e:  # it stays unfinished there: the next start takes it up again
                log.error("run %s ended (%s) but its end is not recorded: %s", run.run_id, status, e)
        if self.replica is not None:
            self.replica.release(run.run_id)
        records = self.runtime.release(run.run_id) if run.run_id in self.runtime.runs else None
        if records is not None:
            run.summary = summarize(records)
            try:
                run.trace_path = write_records(records, self.runs_dir / f"{run.run_id}.jsonl")
            except OSError as e:
                log.error("could not write the trace of %s: %s", run.run_id, e)
        run._changed.set()
        if self.on_end is not None:
            self.on_end(run)
        self._status_changed(run)
        self._retire()

    def _retire(self) -> None:
        ended = [r for r in self.runs.values() if r.ended]
        for run in ended[: max(0, len(ended) - self.keep_runs)]:
            del self.runs[run.run_id]
            if run.idempotency_key is not None:
                self._by_key.pop(run.idempotency_key, None)
        if self.prune_after_s is not None or self.prune_keep is not None:
            self.prune()

    def prune(self) -> list[str]:
        """Retention: delete ended runs older than prune_after_s or beyond the newest prune_keep,
        from the store and the runs directory (never a run that has not ended)."""
        if self.store.durable:
            gone = self.store.prune(older_than_s=self.prune_after_s, keep=self.prune_keep)
        else:  # only this process holds them
            ended = sorted((r for r in self.runs.values() if r.ended), key=lambda r: r.ended_at or 0, reverse=True)
            cutoff = time.time() - self.prune_after_s if self.prune_after_s is not None else None
            gone = [r.run_id for i, r in enumerate(ended) if (self.prune_keep is not None and i >= self.prune_keep)
                    or (cutoff is not None and (r.ended_at or 0) < cutoff)]
        for run_id in gone:
            run = self.runs.pop(run_id, None)
            if run is not None and run.idempotency_key is not None:
                self._by_key.pop(run.idempotency_key, None)
            (self.runs_dir / f"{run_id}.jsonl").unlink(missing_ok=True)
        return gone

    # -- recovery --
    def recover(self) -> list[str]:
        """At start: resume the stored runs that had not ended (queued ones queue again; running
        ones go on from what they recorded). A run whose program is not loaded, or whose program
        file changed since it started (unless allowed), fails with the reason. Returns the ids
        of the runs resumed."""
        if self.prune_after_s is not None or self.prune_keep is not None:
            self.prune()  # retention holds from the start, not only as runs end
        if self.replica is not None:  # only the runs no live replica holds
            return self.replica.start()
        return [stored.run_id for stored in self.store.runs(UNFINISHED) if self.resume_stored(stored)]

    def resume_stored(self, stored: StoredRun) -> bool:
        """Serve a stored unfinished run again and go on with it (False: it failed, not resumable)."""
        run = self._served(stored)
        self.runs[run.run_id] = run
        if run.idempotency_key is not None:
            self._by_key[run.idempotency_key] = run.run_id
        reason = self._why_not_resumable(stored)
        if reason is not None:
            self._end(run, "failed", None, {"node": None, "message": reason})
            return False
        run.add_event("run_resumed", {"program": run.program, "was": stored.status})
        resume = self.store.recorded(run.run_id) if stored.status != "queued" else None
        run.task = asyncio.get_running_loop().create_task(self._run(run, resume), name=f"agentrt-serve:{run.run_id}")
        return True

    def _lost_store(self, run: ServedRun, e: StoreUnavailable) -> None:
        """A write of the run failed: stop it (it stays unfinished in the store) to resume it later."""
        if not run.store_lost:
            run.store_lost = True
            log.warning("run %s stopped: %s; it resumes from the store when the store answers again", run.run_id, e)
        self.runtime.interrupt(run.run_id)

    def _resume_later(self, run: ServedRun) -> None:
        if run.run_id in self.runtime.runs:
            self.runtime.release(run.run_id)
        run.handle, run.store_lost = None, True
        run.task = asyncio.get_running_loop().create_task(self._resume_when_store_back(run),
                                                          name=f"agentrt-serve:{run.run_id}")

    async def _resume_when_store_back(self, run: ServedRun) -> None:
        """Resume a run stopped by an unavailable store from what the store recorded, once it
        answers again (the in-memory event log is read back: it holds only what was recorded)."""
        while self.accepting:
            await asyncio.sleep(self.store_retry_s)
            try:
                stored = self.store.get_run(run.run_id)
                resume = self.store.recorded(run.run_id) if stored.status != "queued" else None
                run.events = self.store.events(run.run_id)
                run.store_lost = False
                run.add_event("run_resumed", {"program": run.program, "was": stored.status})
            except StoreUnavailable:
                continue
            if self.replica is not None and not self.replica.claim(run.run_id):
                log.warning("run %s: another replica took it over; it goes on there", run.run_id)
                self.runs.pop(run.run_id, None)
                return
            log.info("run %s resumed: the store answers again", run.run_id)
            await self._run(run, resume)
            return

    def _why_not_resumable(self, stored: StoredRun) -> str | None:
        if stored.program not in self.programs:
            return (f"cannot resume: program '{stored.program}' is not loaded by this server "
                    f"(loaded: {', '.join(sorted(self.programs)) or 'none'})")
        if stored.program_hash != self._hashes[stored.program] and not self.allow_changed_programs:
            return (f"cannot resume: the file of program '{stored.program}' ({self.programs[stored.program].path}) "
                    "changed since the run started; start the server with --allow-changed-programs to resume it anyway")
        return None

    def _served(self, stored: StoredRun) -> ServedRun:
        """A stored run as the server serves it, with its recorded events."""
        run = ServedRun(stored.run_id, stored.program, stored.inputs, stored.metadata, stored.priority,
                        stored.created_at, next(self._seq), stored.idempotency_key, stored.request_digest or "",
                        status=stored.status, started_at=stored.started_at, ended_at=stored.ended_at,
                        output=stored.output, error=stored.error, store=self.store)
        run.events = self.store.events(stored.run_id)
        path = self.runs_dir / f"{stored.run_id}.jsonl"
        if run.ended and path.is_file():
            run.trace_path = path
            try:
                run.summary = summarize(read_trace(path))
            except AgentRTError:
                pass
        return run

    def _on_event(self, ev: RunEvent) -> None:
        run = self.runs.get(ev.run_id)
        if run is None or run.store_lost:  # a run stopping for a lost store: its resume tells the rest
            return
        try:
            self._record_event(run, ev)
        except StoreUnavailable as e:  # never into the runtime: a node must not fail for it
            self._lost_store(run, e)

    def _record_event(self, run: ServedRun, ev: RunEvent) -> None:
        if ev.type in ("input_wanted", "input_given") and not run.ended:
            run.status = "waiting" if self.runtime.waiting_for(run.run_id) else "running"
            self.store.update_run(run.run_id, status=run.status)
            run.add_event(ev.type, {"time": round(ev.time, 6), **ev.data})
            self._status_changed(run)
            return
        run.add_event(ev.type, {"time": round(ev.time, 6), **ev.data})

    def _status_changed(self, run: ServedRun) -> None:
        for fn in list(self.watchers):
            try:
                fn(run)
            except Exception:  # noqa: BLE001 - a watcher (the console's feed) never fails a run
                log.exception("a run watcher failed on %s", run.run_id)

    # -- outside input --
    def waiting_for(self, run: ServedRun) -> dict[str, Any]:
        """The run's wait_for nodes waiting now: node -> InputWait (schema, prompt)."""
        if run.remote:
            return remote_waiting(run) if not run.ended else {}
        return self.runtime.waiting_for(run.run_id) if not run.ended else {}

    def provide_input(self, run: ServedRun, node: str, value: Any, *, by: str | None = None) -> None:
        """Raises RunConfigError (not waiting there) or InputValueError (the schema says no). For
        a run another replica owns the value is checked here, recorded, and given by its owner."""
        if run.remote:
            check_forwarded_input(run, node, value)
            self.store.forward_input(run.run_id, node, value, by)
            return
        self.runtime.provide_input(run.run_id, node, value, by=by, via="http")

    # -- reading --
    def get(self, run_id: str) -> ServedRun:
        run = self.runs.get(run_id)
        if run is not None:
            return run
        stored = self.store.get_run(run_id)
        if stored is not None:
            return self.view(stored)
        return self._from_disk(run_id)

    def view(self, stored: StoredRun) -> ServedRun:
        """A stored run this server does not hold in memory, as the API shows it."""
        run = self._served(stored)
        run.remote = self.replica is not None and not run.ended
        return run

    def _from_disk(self, run_id: str) -> ServedRun:
        path = self.runs_dir / f"{run_id}.jsonl"
        if "/" in run_id or run_id.startswith(".") or not path.is_file():
            raise ApiError(404, f"no run with id '{run_id}'", param="run_id", code="run_not_found")
        try:
            records = read_trace(path)
        except AgentRTError as e:
            raise ApiError(404, f"run '{run_id}': its trace cannot be read ({e})", code="run_not_found") from None
        summary = summarize(records)
        prog = next(r for r in records if r["type"] == "program")
        wall = records[0]["wall_start"]
        return ServedRun(run_id, prog["program"], prog.get("inputs") or {}, {}, 0.0, wall + prog["start"], -1,
                         status=prog["status"], started_at=wall + prog["start"], ended_at=wall + prog["end"],
                         output=prog.get("output"), error=prog.get("error"), summary=summary, trace_path=path)

    def live_nodes(self, run: ServedRun) -> list[dict[str, Any]]:
        """While a run runs: each LLM/tool/wait_for node's status and current phase (null once
        the node has finished, with its duration instead)."""
        rs = self.runtime.runs.get(run.run_id)
        if rs is None:
            return []
        now = self.runtime.trace.now()
        nodes = []
        for ns in rs.nodes.values():
            phase, elapsed = ns.current_phase(now)
            nodes.append({"node": ns.node, "kind": ns.kind, "status": ns.status, "phase": phase,
                          "phase_elapsed_s": None if elapsed is None else round(elapsed, 6),
                          "duration_s": None if ns.end is None else round(ns.end - ns.created, 6)})
        return nodes

    def list(self, program: str | None, status: str | None, limit: int, cursor: str | None) -> tuple[list[ServedRun], str | None]:
        if self.replica is not None:  # every replica's runs
            return list_from_store(self, program, status, limit, cursor)
        runs = sorted(self.runs.values(), key=lambda r: r.seq, reverse=True)
        if cursor is not None:
            after = self.runs.get(cursor)
            if after is None:
                raise ApiError(400, f"cursor '{cursor}' names no run kept in memory", param="cursor")
            runs = [r for r in runs if r.seq < after.seq]
        runs = [r for r in runs if (program is None or r.program == program) and (status is None or r.status == status)]
        page = runs[:limit]
        return page, (page[-1].run_id if len(runs) > limit else None)

    # -- control --
    def cancel(self, run: ServedRun) -> None:
        if run.remote:  # its owner cancels it at its next heartbeat
            self.store.request_cancel(run.run_id)
        elif not run.ended and run.task is not None:
            run.task.cancel()

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting runs; give those in flight grace_s to finish, then stop them: with a
        store they stay unfinished there (the next start resumes them), without one they are
        cancelled."""
        self.accepting = False
        tasks = {r.task: r for r in self.runs.values() if r.task is not None and not r.task.done()}
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                run = tasks[t]
                if self.store.durable:
                    run.interrupted = True
                    if run.handle is not None:
                        self.runtime.interrupt(run.run_id)
                        continue
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        if self.replica is not None:  # its unfinished runs go to the other replicas now
            await self.replica.stop()
        self._unsubscribe()
