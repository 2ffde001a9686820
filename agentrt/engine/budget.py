"""Constrained outputs that end valid within max_tokens.

A JSON output cut by max_tokens is useless: unparseable, the whole call wasted. So in the last
stretch of its budget a constrained sequence keeps a completion of what it has written at hand
(close the open string, array and object, add the required members with the shortest values,
end a list of calls after the current one: spec.grammar.completion_from), and:

- before a step, drafts are capped so that the completion would still fit after them, and once
  the tokens left come down to the completion's length, it is taken: its tokens are forced one
  per position (the grammar mask allows only them, so as drafts they are accepted by
  construction; with speculation off, one a step) and the request ends with finish_reason
  "length";
- after a step, if the tokens emitted would leave no room for their completion (the model opened
  a structure: '{"' needs '": ...}' after it), the emitted run is cut back to the longest prefix
  whose completion still fits and the completion's first token takes the place of the next one.
  Nothing is lost: the cut tokens' KV lies past the sequence's length, and the replacing token is
  fed next step as any last token is.

So the output is the target's own until the budget binds, and then the shortest way the search
finds to make it whole; it parses and meets its schema at every budget from the schema's own
minimum (the completion from an empty output) up. The completion is not the target's choice: it
is what a cut output is replaced with, instead of being returned invalid.
"""
from __future__ import annotations

from typing import Callable

from agentrt.engine.sequence import Sequence
from agentrt.engine.step_rows import StepRow

# Tokens left below which the completion is kept at hand (or twice the last completion's length,
# if longer): a search costs ~0.1-1 ms, so not at every step of a long output.
CLOSING_WINDOW = 64

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def _left(seq: Sequence) -> int:
    return seq.params.max_tokens - len(seq.output_ids)


def _watched(seq: Sequence) -> bool:
    """A constrained sequence in the last stretch of its budget, not closing yet."""
    g = seq.grammar
    return (g is not None and g.closing is None and not g.terminated
            and _left(seq) <= max(CLOSING_WINDOW, 2 * g.completion_tokens))


def completion_ids(seq: Sequence, encode: Encode, decode: Decode, after: list[int] = ()) -> list[int] | None:
    """The tokens of the completion after the output and `after`; None when none was found."""
    g = seq.grammar
    key = (len(seq.output_ids), tuple(after))
    if g.completion_cache is not None and g.completion_cache[0] == key:
        return g.completion_cache[1]
    text = g.completion(encode, decode(seq.output_ids + list(after)), list(after))
    ids = None if text is None else encode(text) if text else []
    g.completion_cache = (key, ids)
    if ids is not None:
        g.completion_tokens = len(ids)
    return ids


def plan_closings(rows: list[StepRow], encode: Encode, decode: Decode) -> None:
    """Before drafting: cap each watched row's drafts so that its completion fits after them, or
    start forcing the completion when the tokens left come down to it (GrammarState.closing)."""
    for r in rows:
        if not r.samples or not _watched(r.seq):
            continue
        ids = completion_ids(r.seq, encode, decode)
        if not ids:  # complete already (a finished value, a text answer), or no completion found
            continue
        left = _left(r.seq)
        if left <= len(ids):
            r.seq.grammar.closing, r.seq.grammar.closing_length = ids, len(ids)
        else:
            r.max_draft = min(r.max_draft, left - len(ids) - 1)


def force_closings(rows: list[StepRow]) -> None:
    """After drafting, with speculation on: rows that are closing feed their completion as the
    draft (the drafter's proposal is dropped); the token after the draft is forced by the mask.
    With speculation off the mask alone forces the completion, a token a step."""
    for r in rows:
        grammar = r.seq.grammar
        if r.samples and grammar is not None and grammar.closing:
            k = min(len(grammar.closing) - 1, r.max_draft)
            r.draft, r.q, r.forced = list(grammar.closing[:k]), None, [True] * k
            r.expected_accepted = float(k)


def fit_emitted(seq: Sequence, emitted: list[int], encode: Encode, decode: Decode) -> tuple[list[int], list[int] | None]:
    """After verification: (the tokens to keep, the completion still to force after them, or
    None when the output goes on freely). The emitted run is cut back to its longest prefix
    whose completion fits in the tokens left, the completion's first token appended."""
    if not emitted or not _watched(seq):
        return emitted, None
    left = _left(seq)
    for j in range(len(emitted), -1, -1):
        ids = completion_ids(seq, encode, decode, emitted[:j])
        if ids is None:
            continue
        if j == len(emitted) and len(ids) <= left - j:
            return emitted, None  # fits as it is (or ended: a stop token leaves nothing to complete)
        if j < len(emitted) and ids and len(ids) <= left - j:
            return emitted[:j] + ids[:1], ids[1:]
    return emitted, None  # no completion found from any prefix: the output may end cut
