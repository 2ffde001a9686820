"""The runtime's record of one LLM, tool or wait_for node: its phases as they happen, its
attributes, and at the end its spans (one node span, one child span per phase)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrt.runtime.backend import LLMStepEvent
from agentrt.runtime.phases import PhaseLog
from agentrt.runtime.trace import Span, new_id


@dataclass
class Outcome:
    """How a node's call ended: ok with a value, or failed with an error message."""

    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    sent: Any = None  # an LLM node a later call continues: the messages it sent (replayed on resume)

    @classmethod
    def failed(cls, error: str, error_type: str) -> Outcome:
        return cls(False, error=error, error_type=error_type)


@dataclass
class NodeState:
    node: str
    kind: str  # "llm" | "tool" | "wait_for"
    name: str  # the OpenTelemetry span name: "chat {model}" / "execute_tool {tool}" / "await_input"
    created: float
    span_id: str = field(default_factory=new_id)
    status: str = "pending"  # pending | running | ok | error | cancelled
    error: str | None = None
    end: float | None = None
    waited_on: str | None = None  # the node whose completion made this one ready
    handle: Any = None  # the backend's request handle (LLM), for set_priority
    attributes: dict[str, Any] = field(default_factory=dict)
    # (start, error, attributes) of a phase that failed (a tool attempt): its span's status and error
    phase_notes: list[tuple[float, str | None, dict[str, Any]]] = field(default_factory=list)
    log: PhaseLog = field(init=False)

    def __post_init__(self) -> None:
        self.log = PhaseLog(self.created)

    @property
    def active(self) -> bool:
        return self.status == "running"

    @property
    def finished(self) -> bool:
        return self.status in ("ok", "error", "cancelled")

    @property
    def duration_s(self) -> float:
        """A finished node's duration as its span records it (start and end rounded to the us)."""
        assert self.end is not None, f"node {self.node} is not finished"
        return round(round(self.end, 6) - round(self.log.spans(self.end)[0][1], 6), 6)

    def current_phase(self, now: float) -> tuple[str | None, float | None]:
        """The phase the node is in and how long it has been in it, or (None, None) once the node
        has finished: its phase log still ends in its last phase (which lasted until `end`, as its
        span shows), but nothing of the node runs any more."""
        if self.finished:
            return None, None
        return self.log.phase, max(0.0, now - self.log.since)

    def on_llm_step(self, ev: LLMStepEvent, t: float) -> None:
        """Advance an LLM node's phase from one engine step (t: the step start on the trace clock).
        Steps feeding more than one token (or the first step) are prefill; prefill ends when
        its last step ends, and the first generated token starts decode."""
        if ev.preempted:
            self.log.enter("preempted", t)
            self.log.event(t, {"agentrt.step": ev.step, "agentrt.preempted": True})
            return
        step_end = t + ev.duration_s
        if ev.num_new > 1 or self.log.phase in ("queued", "preempted"):
            self.log.enter("prefill", t)
            self.attributes["_prefill_end"] = step_end
        elif self.log.phase == "prefill":
            self.log.enter("decode", self.attributes.get("_prefill_end", t))
        self.log.event(t, {"agentrt.step": ev.step, "agentrt.num_new": ev.num_new, "agentrt.k": ev.k,
                           "agentrt.accepted": ev.accepted, "agentrt.batch_size": ev.batch_size,
                           "agentrt.duration_s": round(ev.duration_s, 6)})

    def finish(self, status: str, end: float, error: str | None = None) -> None:
        if self.finished:
            return
        if self.log.phase == "prefill" and status == "ok" and self.kind == "llm":
            # generation ended within the prefill step's window: the rest is the first token's
            self.log.enter("decode", min(self.attributes.get("_prefill_end", end), end))
        # an engine step's times come from the engine thread and may land just past the moment
        # the runtime saw the output: the node lasts at least until its last phase began, so its
        # phase spans always tile its span exactly
        self.status, self.end, self.error = status, max(end, self.log.since), error

    def spans(self, run_id: str, trace_id: str, parent_id: str | None = None) -> list[Span]:
        assert self.end is not None, f"node {self.node} is not finished"
        attrs = {k: v for k, v in self.attributes.items() if not k.startswith("_")}
        attrs.update({"agentrt.node": self.node, "agentrt.node.kind": self.kind})
        if self.waited_on is not None:
            attrs["agentrt.waited_on"] = self.waited_on
        phases = self.log.spans(self.end)
        noted = _notes_by_span(self.phase_notes, [t0 for phase, t0, _ in phases if phase in FAILED_PHASES])
        node_span = Span(run_id, trace_id, self.span_id, parent_id, self.name, phases[0][1], self.end,
                         self.status, self.error, attrs)
        out = [node_span]
        for phase, t0, t1 in phases:
            events = tuple({"name": "tool_progress" if "agentrt.tool.progress" in a else "engine_step",
                            "time": round(t, 6), "attributes": a}
                           for t, a in self.log.events if t0 <= t < t1 or (t == t1 == self.end))
            phase_attrs: dict[str, Any] = {"agentrt.phase": phase, "agentrt.node": self.node}
            if phase == "waiting" and self.waited_on is not None:
                phase_attrs["agentrt.waited_on"] = self.waited_on
            status, error = "ok" if self.status == "ok" else self.status, None
            notes = noted.get(t0, []) if phase in FAILED_PHASES else []
            if notes:  # attempts with no wait between them share one span: the last one's figures
                status, error = "error", "; ".join(f"attempt {n[2].get('agentrt.tool.attempt')}: {n[1]}"
                                                   for n in notes) if len(notes) > 1 else notes[0][1]
                phase_attrs.update(notes[-1][2])
            out.append(Span(run_id, trace_id, new_id(), self.span_id, phase, t0, t1, status, error, phase_attrs,
                            events))
        return out


FAILED_PHASES = ("tool_retried", "tool_failed")


def _notes_by_span(notes: list[tuple[float, str | None, dict[str, Any]]],
                   starts: list[float]) -> dict[float, list[tuple[float, str | None, dict[str, Any]]]]:
    """Each note under the start of the failed phase it belongs to: the last one starting at or
    before it (within a millisecond: the phase log clamps times to be non-decreasing, and an
    attempt's start is read on the wall clock)."""
    out: dict[float, list[tuple[float, str | None, dict[str, Any]]]] = {}
    for note in notes:
        before = [t for t in starts if t <= note[0] + 1e-3]
        if before or starts:
            out.setdefault(before[-1] if before else starts[0], []).append(note)
    return out
