"""The null drafter: proposes nothing, so every step is a plain decode step (k = 0)."""
from __future__ import annotations

from collections.abc import Sequence

from agentrt.spec.drafters.base import Draft, DraftRequest, GrammarCursor


class NullDrafter:
    name = "null"
    deterministic = True
    relative_cost = 0.0

    def start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        pass

    def attach(self, seq_id: int, cursor: GrammarCursor) -> None:
        pass

    def propose(self, reqs: list[DraftRequest]) -> list[Draft]:
        return [Draft.empty() for _ in reqs]

    def on_verified(self, seq_id: int, num_accepted: int, emitted: list[int]) -> None:
        pass

    def finish(self, seq_id: int, output_ids: list[int]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass
