"""Template drafter: the grammar's forced continuation (a tool call's skeleton: braces, keys,
the tool name) as deep as it goes, then free slots from the suffix drafter (argument values are
often copied from the prompt or from tool results), then forced again, and so on.

Forced strings are spelled the way the model wrote them before after the same context (the
suffix history), else tokenized with the model's own tokenizer (xgrammar's jump-forward tokens
split greedily rather than as the tokenizer would). In free string slots two guesses aimed at
agent requests, which quote the values they mean ('Report'): at a value's start, a quoted span
the output has not used yet; and a value copied from the prompt that reaches its closing '
closes the JSON string there. Any split or guess the model does not take costs α, never
correctness (drafts are verified against the masked p). Unconstrained requests get plain suffix
drafts.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from agentrt.spec.drafters.base import Draft, DraftRequest, GrammarCursor, branch_tree
from agentrt.spec.drafters.suffix import SuffixDrafter


QUOTED_SPAN = re.compile(r"(?<![A-Za-z0-9])'([^'\n]{2,80})'(?![A-Za-z0-9])")
QUOTE_SCAN_TOKENS = 96  # the request sits at the prompt's end, after the tool descriptions
QUOTED_CONFIDENCE = 0.5
DOUBLE_QUOTED = re.compile(r'"([^"\\\n]{1,80})"')
PROMPT_STRING_SCAN_TOKENS = 4096  # tool schemas and earlier results: the prompt's last few thousand tokens
MAX_VALUE_CANDIDATES = 8  # values tried per unit of tree width (each is a tokenization and a grammar probe)
MAX_CHARS_PER_TOKEN = 128  # more than any token of the vocabularies we load (SmolLM2: 81 characters at most)


class TemplateDrafter:
    name = "template"
    deterministic = True
    relative_cost = 0.0

    def __init__(self, suffix: SuffixDrafter, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str] | None = None):
        self.suffix = suffix
        self.encode = encode
        self.decode = decode
        self._grammar: dict[int, GrammarCursor] = {}
        self._prompt_len: dict[int, int] = {}
        self._quoted: dict[int, list[str]] = {}
        self._strings: dict[int, list[str]] = {}

    def attach(self, seq_id: int, cursor: GrammarCursor) -> None:
        """Constrain a request: drafts for it follow its grammar (the engine owns the state)."""
        self._grammar[seq_id] = cursor

    def start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        self.suffix.start(seq_id, prompt_ids)
        self._prompt_len[seq_id] = len(prompt_ids)

    def propose(self, reqs: list[DraftRequest]) -> list[Draft]:
        plain = [r for r in reqs if r.seq_id not in self._grammar]
        plain_drafts = dict(zip((r.seq_id for r in plain), self.suffix.propose(plain)))
        return [plain_drafts[r.seq_id] if r.seq_id in plain_drafts else self._template(r) for r in reqs]

    def _template(self, req: DraftRequest) -> Draft:
        state = self._grammar[req.seq_id]
        if state.terminated:
            return Draft.empty()
        tokens: list[int] = []
        confidence: list[float] = []
        forced: list[bool] = []
        advanced = 0
        self.suffix.sync(req.seq_id, req.token_ids)
        try:
            while len(tokens) < req.max_k and not state.terminated:
                room = req.max_k - len(tokens)
                # bounded: a grammar may force a long literal; `room` tokens never need more text
                text = state.forced_string()[: MAX_CHARS_PER_TOKEN * room]
                if text:
                    ids = self._model_tokenization(req.seq_id, tokens, text, room) or self.encode(text)[:room]
                    n = state.try_advance(ids)
                    advanced += n
                    tokens += ids[:n]
                    confidence += [1.0] * n
                    forced += [True] * n
                    if n < len(ids) or n == 0:
                        break
                    continue
                branches = self._value_branches(req, tokens, state, room)
                if len(branches) > 1 or (branches and req.max_width > 1):
                    # several values fit here: one tree, verified in the same pass, led by what
                    # the model wrote after this context before (the suffix history), if anything
                    return _tree_draft(tokens, confidence, forced, branches, max(req.max_k, req.max_nodes),
                                       self._suffix_lead(req.seq_id, tokens, state, room))
                ids, skeleton = branches[0] if branches else ([], [])
                if ids:
                    state.try_advance(ids)
                    advanced += len(ids)
                    tokens += ids
                    # the first token is the guess; given it, the rest of the span follows it
                    confidence += [1.0 if f else (QUOTED_CONFIDENCE if j == 0 else 0.95) for j, f in enumerate(skeleton)]
                    forced += skeleton
                    continue
                draft = self.suffix.propose_after(req.seq_id, tokens, room)
                took = 0
                for t, c in zip(draft.tokens, draft.confidence):
                    closed, skeleton = self._close_quoted_value(state, t, room - took)
                    if closed:  # a value copied from a '...' span: close the JSON string instead
                        advanced += len(closed)
                        took += len(closed)
                        tokens += closed
                        confidence += [1.0 if f else c for f in skeleton]
                        forced += skeleton
                        break
                    if state.try_advance([t]) == 0:
                        break
                    advanced += 1
                    took += 1
                    tokens.append(t)
                    confidence.append(c)
                    forced.append(False)
                    if state.terminated or state.forced_string():
                        break  # back to the skeleton (or the end)
                if took == 0:
                    break
        finally:
            state.rollback(advanced)
        return Draft(tokens=tokens, probs=None, confidence=confidence, forced=forced)

    def _value_branches(self, req: DraftRequest, pending: list[int], state: GrammarCursor,
                        room: int) -> list[tuple[list[int], list[bool]]]:
        """At the start of a string value, values as _close_string spells them (with `state` as it
        was), starting with at most req.max_width different tokens (the tree's width; values that
        share a first token share its node, as get_weather and get_stock_price share "get"): the
        spans the request quoted ('Report') that the output has not used yet, then, where the
        grammar restricts the value (an enum), the strings the prompt holds in double quotes (the
        schema's members, earlier tool results' values) that it allows. [] elsewhere."""
        if self.decode is None:
            return []
        last = pending[-1] if pending else (req.token_ids[-1] if req.token_ids else None)
        if last is None or not self.decode([last]).endswith('"'):
            return []
        output = self.decode(list(req.token_ids[self._prompt_len.get(req.seq_id, 0):]) + list(pending))
        candidates = [span for span in self._spans(req) if span not in output]
        if req.max_width > 1 and _restricted(state, self.encode):
            candidates += self._prompt_strings(req)
        branches: list[tuple[list[int], list[bool]]] = []
        for value in list(dict.fromkeys(candidates))[: MAX_VALUE_CANDIDATES * req.max_width]:
            ids, skeleton = self._close_string(state, value, room)
            if ids:
                state.rollback(len(ids))
            firsts = {b[0][0] for b in branches}
            if not ids or any(ids == b[0] for b in branches) or (ids[0] not in firsts and len(firsts) == req.max_width):
                continue
            branches.append((ids, skeleton))
        return branches

    def _suffix_lead(self, seq_id: int, pending: list[int], state: GrammarCursor, room: int) -> Draft:
        """The suffix drafter's continuation here as far as the grammar allows it (at its
        confidence), then the skeleton the grammar forces after it (`state` as it was)."""
        draft = self.suffix.propose_after(seq_id, pending, room)
        n = 0
        for t in draft.tokens:
            if state.terminated or state.try_advance([t]) == 0:
                break
            n += 1
        tokens, confidence = list(draft.tokens[:n]), list(draft.confidence[:n])
        then = state.forced_string()[: MAX_CHARS_PER_TOKEN * (room - n)] if n and not state.terminated else ""
        skeleton = self.encode(then)[: room - n] if then else []
        m = state.try_advance(skeleton) if skeleton else 0
        state.rollback(n + m)
        return Draft(tokens=tokens + skeleton[:m], probs=None, confidence=confidence + [1.0] * m,
                     forced=[False] * n + [True] * m)

    def _prompt_strings(self, req: DraftRequest) -> list[str]:
        """Double-quoted strings of the prompt (tool schemas' enum members, JSON of earlier
        tool results), the one named last in the prompt first."""
        strings = self._strings.get(req.seq_id)
        if strings is None:
            n = self._prompt_len.get(req.seq_id, len(req.token_ids))
            text = self.decode(list(req.token_ids[max(0, n - PROMPT_STRING_SCAN_TOKENS):n]))
            found = list(dict.fromkeys(DOUBLE_QUOTED.findall(text)))
            # the one the request names last first: "convert to celsius" after the schema's list
            strings = self._strings[req.seq_id] = sorted(found, key=lambda v: -text.rfind(v))
        return strings

    def _spans(self, req: DraftRequest) -> list[str]:
        """Spans quoted with '...' near the end of the prompt (the request, not the tool list)."""
        spans = self._quoted.get(req.seq_id)
        if spans is None:
            n = self._prompt_len.get(req.seq_id, len(req.token_ids))
            tail = self.decode(list(req.token_ids[max(0, n - QUOTE_SCAN_TOKENS):n]))
            spans = self._quoted[req.seq_id] = QUOTED_SPAN.findall(tail)
        return spans

    def _close_quoted_value(self, state: GrammarCursor, token: int, room: int) -> tuple[list[int], list[bool]]:
        """Requests quote the values they mean ('Report', 'Where is the station?'), and a draft
        copying one from the prompt runs into the closing ' where the JSON string closes with ".
        When `token` spells that quote, its text up to the quote as _close_string spells it;
        else ([], [])."""
        if self.decode is None:
            return [], []
        piece = self.decode([token])
        if "'" not in piece:
            return [], []
        return self._close_string(state, piece[: piece.index("'")], room)

    def _close_string(self, state: GrammarCursor, value: str, room: int) -> tuple[list[int], list[bool]]:
        """`value`, a closing " and the skeleton the grammar forces after it, as tokens advanced
        in `state`, with which of them lie wholly in the skeleton; ([], []) with `state` as it was
        when the grammar does not let the string end with `value` there. They are tokenized
        together because BPE merges the quote with what follows ('?",' is one token)."""
        closing = value + '"'
        probe = self.encode(closing)
        n = state.try_advance(probe)
        if n < len(probe):
            state.rollback(n)
            return [], []
        then = state.forced_string()
        state.rollback(n)
        ids = self.encode(closing + then)[:room]
        ids = ids[: state.try_advance(ids)]
        skeleton, start = [], 0
        for t in ids:
            skeleton.append(start >= len(closing))
            start += len(self.decode([t]))
        return ids, skeleton

    def _model_tokenization(self, seq_id: int, pending: list[int], text: str, room: int) -> list[int]:
        """The tokens the model itself wrote for (a prefix of) the forced `text` after this context
        before, per the suffix drafter's history and the request's own text, or []. The model
        does not always take the canonical split under a mask (after its own "trans" it wrote
        "lat" + "e", not "late"), and every forced token it rejects costs a pass."""
        if self.decode is None:
            return []
        out: list[int] = []
        spelled = ""
        for t in self.suffix.propose_after(seq_id, pending, room).tokens:
            piece = self.decode([t])
            # a token that spells nothing (a special token, decoded without specials) matches any
            # text and advances none: the forced text goes on in the tokenizer's own tokens
            if not piece or not text.startswith(spelled + piece):
                break
            spelled += piece
            out.append(t)
            if len(spelled) == len(text):
                break
        return out

    def on_verified(self, seq_id: int, num_accepted: int, emitted: list[int]) -> None:
        self.suffix.on_verified(seq_id, num_accepted, emitted)

    def finish(self, seq_id: int, output_ids: list[int]) -> None:
        self.suffix.finish(seq_id, output_ids)

    def release(self, seq_id: int) -> None:
        self._grammar.pop(seq_id, None)
        self._prompt_len.pop(seq_id, None)
        self._quoted.pop(seq_id, None)
        self._strings.pop(seq_id, None)
        self.suffix.release(seq_id)


def _restricted(state: GrammarCursor, encode: Callable[[str], list[int]]) -> bool:
    """Whether the grammar limits the string value here (an enum): it refuses an arbitrary one."""
    probe = encode("qzxv")
    n = state.try_advance(probe)
    state.rollback(n)
    return n < len(probe)


def _tree_draft(tokens: list[int], confidence: list[float], forced: list[bool],
                branches: list[tuple[list[int], list[bool]]], max_k: int, lead: Draft | None = None) -> Draft:
    """The chain so far, then the values as branches (base.branch_tree): a value's first token
    is a guess shared among the branches, the rest follows it, the skeleton is certain. `lead`
    (the suffix history's continuation, at its own confidence) goes first: where it and a value
    start alike they share nodes at its confidence."""
    share = 1.0 / len(branches)
    values = [Draft(tokens=ids, probs=None, forced=skeleton,
                    confidence=[1.0 if f else (QUOTED_CONFIDENCE * share if j == 0 else 0.95)
                                for j, f in enumerate(skeleton)])
              for ids, skeleton in branches]
    return branch_tree(Draft(tokens=tokens, probs=None, confidence=confidence, forced=forced),
                       ([lead] if lead is not None and lead.tokens else []) + values, max_k)
