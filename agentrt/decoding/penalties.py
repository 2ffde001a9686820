"""Output controls that depend on what was generated: OpenAI's frequency and presence penalties,
the HF/vLLM repetition penalty, logit bias and min_tokens, applied to a sequence's logits rows.

Under speculation one target pass scores k + 1 positions of a sequence: row j predicts the token
after the output so far plus drafts d_1..d_j. Each row is penalized with the state of its own
prefix (the counts of output + d_1..d_j), never the state before the pass, so the distribution
row j defines is exactly the one plain decoding would sample from at that position, and the
verification rule keeps the target's distribution (greedy output identical, sampled output
equal in distribution).

    repetition (HF and vLLM, over prompt and generated tokens; > 0, 1 = off), first:
        logit[t] = logit[t] / r if logit[t] > 0 else logit[t] * r      for every t seen
    frequency / presence (OpenAI, over generated tokens; each in [-2, 2]):
        logit[t] -= frequency * count[t] + presence * (count[t] > 0)
    logit_bias: logit[t] += bias[t]
    min_tokens: the stop tokens (end of sequence and stop_token_ids) are masked at positions
        before the min_tokens-th generated token
The penalties apply before temperature, top-k and top-p (process_logits) and before a grammar's
mask, as in vLLM's order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Penalties:
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens are generated

    @property
    def active(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.logit_bias or self.min_tokens)


def _prefix_counts(output_ids: Sequence[int], drafts: Sequence[int], rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32: row j counts output_ids + drafts[:j]."""
    counts = torch.zeros(rows, vocab, dtype=torch.float32)
    if output_ids:
        counts += torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
    if rows > 1 and drafts:
        d = torch.tensor(list(drafts[: rows - 1]), dtype=torch.long)  # [rows - 1]
        step = torch.zeros(rows, vocab, dtype=torch.float32)
        step[torch.arange(1, len(d) + 1), d] = 1.0  # draft j enters at row j + 1
        counts += step.cumsum(dim=0)
    return counts


def penalize(logits: torch.Tensor, pen: Penalties, prompt_ids: Sequence[int], output_ids: Sequence[int],
             drafts: Sequence[int]) -> None:
    """Apply `pen` in place to one sequence's rows. logits: [k + 1, vocab] float (row j after
    output_ids + drafts[:j]); drafts: the k drafts verified by those rows."""
    rows, vocab = logits.shape
    if pen.frequency or pen.presence or pen.repetition != 1.0:
        counts = _prefix_counts(output_ids, drafts, rows, vocab)  # [rows, vocab]
        if pen.repetition != 1.0:
            seen = counts > 0
            if prompt_ids:
                seen[:, torch.tensor(list(prompt_ids), dtype=torch.long)] = True
            r = pen.repetition
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
        if pen.frequency or pen.presence:
            logits -= pen.frequency * counts + pen.presence * (counts > 0).float()
    if pen.logit_bias:
        ids = torch.tensor([t for t, _ in pen.logit_bias], dtype=torch.long)
        logits[:, ids] += torch.tensor([b for _, b in pen.logit_bias], dtype=logits.dtype)
    if pen.min_tokens and pen.stop_ids:
        short = [j for j in range(rows) if len(output_ids) + j < pen.min_tokens]
        if short:
            rows_t = torch.tensor(short, dtype=torch.long).unsqueeze(1)
            logits[rows_t, torch.tensor(list(pen.stop_ids), dtype=torch.long).unsqueeze(0)] = float("-inf")


def penalize_reference(logits_row: torch.Tensor, pen: Penalties, prompt_ids: Sequence[int],
                       generated: Sequence[int]) -> torch.Tensor:
    """The rule for one position, written plainly (a loop over tokens), for tests: the logits
    after `generated` (output plus the drafts before this position)."""
    out = logits_row.clone()
    counts: dict[int, int] = {}
    for t in generated:
        counts[t] = counts.get(t, 0) + 1
    if pen.repetition != 1.0:
        for t in set(prompt_ids) | set(counts):
            out[t] = out[t] / pen.repetition if out[t] > 0 else out[t] * pen.repetition
    for t, c in counts.items():
        out[t] -= pen.frequency * c + pen.presence
    for t, b in pen.logit_bias:
        out[t] += b
    if len(generated) < pen.min_tokens:
        for t in pen.stop_ids:
            out[t] = float("-inf")
    return out
