"""Template drafter: the grammar's forced continuation (a tool call's skeleton: braces, keys,
the tool name) as deep as it goes, then free slots from the suffix drafter (argument values are
often copied from the prompt or from tool results), then forced again, and so on.

Forced strings are tokenized with the model's own tokenizer: xgrammar's jump-forward tokens
split greedily rather than as the tokenizer would. A canonical tokenization that differs from
the model's own costs α, never correctness (drafts are verified against the masked p).
Unconstrained requests get plain suffix drafts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from agentrt.spec.drafters.base import Draft, DraftRequest
from agentrt.spec.drafters.suffix import SuffixDrafter
from agentrt.spec.grammar import GrammarState


class TemplateDrafter:
    name = "template"
    deterministic = True

    def __init__(self, suffix: SuffixDrafter, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str] | None = None):
        self.suffix = suffix
        self.encode = encode
        self.decode = decode
        self._grammar: dict[int, GrammarState] = {}

    def attach(self, seq_id: int, state: GrammarState) -> None:
        """Constrain a request: drafts for it follow its grammar state (owned by the engine)."""
        self._grammar[seq_id] = state

    def start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        self.suffix.start(seq_id, prompt_ids)

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
                text = state.forced_string()
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
                draft = self.suffix.propose_after(req.seq_id, tokens, room)
                took = 0
                for t, c in zip(draft.tokens, draft.confidence):
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
            spelled += self.decode([t])
            if not text.startswith(spelled):
                break
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
        self.suffix.release(seq_id)
