"""Model drafter: a smaller same-tokenizer model (or the target's own first layers) drafts k
tokens autoregressively and reports the distribution q each was drawn from.

The drafter owns no tensors of the model: a `DraftModelRunner` (built by the engine) runs the
forward passes and keeps the draft KV cache. This keeps agentrt.spec free of engine imports and
lets a layer-skip runner share the target's cache (its first N layers' K/V at accepted positions
are exactly what the draft would compute), while a separate model keeps a cache of its own.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from agentrt.decoding.sampling import process_logits, sample_from_probs
from agentrt.spec.drafters.base import Draft, DraftRequest, GrammarCursor


class DraftModelRunner(Protocol):
    vocab_size: int
    relative_cost: float  # a draft token's forward as a share of one target forward


    def cached_len(self, seq_id: int) -> int:
        """Tokens of the sequence whose draft-model K/V is already cached."""
        ...

    def forward(self, seq_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Append tokens[i] to sequence i's draft cache (from cached_len) and return the logits
        after each sequence's last fed token: [len(seq_ids), vocab]."""
        ...

    def truncate(self, seq_id: int, length: int) -> None: ...

    def release(self, seq_id: int) -> None: ...


class ModelDrafter:
    deterministic = False

    def __init__(self, runner: DraftModelRunner, name: str = "model", seed: int = 0):
        self.runner = runner
        self.name = name
        self._seed = seed
        self._gen: dict[int, torch.Generator] = {}
        self._context_len: dict[int, int] = {}

    @property
    def relative_cost(self) -> float:
        return self.runner.relative_cost

    def start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        self._gen[seq_id] = torch.Generator().manual_seed(self._seed * 1_000_003 + seq_id)

    def attach(self, seq_id: int, cursor: GrammarCursor) -> None:
        pass  # q is the draft model's own; the target's masked p decides (drafts it forbids are rejected)

    def propose(self, reqs: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft.empty() for _ in reqs]
        live = [i for i, r in enumerate(reqs) if r.max_k > 0]
        if not live:
            return drafts
        toks: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        for i in live:
            self._context_len[reqs[i].seq_id] = len(reqs[i].token_ids)
        # First pass catches each draft cache up with the context (accepted tokens since last time).
        feeds = [list(reqs[i].token_ids[self.runner.cached_len(reqs[i].seq_id):]) for i in live]
        while live:
            logits = self.runner.forward([reqs[i].seq_id for i in live], feeds)  # [len(live), V]
            probs = process_logits(
                logits,
                torch.tensor([reqs[i].temperature for i in live], dtype=torch.float32),
                torch.tensor([reqs[i].top_k for i in live], dtype=torch.long),
                torch.tensor([reqs[i].top_p for i in live], dtype=torch.float32),
            )  # [len(live), V]
            u = torch.stack([torch.rand((), generator=self._gen[reqs[i].seq_id]) for i in live])
            picked = sample_from_probs(probs, u).tolist()
            for j, i in enumerate(live):
                toks[i].append(picked[j])
                qs[i].append(probs[j])
            live = [i for i in live if len(toks[i]) < reqs[i].max_k]
            feeds = [[toks[i][-1]] for i in live]
        for i, t in toks.items():
            q = torch.stack(qs[i])  # [k, V]
            conf = q.gather(1, torch.tensor(t).unsqueeze(1)).squeeze(1).clamp(0, 1).tolist()
            drafts[i] = Draft(tokens=t, probs=q, confidence=conf)
        return drafts

    def on_verified(self, seq_id: int, num_accepted: int, emitted: list[int]) -> None:
        # Cache holds context + drafts[:k-1]; only the accepted drafts stay valid.
        base = self._context_len.get(seq_id)
        if base is not None:
            self.runner.truncate(seq_id, min(self.runner.cached_len(seq_id), base + num_accepted))

    def finish(self, seq_id: int, output_ids: list[int]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self._gen.pop(seq_id, None)
        self._context_len.pop(seq_id, None)
        self.runner.release(seq_id)
