"""The engine's side of speculative decoding: ask the drafter for drafts, size them, account α.

The spec package holds the pieces (drafters, verification, controller); this class wires them to
the engine's sequences. Kept separate so the engine step reads as schedule -> propose -> forward
-> verify -> advance.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from agentrt.engine.outputs import StepRecord
from agentrt.engine.sequence import Sequence


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "none"  # none | suffix | layerskip:N | draft:PATH
    k: int | None = None  # fixed k; None = adaptive
    kmax: int = 16


@dataclass
class Proposal:
    tokens: list[list[int]]  # per scheduled sequence, its drafts (maybe empty)
    expected_accepted: list[float] = field(default_factory=list)
    predicted_s: float | None = None
    draft_s: float = 0.0

    @property
    def any(self) -> bool:
        return any(self.tokens)


class SpecRunner:
    def __init__(self, config: SpecConfig, engine):
        self.config = config
        self.engine = engine

    def start(self, seq: Sequence) -> None:
        pass

    def propose(self, seqs: list[Sequence], samples: list[bool]) -> Proposal:
        t0 = time.monotonic()
        return Proposal(tokens=[[] for _ in seqs], draft_s=time.monotonic() - t0)

    def mask(self, plan, sampling: list[int], probs: torch.Tensor) -> torch.Tensor:
        return probs

    def draft_probs(self, sampling: list[int], ks: list[int], vocab: int) -> torch.Tensor | None:
        return None

    def on_verified(self, seq: Sequence, draft: list[int], kept: list[int]) -> None:
        pass

    def observe(self, record: StepRecord) -> None:
        pass

    def finish(self, seq: Sequence) -> dict:
        return {}
