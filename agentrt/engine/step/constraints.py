"""Grammar-constrained decoding, an engine part used with or without speculation.

A constrained sequence owns a GrammarState (structured.grammar, xgrammar). Per step the draft plan
(engine.step.draft_plan) asks for the masks of every logits row a constrained row verifies (its next
token and one after each draft token) and learns where each draft must be cut: at the first
token the grammar forbids, since its masked p is 0 and it could never be accepted. After the step
the emitted tokens are committed (Sequence.commit). The template
drafter reads the same state (forced strings, try/rollback) through the drafter protocol's
GrammarCursor, so a draft follows the grammar the masks enforce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.step import budget
from agentrt.engine.step.sequence import Sequence
from agentrt.engine.step.step_tree import tree_masks
from agentrt.kernels.argmax import argmax_rows
from agentrt.structured.grammar import (GRAMMAR_CACHE_BYTES, GrammarCache, GrammarState, apply_masks, masked_argmax,
                                        shared_grammar_cache)
from agentrt.structured.output_format import OutputFormat


# Per row, the draft tokens its grammar allows: None all, a list the indices kept (a chain's first
# m, or a tree's nodes whose paths it allows), a string the grammar's failure (it keeps none).
Kept = list[int] | str | None


@dataclass
class StepMasks:
    """The grammar masks of one step's logits rows."""

    bitmask: torch.Tensor  # [logits rows, words] int32, every token allowed on unmasked rows
    rows: list[int]  # the logits rows that belong to constrained sequences

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place. logits [rows, vocab]."""
        apply_masks(logits, self.bitmask, self.rows)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Per row, the first maximal allowed token, [rows] int64 (logits untouched)."""
        return masked_argmax(logits, self.bitmask, self.rows)


def greedy_tokens(logits: torch.Tensor, masks: StepMasks | None) -> torch.Tensor:
    """argmax of every logits row under its mask, [rows] int64."""
    return argmax_rows(logits) if masks is None else masks.argmax(logits)


class Constraints:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._grammar_cache_bytes = grammar_cache_bytes
        self._grammars: GrammarCache | None = None

    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:  # on first use; shared by the engines of one loaded model
            self._grammars = shared_grammar_cache(self._tokenizer, self._vocab_size, self._stop_ids,
                                                  self._grammar_cache_bytes)
        return self._grammars

    def state(self, fmt: OutputFormat) -> GrammarState:
        """A fresh grammar state for a request with this (constrained) output format."""
        return GrammarState(self.grammars.compile(fmt))

    def minimum_tokens(self, fmt: OutputFormat) -> int:
        """The shortest completion of an empty output in this format, in tokens (engine.step.budget)."""
        return self.grammars.minimum_tokens(fmt, self._tokenizer.encode)

    def step_masks(self, drafts: list[tuple[Sequence, list[int], tuple[int, ...] | None]]
                   ) -> tuple[StepMasks | None, list[Kept]]:
        """Masks for every verified row of the constrained sequences among a step's sampling rows
        (each as (sequence, draft tokens, tree parents or None), in the step's order), None when
        none is; and per row the draft tokens its grammar allows (engine.step.draft_plan keeps those)."""
        offset, parts, kept = 0, [], []
        for seq, tokens, parents in drafts:
            k = len(tokens)
            grammar = seq.grammar
            if grammar is None:
                kept.append(None)
                offset += k + 1
                continue
            try:
                bm = self.grammars.new_bitmask(k + 1)
                if budget.closing(seq):  # finishing within max_tokens: drafts are the completion
                    budget.fill_closing_masks(seq, k, bm)
                    keep = None
                elif parents is not None:  # a token tree: each node masked after its path
                    keep = tree_masks(grammar, tokens, parents, bm)
                else:
                    allowed = grammar.fill_masks(tokens, bm, 0)
                    keep = None if allowed == k else list(range(allowed))
            except Exception as e:  # noqa: BLE001 - one request's grammar fails that request only
                kept.append(f"grammar failed: {type(e).__name__}: {e}")
                offset += 1
                continue
            n = k if keep is None else len(keep)
            parts.append((offset, bm[: n + 1]))
            kept.append(keep)
            offset += n + 1
        if not parts:
            return None, kept
        full = self.grammars.new_bitmask(offset)  # all tokens allowed
        masked: list[int] = []
        for start, bm in parts:
            full[start : start + bm.shape[0]] = bm
            masked += range(start, start + bm.shape[0])
        return StepMasks(full, masked), kept
