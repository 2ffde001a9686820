"""Run traces: spans and engine-lane records, kept in memory and saved as JSON lines.

One record per line, each with "type":

    trace         first line: version, name, wall_start (unix s), meta (model, drafter, ...),
                  phases (name -> meaning, see phases.py). Every other time in the file is
                  seconds since wall_start, on the monotonic clock.
    span          OpenTelemetry-shaped: run_id, trace_id (one per program run), span_id,
                  parent_id, name, start, end, status ("ok" | "error" | "cancelled"), error,
                  attributes, events ([{"name", "time", "attributes"}]).
                  Node spans are named `chat {model}` (LLM) or `execute_tool {tool}` with
                  gen_ai.* attributes (operation name, request model, usage tokens, tool name and
                  call id) and agentrt.* ones (node, kind, α); their children are the phase
                  spans, named after the phase, with attribute agentrt.phase.
    program       one per program run, at its end: run_id, trace_id, program, inputs, start, end,
                  status ("done" | "failed" | "cancelled"), output, error {node, message},
                  service (attained LLM tokens and time, tool time).
    engine_step   the engine lane: step, start, end, batch_size, num_tokens, num_prefill_tokens,
                  kv_tokens, drafted, accepted, max_k, preempted, predicted_s, draft_s.
    engine_idle   start, end: a gap of at least IDLE_MIN_S between engine steps.
    trace_end     end: when the trace was closed.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from agentrt.errors import RunConfigError
from agentrt.files import write_text_atomic
from agentrt.runtime.backend import EngineStep
from agentrt.runtime.phases import PHASES

TRACE_VERSION = 1
IDLE_MIN_S = 0.001


def new_id(nbytes: int = 8) -> str:
    return secrets.token_hex(nbytes)


@dataclass(frozen=True)
class Span:
    run_id: str
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: float
    end: float
    status: str = "ok"
    error: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[Mapping[str, Any], ...] = ()

    def to_record(self) -> dict[str, Any]:
        return {"type": "span", "run_id": self.run_id, "trace_id": self.trace_id, "span_id": self.span_id,
                "parent_id": self.parent_id, "name": self.name, "start": _r(self.start), "end": _r(self.end),
                "status": self.status, "error": self.error, "attributes": dict(self.attributes),
                "events": [dict(e) for e in self.events]}


def _r(t: float) -> float:
    return round(t, 6)


class Trace:
    """Collects one session's records (any number of program runs). `now()` is the trace clock."""

    def __init__(self, name: str = "agentrt", meta: Mapping[str, Any] | None = None) -> None:
        self.origin = time.monotonic()
        self.wall_origin = time.time()
        self.name = name
        self._records: list[dict[str, Any]] = [{
            "type": "trace", "version": TRACE_VERSION, "name": name, "wall_start": self.wall_origin,
            "meta": dict(meta or {}), "phases": dict(PHASES)}]
        self._steps: list[EngineStep] = []
        self.closed_at: float | None = None

    # -- clocks --
    def now(self) -> float:
        return time.monotonic() - self.origin

    def at(self, monotonic: float) -> float:
        return monotonic - self.origin

    def at_wall(self, wall: float) -> float:
        return wall - self.wall_origin

    # -- adding --
    @property
    def meta(self) -> dict[str, Any]:
        return self._records[0]["meta"]

    def add(self, record: Mapping[str, Any]) -> None:
        self._records.append(dict(record))

    def add_span(self, span: Span) -> None:
        self._records.append(span.to_record())

    @property
    def last_engine_step(self) -> EngineStep | None:
        return self._steps[-1] if self._steps else None

    def add_engine_step(self, step: EngineStep) -> None:
        self._steps.append(step)
        self._records.append(self._step_record(step))

    def _step_record(self, step: EngineStep) -> dict[str, Any]:
        rec = step.to_record()
        rec.update(type="engine_step", start=_r(self.at(step.start)), end=_r(self.at(step.start + step.duration_s)))
        del rec["duration_s"]
        return rec

    def close(self) -> None:
        """Add the engine's idle gaps and the end record (once)."""
        if self.closed_at is not None:
            return
        self.closed_at = self.now()
        for start, end in idle_gaps([(self.at(s.start), self.at(s.start + s.duration_s)) for s in self._steps],
                                    0.0, self.closed_at):
            self._records.append({"type": "engine_idle", "start": _r(start), "end": _r(end)})
        self._records.append({"type": "trace_end", "end": _r(self.closed_at)})

    # -- reading --
    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def run_records(self, run_id: str) -> list[dict[str, Any]]:
        """One finished run's trace as a trace of its own (what `agentrt inspect` reads): the
        header, the run's spans and program record, and the engine lane over the run's time."""
        own = [r for r in self._records[1:] if r.get("run_id") == run_id and r["type"] in ("span", "program")]
        program = next((r for r in own if r["type"] == "program"), None)
        if program is None:
            raise RunConfigError(f"run '{run_id}' has not finished in this trace")
        return self.records_of(own)

    def records_of(self, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A trace of its own for one run's records (its spans and program record, which need not
        be in this trace: a run still going has them made on the spot), with the header and the
        engine lane over the program record's time."""
        program = next(r for r in own if r["type"] == "program")
        start, end = program["start"], program["end"]
        steps = [s for s in self._steps if self.at(s.start + s.duration_s) >= start and self.at(s.start) <= end]
        header = dict(self._records[0], name=program["program"], meta=dict(self.meta))
        lane = [self._step_record(s) for s in steps]
        gaps = idle_gaps([(self.at(s.start), self.at(s.start + s.duration_s)) for s in steps], start, end)
        return ([header] + own + lane + [{"type": "engine_idle", "start": _r(a), "end": _r(b)} for a, b in gaps]
                + [{"type": "trace_end", "end": end}])

    def forget(self, run_ids: Iterable[str], steps_before: float | None = None) -> None:
        """Drop the records of these runs, and engine steps that ended before steps_before (trace
        clock): a long-lived runtime (a server) keeps only what runs in flight still need."""
        gone = set(run_ids)
        if steps_before is not None:
            self._steps = [s for s in self._steps if self.at(s.start + s.duration_s) >= steps_before]
        keep_step = float("-inf") if steps_before is None else steps_before
        self._records = [self._records[0]] + [
            r for r in self._records[1:]
            if r.get("run_id") not in gone and not (r["type"] == "engine_step" and r["end"] < keep_step)]

    def write(self, path: str | Path) -> Path:
        self.close()
        return write_records(self._records, path)


def idle_gaps(busy: Iterable[tuple[float, float]], start: float, end: float,
              min_gap: float = IDLE_MIN_S) -> list[tuple[float, float]]:
    """The parts of [start, end] outside every busy interval, at least min_gap long."""
    gaps, t = [], start
    for b0, b1 in sorted(busy):
        if b0 - t >= min_gap:
            gaps.append((t, min(b0, end)))
        t = max(t, b1)
    if end - t >= min_gap:
        gaps.append((t, end))
    return [(a, b) for a, b in gaps if b > a]


def write_records(records: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    lines = [json.dumps(rec, ensure_ascii=False, default=_json_default) + "\n" for rec in records]
    return write_text_atomic(path, "".join(lines))


def _json_default(value: Any) -> Any:
    return repr(value)


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The records of a saved trace; RunConfigError naming the file (and line) when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise RunConfigError(f"{path}: no such trace file")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit in a string
    except UnicodeDecodeError:
        raise RunConfigError(f"{path}: not an agentrt trace (not UTF-8 text)") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunConfigError(f"{path}:{no}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or "type" not in rec:
            raise RunConfigError(f"{path}:{no}: a trace record must be an object with a 'type'")
        records.append(rec)
    if not records or records[0]["type"] != "trace":
        raise RunConfigError(f"{path}: not an agentrt trace (the first record must have type 'trace')")
    if records[0].get("version") != TRACE_VERSION:
        raise RunConfigError(f"{path}: trace version {records[0].get('version')!r}, this agentrt reads {TRACE_VERSION}")
    return records
