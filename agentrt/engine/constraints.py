"""Grammar-constrained decoding, an engine part used with or without speculation.

A constrained sequence owns a GrammarState (spec.grammar, xgrammar). Per step the engine asks
for the masks of every logits row a constrained row verifies (its next token and one after each
draft token); drafts are cut at the first token the grammar forbids, since its masked p is 0 and
it could never be accepted. After the step the emitted tokens are committed. The template
drafter reads the same state (forced strings, try/rollback) through the drafter protocol's
GrammarCursor, so a draft follows the grammar the masks enforce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.sequence import Sequence
from agentrt.engine.step_rows import StepRow
from agentrt.engine.step_tree import tree_masks
from agentrt.kernels.argmax import argmax_rows
from agentrt.spec.grammar import (GRAMMAR_CACHE_BYTES, GrammarCache, GrammarState, apply_masks, masked_argmax,
                                  shared_grammar_cache)
from agentrt.structured.output_format import OutputFormat


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
        state = GrammarState(self.grammars.compile(fmt))
        state.completion_tokens = self.grammars.minimum_tokens(fmt, self._tokenizer.encode)  # engine.budget
        return state

    def step_masks(self, rows: list[StepRow]) -> StepMasks | None:
        """Masks for every verified row of constrained sequences, None when none is; cuts each
        constrained row's draft at the first token its grammar forbids."""
        offset, parts = 0, []
        for r in rows:
            if not r.samples:
                continue
            grammar = r.seq.grammar
            if grammar is not None:
                try:
                    bm = self.grammars.new_bitmask(r.k + 1)
                    if grammar.closing:  # finishing within max_tokens (engine.budget): drafts are the completion
                        grammar.fill_closing_masks(r.k, bm, 0)
                        parts.append((offset, bm))
                        offset += r.num_rows
                        continue
                    if r.parents is not None:  # a token tree: each node masked after its path
                        tree_masks(grammar, r, bm)
                        allowed = r.k
                    else:
                        allowed = grammar.fill_masks(r.draft, bm, 0)
                except Exception as e:  # noqa: BLE001 - one request's grammar fails that request only
                    r.failed = f"grammar failed: {type(e).__name__}: {e}"
                    r.cut(0)
                    offset += r.num_rows
                    continue
                if allowed < r.k:
                    r.cut(allowed)
                parts.append((offset, bm[: allowed + 1]))
            offset += r.num_rows
        if not parts:
            return None
        full = self.grammars.new_bitmask(offset)  # all tokens allowed
        masked: list[int] = []
        for start, bm in parts:
            full[start : start + bm.shape[0]] = bm
            masked += range(start, start + bm.shape[0])
        return StepMasks(full, masked)

    @staticmethod
    def commit(seq: Sequence, kept: list[int]) -> None:
        if seq.grammar is not None:
            seq.grammar.commit(kept)
