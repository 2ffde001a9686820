"""The drafter protocol: what the engine asks of anything that proposes draft tokens.

Lifecycle of one request, as the engine drives it:

    start(seq_id, prompt_ids)                          once, before the first propose
    attach(seq_id, cursor)                             once after start, for a constrained request
    loop:  propose([DraftRequest(seq_id, context, max_k), ...])  -> [Draft, ...]
           (target verifies)  on_verified(seq_id, num_accepted, emitted)
    finish(seq_id, output_ids)                         once, when the request completes normally
    release(seq_id)                                    always, last (also after an abort)

Exactness does not depend on the drafter: a Draft's tokens must be drawn from the processed
distribution it reports in `probs` (or be a deterministic function of the context when `probs`
is None); verification then emits exactly the target's distribution whatever the draft says.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from agentrt.errors import SpecError


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    # The whole context: prompt + output so far. The last token is the one the engine feeds next
    # (its target distribution is the first verified position), so drafts continue after it.
    token_ids: Sequence[int]
    max_k: int  # propose at most this many tokens (the k controller's budget for this step)
    # The request's sampling processing; model drafters draw from q processed the same way.
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_width: int = 1  # a deterministic drafter may propose a token tree this wide (1: a chain)
    # a tree may hold this many nodes (0: max_k); the engine verifies the max_k it reaches most
    # often (spec.tree_order), so a tree can offer a deep likely branch and its alternatives both
    max_nodes: int = 0

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise SpecError(f"DraftRequest.max_k must be >= 0, got {self.max_k} for seq {self.seq_id}")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise SpecError(
                f"DraftRequest sampling parameters out of range for seq {self.seq_id}: temperature="
                f"{self.temperature} (>= 0), top_k={self.top_k} (>= 0), top_p={self.top_p} (in (0, 1])"
            )


@dataclass
class Draft:
    tokens: list[int]
    # [k, V] processed q the tokens were drawn from; None when the drafter is deterministic.
    probs: torch.Tensor | None = None
    # Per token, the drafter's estimate of P(accepted | previous accepted), in [0, 1]; the k
    # controller uses it to decide how much of the draft to verify.
    confidence: list[float] = field(default_factory=list)
    # Per token, whether a grammar forced it (the template drafter); empty = none forced.
    forced: list[bool] = field(default_factory=list)
    # A token tree instead of a chain (deterministic drafters only): each token's parent, -1 for
    # the context's last token, parents before children, siblings distinct (spec.tree_verify).
    # Truncating keeps the first k nodes, so the drafter lists its likeliest branch first.
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None and (len(self.parents) != len(self.tokens) or self.probs is not None):
            raise SpecError(f"Draft.parents has {len(self.parents)} entries for {len(self.tokens)} tokens "
                            "(trees are for point-mass drafts: probs must be None)")
        if self.forced and len(self.forced) != len(self.tokens):
            raise SpecError(f"Draft.forced has {len(self.forced)} entries for {len(self.tokens)} tokens")
        if len(self.confidence) != len(self.tokens):
            raise SpecError(
                f"Draft.confidence has {len(self.confidence)} entries for {len(self.tokens)} tokens"
            )
        if any(not 0.0 <= c <= 1.0 for c in self.confidence):
            raise SpecError(f"Draft.confidence must lie in [0, 1], got {self.confidence}")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise SpecError(
                f"Draft.probs must have shape [{len(self.tokens)}, V], got {tuple(self.probs.shape)}"
            )

    @classmethod
    def empty(cls) -> Draft:
        return cls(tokens=[], probs=None, confidence=[])

    def truncated(self, k: int) -> Draft:
        """The first k tokens (the k controller may verify fewer than were proposed)."""
        probs = None if self.probs is None else self.probs[:k]
        parents = None if self.parents is None else self.parents[:k]
        return Draft(tokens=self.tokens[:k], probs=probs, confidence=self.confidence[:k], forced=self.forced[:k],
                     parents=parents)

    def first_branch(self) -> Draft:
        """A tree's chain from the root to its first leaf (the draft itself when it is a chain)."""
        if self.parents is None:
            return self
        path, at = [], -1
        while (nxt := next((i for i in range(at + 1, len(self.parents)) if self.parents[i] == at), None)) is not None:
            path.append(nxt)
            at = nxt
        return Draft(tokens=[self.tokens[i] for i in path], probs=None, confidence=[self.confidence[i] for i in path],
                     forced=[self.forced[i] for i in path] if self.forced else [])


class GrammarCursor(Protocol):
    """A constrained request's place in its grammar, as a drafter may read it (the engine owns
    the state and commits what was emitted; structured.grammar.GrammarState implements this)."""

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        ...

    def forced_string(self) -> str:
        """The text the grammar forces next, whatever the model would choose ("" when free)."""
        ...

    def try_advance(self, tokens: list[int]) -> int:
        """Advance through as many of tokens as the grammar allows; returns how many. The
        caller rolls them back before returning its draft."""
        ...

    def rollback(self, n: int) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    name: str  # short, stable: used as the key of statistics and trace events
    deterministic: bool  # True: every Draft has probs None (q is a point mass)
    # What drafting one token costs, as a share of one target forward of a single token: 0 for
    # model-free drafters, the draft model's share of the target's parameters otherwise. The k
    # controller prices drafts with it until it has timed some.
    relative_cost: float

    def start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        """Begin a request. Per-request state is keyed by seq_id, which must not be in use."""
        ...

    def attach(self, seq_id: int, cursor: GrammarCursor) -> None:
        """The request's output is constrained by a grammar: drafts that follow it are the only
        ones that can be accepted. Drafters that do not read grammars ignore this."""
        ...

    def propose(self, reqs: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order, each with at most req.max_k tokens (zero is fine).

        Must not assume any draft will be accepted: proposals leave no state that
        on_verified would have to undo, or on_verified undoes it.
        """
        ...

    def on_verified(self, seq_id: int, num_accepted: int, emitted: list[int]) -> None:
        """The target emitted `emitted` (the first num_accepted of the last draft, then the
        recovered or bonus token; the engine may cut it short at a stop token). Afterwards the
        drafter's view of the context is the old context + emitted, and nothing beyond it."""
        ...

    def finish(self, seq_id: int, output_ids: list[int]) -> None:
        """The request completed with these output tokens (drafters that learn across requests,
        like the suffix drafter's shared history, record them here). Does not free state."""
        ...

    def release(self, seq_id: int) -> None:
        """Free all per-request state. Idempotent; called after finish or on abort."""
        ...


def branch_tree(prefix: Draft, branches: list[Draft], max_k: int) -> Draft:
    """`prefix` (a chain), then `branches` as a trie below its last token (branches sharing first
    tokens share those nodes, so siblings differ), level by level while max_k nodes last:
    truncating a tree keeps its first nodes, so every branch keeps its first tokens. The first
    branch is the drafter's likeliest. A chain when fewer than two branches differ."""
    parents = list(range(-1, len(prefix.tokens) - 1))
    tokens, confidence = list(prefix.tokens), list(prefix.confidence)
    forced = list(prefix.forced) or [False] * len(tokens)
    node: dict[tuple[int, ...], int] = {(): len(tokens) - 1}  # a branch's prefix -> its node
    for j in range(max((len(b.tokens) for b in branches), default=0)):
        for b in branches:
            key = tuple(b.tokens[: j + 1])
            if len(b.tokens) <= j or key in node or key[:-1] not in node or len(tokens) >= max_k:
                continue
            node[key] = len(tokens)
            parents.append(node[key[:-1]])
            tokens.append(b.tokens[j])
            confidence.append(b.confidence[j])
            forced.append(bool(b.forced) and b.forced[j])
    tree = parents != list(range(-1, len(tokens) - 1))
    return Draft(tokens=tokens, probs=None, confidence=confidence, forced=forced, parents=parents if tree else None)

