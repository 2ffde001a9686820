"""Constrained outputs that end valid within max_tokens.

A JSON output cut by max_tokens is useless: unparseable, the whole call wasted. So in the last
stretch of its budget a constrained sequence keeps a completion of what it has written at hand
(close the open string, array and object, add the required members with the shortest values,
end a list of calls after the current one: structured.grammar.completion_from), and:

- before a step, its drafts are capped so that the completion still fits after them;
- after a step, if the tokens emitted leave no room for their completion (the model opened a
  structure: '{"' needs '": ...}' after it), the emitted run is cut back to the longest prefix
  whose completion still fits, and the completion's first token takes the place of the next one
  (or a stop token, where that prefix is complete already). Nothing is lost: the cut tokens' KV
  lies past the sequence's length, and the replacing token is fed next step as any last token is.
  The rest of the completion is then forced, one token per position (the grammar mask allows only
  it; with speculation on, fed as drafts that are accepted by construction), and the request ends
  with finish_reason "length".

So the output is the target's own until the budget binds, and then the shortest way the search
finds to make it whole: it parses and meets its schema at every budget from the schema's own
minimum (the completion from an empty output) up, unless the model opens structures faster than
the window below lets the search follow. Tool-call formats that may answer in text are completed
only once the output has started as a call: a text answer needs no completion, and a call is
never turned into a text answer. The completion is not the target's choice: it is what a cut
output is replaced with, instead of being returned invalid.

This module is the one owner of that work and of its per-sequence state (`Closing`, on
`Sequence.closing`; the grammar state keeps only the matcher). The step's draft plan
(engine.step.draft_plan) asks it for the cap and the forced completion before a step, the grammar
masks (engine.step.constraints) for a closing row's masks, the engine for the cut after a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from agentrt.engine.step.sequence import Sequence

# Tokens left below which the completion is kept at hand: CLOSING_WINDOW, or WINDOW_FACTOR times
# the longest completion seen (the schema's minimum to begin with), whichever is more; a search
# costs ~0.1-1 ms, so not at every step of a long output.
CLOSING_WINDOW = 64
WINDOW_FACTOR = 4

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


@dataclass
class Closing:
    """One constrained sequence's budget state (read and written in this module only, and
    advanced by Sequence.commit)."""

    longest: int = 0  # the longest completion seen, in tokens (the schema's minimum to begin with)
    forced: list[int] | None = None  # once set: the completion's tokens still to emit, one per position
    length: int = 0  # tokens of the completion forced in all
    cache: tuple | None = None  # (output tokens, their completion ids): the last search

    def commit(self, tokens: list[int]) -> None:
        """The output grew by `tokens`: each forced one must be the completion's next."""
        for t in tokens:
            if not self.forced:
                return
            if self.forced[0] != t:
                raise RuntimeError(f"emitted token {t} where the completion forced {self.forced[0]}")
            self.forced = self.forced[1:]


def _left(seq: Sequence) -> int:
    return seq.params.max_tokens - len(seq.output_ids)


def watched(seq: Sequence) -> bool:
    """A constrained sequence in the last stretch of its budget, not closing yet."""
    c = seq.closing
    return (c is not None and c.forced is None and not seq.grammar.terminated
            and _left(seq) <= max(CLOSING_WINDOW, WINDOW_FACTOR * c.longest))


def closing(seq: Sequence) -> bool:
    """Forcing its completion: its drafts and masks are the completion's tokens."""
    return seq.closing is not None and bool(seq.closing.forced)


def closed(seq: Sequence) -> bool:
    """A completion was forced and has been emitted in full: the output is complete."""
    return seq.closing is not None and seq.closing.forced is not None and not seq.closing.forced


def completion_length(seq: Sequence) -> int:
    """Tokens of the output that the completion forced (0: none was)."""
    return seq.closing.length if seq.closing is not None else 0


def completion_ids(seq: Sequence, encode: Encode, decode: Decode, after: list[int] = ()) -> list[int] | None:
    """The tokens of the completion after the output and `after`; None when there is none to
    take (the search gave up, or a text-capable format has not started a call)."""
    c = seq.closing
    tokens = seq.output_ids + list(after)
    # keyed by the tokens themselves: the completion fit_emitted found after a step's tokens is the
    # one draft_cap needs before the next step, once they are the output
    key = tuple(tokens)
    if c.cache is not None and c.cache[0] == key:
        return c.cache[1]
    text = decode(tokens)
    fmt = seq.output_format
    if fmt.is_text_answer(text):
        ids = None  # a text answer, or nothing yet: never completed into text
    else:
        found = seq.grammar.completion(encode, text, list(after))
        ids = None if found is None else encode(found) if found else []
    c.cache = (key, ids)
    if ids is not None:
        c.longest = max(c.longest, len(ids))
    return ids


def draft_cap(seq: Sequence, max_draft: int, encode: Encode, decode: Decode) -> int:
    """Before drafting: the drafts a sampling row may feed so that its completion fits after them."""
    if not watched(seq):
        return max_draft
    ids = completion_ids(seq, encode, decode)
    return max(0, min(max_draft, _left(seq) - len(ids) - 1)) if ids else max_draft


def forced_draft(seq: Sequence, max_draft: int) -> list[int] | None:
    """With speculation on, a closing row feeds its completion as the draft (the token after the
    draft is forced by the mask); None for a row that is not closing. (With speculation off the
    mask alone forces the completion, a token a step.)"""
    if not closing(seq):
        return None
    return list(seq.closing.forced[: min(len(seq.closing.forced) - 1, max_draft)])


def fill_closing_masks(seq: Sequence, k: int, bitmask: torch.Tensor) -> None:
    """Rows 0..k of `bitmask` (int32 words): each allows only the next token of the completion."""
    bitmask[: k + 1] = 0
    for j, t in enumerate(seq.closing.forced[: k + 1]):
        bit = 1 << (t % 32)
        bitmask[j, t // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit


def fit_emitted(seq: Sequence, emitted: list[int], encode: Encode, decode: Decode,
                stop_id: int) -> tuple[list[int], list[int] | None]:
    """After verification: (the tokens to keep, the completion still to force after them, or
    None when the output goes on freely). The emitted run is cut back to its longest prefix whose
    completion fits in the tokens left; the completion's first token is appended (a stop token
    when that prefix is complete already). Unchanged when no prefix's completion fits."""
    if not emitted or not watched(seq):
        return emitted, None
    left = _left(seq)
    for j in range(len(emitted), -1, -1):
        ids = completion_ids(seq, encode, decode, emitted[:j])
        if ids is None or len(ids) > left - j:
            continue
        if j == len(emitted):
            return emitted, None  # fits as it is (or ended: a stop token leaves nothing to complete)
        if not ids:
            return emitted[:j] + [stop_id], None  # complete at j: end there
        return emitted[:j] + ids[:1], ids[1:]
    return emitted, None


def start_forcing(seq: Sequence, rest: list[int]) -> None:
    """After the step's tokens are committed: force `rest`, the completion after them, from here on
    (its first token was emitted in this step)."""
    seq.closing.forced, seq.closing.length = rest, len(rest) + 1
