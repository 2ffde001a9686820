"""The phases of a node's life, in one place. Each LLM, tool or wait_for node of a run gets one
node span (`chat {model}` / `execute_tool {tool}` / `await_input`) whose child phase spans tile
it: back to back, no gaps, no overlap, from the node's creation to its end.

    waiting       the node exists but an input is not done yet (attribute agentrt.waited_on: the
                  input that finished last, i.e. what the node was stalled on)
    queued        ready and handed over, not started yet: an LLM request in the engine's queue
                  before its first step; a tool call before its first attempt
    prefill_ahead LLM, inside its wait: engine steps computing the known start of its prompt
                  while the program waits on a tool (runtime/prefill_ahead.py)
    prefill       LLM: engine steps feeding the prompt (chunked prefill: several steps)
    decode        LLM: from the first generated token to the end; one event per engine step
                  (agentrt.step, k drafts, accepted, batch size)
    preempted     LLM: evicted from the batch; it is prefilled again when it comes back
    tool_running  tool: an attempt that succeeded (while running: the call so far)
    tool_retried  tool: an attempt that failed and was tried again
    tool_backoff  tool: the wait between two attempts
    tool_failed   tool: the last attempt, which failed
    input_wait    a wait_for node: waiting for the value from outside (a stall of the run, not
                  of the machine: nothing runs for it)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PHASES: dict[str, str] = {
    "waiting": "inputs not done yet",
    "queued": "ready, not started (engine queue / before the first attempt)",
    "prefill_ahead": "computing the known start of the prompt while inputs are not done",
    "prefill": "feeding the prompt",
    "decode": "generating",
    "preempted": "evicted from the batch, to be prefilled again",
    "tool_running": "tool attempt that succeeded (or is running)",
    "tool_retried": "tool attempt that failed and was retried",
    "tool_backoff": "wait between tool attempts",
    "tool_failed": "last tool attempt, failed",
    "input_wait": "waiting for a value from outside the program",
}
LLM_PHASES = ("waiting", "prefill_ahead", "queued", "prefill", "decode", "preempted")
TOOL_PHASES = ("waiting", "queued", "tool_running", "tool_retried", "tool_backoff", "tool_failed")
WAIT_FOR_PHASES = ("waiting", "input_wait")


@dataclass
class PhaseLog:
    """A node's phase transitions in time order. Each phase lasts until the next one starts; the
    last until the node ends. Times are clamped to be non-decreasing, so the spans it yields tile
    [start, end] exactly even when clocks disagree by a few microseconds."""

    start: float
    transitions: list[tuple[str, float]] = field(default_factory=list)
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (time, attributes)

    def __post_init__(self) -> None:
        if not self.transitions:
            self.transitions.append(("waiting", self.start))

    @property
    def phase(self) -> str:
        return self.transitions[-1][0]

    @property
    def since(self) -> float:
        return self.transitions[-1][1]

    def enter(self, phase: str, t: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (phases: {', '.join(PHASES)})")
        if phase != self.phase:
            self.transitions.append((phase, max(t, self.since)))

    def replace_from(self, index: int, transitions: list[tuple[str, float]]) -> None:
        """Drop the transitions from `index` on and enter these instead (a tool's attempts are
        known only once the call returns)."""
        del self.transitions[max(1, index):]
        for phase, t in transitions:
            self.enter(phase, t)

    def event(self, t: float, attributes: dict[str, Any]) -> None:
        self.events.append((t, attributes))

    def spans(self, end: float) -> list[tuple[str, float, float]]:
        """(phase, start, end) tiling [start, end]: zero-length phases dropped, neighbours of the
        same phase merged (a node that started and ended at once keeps one empty span)."""
        out: list[tuple[str, float, float]] = []
        for i, (phase, t) in enumerate(self.transitions):
            t_end = self.transitions[i + 1][1] if i + 1 < len(self.transitions) else max(end, t)
            if t_end <= t:
                continue
            if out and out[-1][0] == phase:
                out[-1] = (phase, out[-1][1], t_end)
            else:
                out.append((phase, t, t_end))
        return out or [(self.phase, self.since, max(end, self.since))]

    def durations(self, now: float) -> dict[str, float]:
        total: dict[str, float] = {}
        for phase, t0, t1 in self.spans(now):
            total[phase] = total.get(phase, 0.0) + (t1 - t0)
        return total
