"""Acceptance accounting: per (request, drafter) totals and per-step events for traces/timelines.

Two acceptance rates are reported, because verification stops at the first rejection:
* alpha = accepted / drafted: the fraction of proposed tokens that were kept (what the k-sized
  drafts bought). Drafts after a rejection count as not accepted although they were never tested.
* alpha_tested = accepted / (accepted + rejections): the per-position acceptance probability (each
  tested draft is either accepted or is the one rejection of its pass); the α of Leviathan et al. (2023).
tokens_per_pass = emitted / target_passes is the speed-up numerator. `forced` counts draft tokens
that a grammar forced (always 0 until grammar drafting exists), kept apart so α can later be split
into forced and free tokens.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrt.errors import SpecError


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

    @property
    def spec_passes(self) -> int:
        """Passes that verified at least one draft."""
        return sum(self.run_lengths.values())

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha_tested(self) -> float | None:
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else None

    @property
    def tokens_per_pass(self) -> float | None:
        return self.emitted / self.target_passes if self.target_passes else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; histogram keys are strings, rates are None when undefined."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejections": self.rejections,
            "forced": self.forced,
            "target_passes": self.target_passes,
            "spec_passes": self.spec_passes,
            "emitted": self.emitted,
            "run_lengths": {str(j): self.run_lengths[j] for j in sorted(self.run_lengths)},
            "alpha": self.alpha,
            "alpha_tested": self.alpha_tested,
            "tokens_per_pass": self.tokens_per_pass,
        }


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

    def to_dict(self, with_events: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq_id": self.seq_id,
            "total": self.total().to_dict(),
            "by_drafter": {name: s.to_dict() for name, s in self.by_drafter.items()},
        }
        if with_events:
            out["events"] = [e.to_dict() for e in self.events]
        return out
