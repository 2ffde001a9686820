"""A request's speculation figures, frozen: what the engine hands out when a request finishes.

The engine accumulates them in `spec.stats` (DraftStats per drafter) and freezes them here; the
runtime, the server and the benchmarks read the derived rates (α, tokens per pass) from these
properties instead of recomputing them, and `to_dict()` / `from_dict()` are the JSON shape that
traces, engine workers and API bodies carry.

Rates (None when undefined):
* alpha = accepted / drafted: the fraction of proposed tokens kept. Drafts after a rejection count
  as not accepted although they were never tested.
* alpha_tested = accepted / (accepted + rejections): the per-position acceptance probability (each
  tested draft is either accepted or is the one rejection of its pass); the α of Leviathan et al.
* alpha_free / alpha_forced: α of the drafts a grammar did not force / did force. Forced drafts are
  counted among the accepted ones (they cannot be rejected), so alpha_forced is 1 when any exist.
* tokens_per_pass = emitted / target_passes: the speed-up numerator.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agentrt.errors import SpecError

_COUNTS = ("drafted", "accepted", "rejections", "forced", "target_passes", "emitted")


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class SpecFigures:
    """Speculation counts of one drafter (or of all of a request's drafters, or of many requests)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept (forced ones included)
    rejections: int = 0  # passes that ended on a rejected draft
    forced: int = 0  # accepted drafts a grammar forced
    target_passes: int = 0  # verification passes (target forwards), k = 0 ones included
    emitted: int = 0  # tokens appended: accepted drafts plus each pass's own (bonus) token
    # accepted-run-length histogram: run_lengths[j] = passes with k >= 1 that accepted exactly j
    run_lengths: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"speculation figure {name} must be a non-negative integer, got {value!r}")
        if self.accepted > self.drafted:
            raise SpecError(f"accepted drafts ({self.accepted}) exceed drafted ones ({self.drafted})")
        if self.forced > self.accepted:
            raise SpecError(f"forced drafts ({self.forced}) exceed accepted ones ({self.accepted})")
        object.__setattr__(self, "run_lengths", _frozen({int(j): int(n) for j, n in self.run_lengths.items()}))

    # ---- derived figures: computed here and nowhere else ----------------------------------
    @property
    def spec_passes(self) -> int:
        """Passes that verified at least one draft."""
        return sum(self.run_lengths.values())

    @property
    def free_drafted(self) -> int:
        return self.drafted - self.forced

    @property
    def free_accepted(self) -> int:
        return self.accepted - self.forced

    @property
    def bonus(self) -> int:
        """Tokens the target produced itself (one per pass unless a stop cut it)."""
        return self.emitted - self.accepted

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha_tested(self) -> float | None:
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else None

    @property
    def alpha_free(self) -> float | None:
        return self.free_accepted / self.free_drafted if self.free_drafted > 0 else None

    @property
    def alpha_forced(self) -> float | None:
        return 1.0 if self.forced else None

    @property
    def tokens_per_pass(self) -> float | None:
        return self.emitted / self.target_passes if self.target_passes else None

    @property
    def drafts_per_pass(self) -> float | None:
        return self.drafted / self.target_passes if self.target_passes else None

    # ---- aggregation -----------------------------------------------------------------------
    def __add__(self, other: SpecFigures) -> SpecFigures:
        if not isinstance(other, SpecFigures):
            return NotImplemented
        runs = dict(self.run_lengths)
        for j, n in other.run_lengths.items():
            runs[j] = runs.get(j, 0) + n
        return SpecFigures(**{k: getattr(self, k) + getattr(other, k) for k in _COUNTS}, run_lengths=runs)

    @classmethod
    def sum(cls, parts: Iterable[SpecFigures]) -> SpecFigures:
        out = cls()
        for part in parts:
            out = out + part
        return out

    # ---- JSON boundary ----------------------------------------------------------------------
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SpecFigures:
        """Read to_dict()'s shape back (derived rates are recomputed, counts missing are 0)."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise SpecError(f"speculation figures must be an object, got {type(d).__name__}")
        try:
            counts = {k: int(d.get(k) or 0) for k in _COUNTS}
            runs = {int(j): int(n) for j, n in (d.get("run_lengths") or {}).items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise SpecError(f"speculation figures: a count is not an integer ({e})") from None
        return cls(**counts, run_lengths=runs)


@dataclass(frozen=True)
class SpecReport:
    """One request's speculation: its total and the split by drafter ("none" for passes without
    drafts). seq_id is the engine's sequence id (None for figures summed over requests)."""

    seq_id: int | None = None
    total: SpecFigures = field(default_factory=SpecFigures)
    by_drafter: Mapping[str, SpecFigures] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_drafter", _frozen(self.by_drafter))

    @classmethod
    def of_drafters(cls, seq_id: int | None, by_drafter: Mapping[str, SpecFigures]) -> SpecReport:
        return cls(seq_id, SpecFigures.sum(by_drafter.values()), by_drafter)

    @classmethod
    def sum(cls, reports: Iterable[SpecReport]) -> SpecReport:
        """Figures over many requests (e.g. an API call's n choices), merged per drafter."""
        by: dict[str, SpecFigures] = {}
        total = SpecFigures()
        for r in reports:
            total = total + r.total
            for name, figs in r.by_drafter.items():
                by[name] = by.get(name, SpecFigures()) + figs
        return cls(None, total, by)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_id": self.seq_id,
            "total": self.total.to_dict(),
            "by_drafter": {name: s.to_dict() for name, s in self.by_drafter.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SpecReport:
        """Read to_dict()'s shape back; an empty or missing object is a request without figures."""
        if not d:
            return cls()
        if not isinstance(d, Mapping):
            raise SpecError(f"a speculation report must be an object, got {type(d).__name__}")
        by = d.get("by_drafter") or {}
        if not isinstance(by, Mapping):
            raise SpecError(f"speculation report by_drafter must be an object, got {type(by).__name__}")
        return cls(d.get("seq_id"), SpecFigures.from_dict(d.get("total")),
                   {str(name): SpecFigures.from_dict(s) for name, s in by.items()})


NO_SPEC = SpecReport()
