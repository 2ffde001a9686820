"""Acceptance accounting while requests run: per (request, drafter) totals and per-step events
for traces/timelines. A finished request's totals are frozen into `spec.report.SpecReport`, which
also defines the rates (α, α tested, tokens per pass); the properties here read them from there.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrt.errors import SpecError
from agentrt.spec.report import SpecFigures, SpecReport


@dataclass(frozen=True)
class SpecStepEvent:
    """One verification pass of one sequence: the unit of timelines and traces."""

    step: int  # engine step index
    time: float  # seconds (the engine's clock) when verification finished
    seq_id: int
    drafter: str
    k: int  # drafts verified
    accepted: int
    emitted: int  # tokens appended to the sequence (accepted + 1 unless cut at a stop)
    forced: int = 0  # of the k drafts, how many a grammar forced

    def __post_init__(self) -> None:
        _check_step(self.k, self.accepted, self.emitted, self.forced)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_step(k: int, num_accepted: int, num_emitted: int, forced: int) -> None:
    if not 0 <= num_accepted <= k:
        raise SpecError(f"accepted drafts must be in [0, k={k}], got {num_accepted}")
    # Fewer than accepted + 1 when the engine cut the pass at a stop (0 if it dropped a stop token).
    if not 0 <= num_emitted <= num_accepted + 1:
        raise SpecError(f"emitted tokens must be in [0, accepted+1={num_accepted + 1}], got {num_emitted}")
    if not 0 <= forced <= k:
        raise SpecError(f"forced drafts must be in [0, k={k}], got {forced}")


@dataclass
class DraftStats:
    """Totals for one (request, drafter); merge() aggregates over requests or drafters."""

    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # passes that ended on a rejected draft
    forced: int = 0
    target_passes: int = 0  # every pass, including k = 0 ones
    emitted: int = 0
    # accepted-run-length histogram: run_lengths[j] = passes with k >= 1 that accepted exactly j
    run_lengths: dict[int, int] = field(default_factory=dict)

    def record(self, k: int, num_accepted: int, num_emitted: int, forced: int = 0) -> None:
        """Account one target pass that verified k drafts (k = 0: a plain decode step)."""
        _check_step(k, num_accepted, num_emitted, forced)
        self.drafted += k
        self.accepted += num_accepted
        self.rejections += int(num_accepted < k)
        self.forced += forced
        self.target_passes += 1
        self.emitted += num_emitted
        if k > 0:
            self.run_lengths[num_accepted] = self.run_lengths.get(num_accepted, 0) + 1

    def record_event(self, event: SpecStepEvent) -> None:
        self.record(event.k, event.accepted, event.emitted, event.forced)

    def merge(self, other: DraftStats) -> DraftStats:
        """Add other's counts into self; returns self."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rejections += other.rejections
        self.forced += other.forced
        self.target_passes += other.target_passes
        self.emitted += other.emitted
        for j, n in other.run_lengths.items():
            self.run_lengths[j] = self.run_lengths.get(j, 0) + n
        return self

    @classmethod
    def total(cls, parts: Iterable[DraftStats]) -> DraftStats:
        out = cls()
        for part in parts:
            out.merge(part)
        return out

    def figures(self) -> SpecFigures:
        """These counts, frozen (the derived rates are computed there)."""
        return SpecFigures(self.drafted, self.accepted, self.rejections, self.forced, self.target_passes,
                           self.emitted, self.run_lengths)

    @property
    def spec_passes(self) -> int:
        return self.figures().spec_passes

    @property
    def alpha(self) -> float | None:
        return self.figures().alpha

    @property
    def alpha_tested(self) -> float | None:
        return self.figures().alpha_tested

    @property
    def tokens_per_pass(self) -> float | None:
        return self.figures().tokens_per_pass

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; histogram keys are strings, rates are None when undefined."""
        return self.figures().to_dict()


@dataclass
class RequestSpecStats:
    """One request's accounting: per-drafter totals plus its step events, in order."""

    seq_id: int
    by_drafter: dict[str, DraftStats] = field(default_factory=dict)
    events: list[SpecStepEvent] = field(default_factory=list)

    def record(self, event: SpecStepEvent) -> None:
        if event.seq_id != self.seq_id:
            raise SpecError(f"event for seq {event.seq_id} recorded on the stats of seq {self.seq_id}")
        self.by_drafter.setdefault(event.drafter, DraftStats()).record_event(event)
        self.events.append(event)

    def total(self) -> DraftStats:
        return DraftStats.total(self.by_drafter.values())

    def report(self) -> SpecReport:
        """The request's figures, frozen: what the engine hands out when it finishes."""
        return SpecReport.of_drafters(self.seq_id, {name: s.figures() for name, s in self.by_drafter.items()})

    def to_dict(self, with_events: bool = False) -> dict[str, Any]:
        out = self.report().to_dict()
        if with_events:
            out["events"] = [e.to_dict() for e in self.events]
        return out
