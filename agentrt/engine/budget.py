"""Constrained outputs that end valid within max_tokens.

A JSON output cut by max_tokens is useless: unparseable, the whole call wasted. So in the last
stretch of its budget a constrained sequence keeps a completion of what it has written at hand
(close the open string, array and object, add the required members with the shortest values,
end a list of calls after the current one: spec.grammar.completion_from), and:

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
"""
from __future__ import annotations

from typing import Callable

from agentrt.engine.sequence import Sequence

# Tokens left below which the completion is kept at hand: CLOSING_WINDOW, or WINDOW_FACTOR times
# the longest completion seen (the schema's minimum to begin with), whichever is more; a search
# costs ~0.1-1 ms, so not at every step of a long output.
CLOSING_WINDOW = 64
WINDOW_FACTOR = 4

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def _left(seq: Sequence) -> int:
    return seq.params.max_tokens - len(seq.output_ids)


def watched(seq: Sequence) -> bool:
    """A constrained sequence in the last stretch of its budget, not closing yet."""
    g = seq.grammar
    return (g is not None and g.closing is None and not g.terminated
            and _left(seq) <= max(CLOSING_WINDOW, WINDOW_FACTOR * g.completion_tokens))


def closing(seq: Sequence) -> bool:
    return seq.grammar is not None and bool(seq.grammar.closing)


def completion_ids(seq: Sequence, encode: Encode, decode: Decode, after: list[int] = ()) -> list[int] | None:
    """The tokens of the completion after the output and `after`; None when there is none to
    take (the search gave up, or a text-capable format has not started a call)."""
    g = seq.grammar
    tokens = seq.output_ids + list(after)
    # keyed by the tokens themselves: the completion fit_emitted found after a step's tokens is the
    # one plan_closings needs before the next step, once they are the output
    key = tuple(tokens)
    if g.completion_cache is not None and g.completion_cache[0] == key:
        return g.completion_cache[1]
    text = decode(tokens)
    fmt = seq.output_format
    if fmt.is_text_answer(text):
        ids = None  # a text answer, or nothing yet: never completed into text
    else:
        found = g.completion(encode, text, list(after))
        ids = None if found is None else encode(found) if found else []
    g.completion_cache = (key, ids)
    if ids is not None:
        g.completion_tokens = max(g.completion_tokens, len(ids))
    return ids


def plan_closings(rows: list, encode: Encode, decode: Decode) -> None:
    """Before drafting: cap each watched row's drafts so that its completion fits after them."""
    for r in rows:
        if not r.samples or not watched(r.seq):
            continue
        ids = completion_ids(r.seq, encode, decode)
        if ids:
            r.max_draft = max(0, min(r.max_draft, _left(r.seq) - len(ids) - 1))


def force_closings(rows: list) -> None:
    """After drafting, with speculation on: rows that are closing feed their completion as the
    draft; the token after the draft is forced by the mask. (With speculation off the mask alone
    forces the completion, a token a step.)"""
    for r in rows:
        grammar = r.seq.grammar
        if r.samples and grammar is not None and grammar.closing:
            k = min(len(grammar.closing) - 1, r.max_draft)
            r.draft, r.q, r.forced = list(grammar.closing[:k]), None, [True] * k
            r.expected_accepted = float(k)


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
