"""Suffix drafter, in the spirit of SuffixDecoding (Oliaro et al., 2024): model-free drafts copied
from text the request or earlier requests already produced. Agent traffic repeats itself (re-sent
prompts, tool-call JSON, the same scaffolding every step), so the longest earlier match of the
context's suffix is often followed by exactly what the target is about to say.

Structure: `SuffixTrie`, a depth-bounded suffix trie with occurrence counts over a token text,
stored as parallel arrays (node -> count, most recent end position, children dict). Each node is a
string w with |w| <= max_depth; count(w) is how often w occurs. Why this and not a suffix
automaton: a SAM finds the longest match in O(1) amortised, but its occurrence counts live on the
suffix-link tree and cannot be kept current per appended token without O(n) propagation, and
counts are what the confidence is made of. The trie keeps exact counts with O(max_depth) work per
appended token. Its usual cost, O(n * max_depth) nodes, is avoided by materialising lazily: a
string that has occurred only once is not a node but a "virtual leaf" (a negative child reference
holding the text position where that single occurrence ends); its whole subtree is the text that
follows. A second occurrence materialises one node per step it keeps following the first. So nodes
are only built for repeated strings, and unique text (most prose) costs O(1) nodes per token.

Appending token t at text position n extends the "active" suffixes: the suffixes of the text that
occur at least twice and are shorter than max_depth (a suffix that became unique can never repeat
again as a suffix, so it leaves the set for good). That is at most max_depth dict lookups per
token: incremental, never a rebuild. The deepest active suffix is, for free, the longest suffix of
the context that occurred earlier: the per-request match costs nothing to find.

Two sources are consulted per request, and the higher-scoring draft wins (score = expected number
of accepted tokens, the sum of cumulative confidence products):
1. the request's own trie over prompt + output so far, kept in sync with DraftRequest.token_ids;
2. a shared history of earlier finished outputs, as two generations of tries capped at
   history_tokens // 2 tokens each; when the newest is full the oldest is dropped whole (bounded
   memory, O(1) eviction, no count decrements). The longest context suffix present there is found
   by binary search on its length (presence is monotone: a suffix of a present string is present).

Drafting from a match node walks the most frequent child (ties: the most recent occurrence). Each
token's confidence is the child's empirical frequency, smoothed towards a prior that grows with the
match length: conf = (count(child) + w * d / (d + h)) / (count(children) + w), d = matched length,
w = prior_weight, h = prior_half_length. One earlier occurrence after a 30-token match is a strong
signal, after a 1-token match a weak one. Drafting stops at max_k, when no continuation exists, or
when the product of confidences would fall under min_confidence. Pure Python ints; no torch.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from agentrt.errors import SpecError
from agentrt.spec.drafters.base import Draft, DraftRequest, GrammarCursor, branch_tree
from agentrt.spec.drafters.progression import ProgressionConfig, progression_draft

DOC_SEPARATOR = -1  # separates documents in a trie's text; never a token, so matches stop there

# A position in a trie: (node, end). node >= 0: a materialised node. node == -1: inside a virtual
# chain, the single occurrence of the matched string ends at text[end].
Position = tuple[int, int]


class SuffixTrie:
    """Depth-bounded suffix trie with occurrence counts over one text of one or more documents."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise SpecError(f"SuffixTrie max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.text: list[int] = []
        self.num_tokens = 0  # tokens in text, separators excluded
        self.count = array("q", [0])  # node -> occurrences of its string
        self.last = array("q", [-1])  # node -> text position where its latest occurrence ends
        self.prev = array("q", [-1])  # node -> where the occurrence before the latest ends
        self.kids: list[dict[int, int] | None] = [None]  # node -> {token: node id, or -(end + 1)}
        self._active: list[tuple[int, int]] = []  # (node, depth) of repeated text suffixes, deepest first

    def start_document(self) -> None:
        """Later tokens begin a new document: no string spans the boundary."""
        if self.text and self.text[-1] != DOC_SEPARATOR:
            self.text.append(DOC_SEPARATOR)
        self._active = []

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        if token < 0:
            raise SpecError(f"SuffixTrie: token ids must be >= 0, got {token}")
        text, count, last, kids = self.text, self.count, self.last, self.kids
        n = len(text)
        text.append(token)
        self.num_tokens += 1
        count[0] += 1
        active: list[tuple[int, int]] = []
        for node, depth in (*self._active, (0, 0)):
            children = kids[node]
            if children is None:
                children = kids[node] = {}
            ref = children.get(token)
            if ref is None:  # first occurrence of this string: a virtual leaf, no longer active
                children[token] = -(n + 1)
                continue
            depth += 1
            if ref >= 0:
                count[ref] += 1
                self.prev[ref] = last[ref]
                last[ref] = n
            else:  # second occurrence: materialise; the first one's next token becomes virtual
                ref = self._materialise(-ref - 1, n, depth)
                children[token] = ref
            if depth < self.max_depth:
                active.append((ref, depth))
        self._active = active

    def _materialise(self, first_end: int, n: int, depth: int) -> int:
        node = len(self.count)
        self.count.append(2)
        self.last.append(n)
        self.prev.append(first_end)
        self.kids.append(None)
        following = first_end + 1  # <= n, already in text
        if depth < self.max_depth and self.text[following] != DOC_SEPARATOR:
            self.kids[node] = {self.text[following]: -(following + 1)}
        return node

    def longest_repeated_suffix(self) -> tuple[Position, int] | None:
        """The deepest suffix of the text that also occurred earlier: (position, length)."""
        if not self._active:
            return None
        node, depth = self._active[0]
        return (node, -1), depth

    def locate(self, pattern: list[int]) -> Position | None:
        """Where `pattern` (len <= max_depth) occurs in the trie, or None."""
        node, kids, i = 0, self.kids, 0
        while i < len(pattern):
            children = kids[node]
            ref = None if children is None else children.get(pattern[i])
            if ref is None:
                return None
            i += 1
            if ref >= 0:
                node = ref
                continue
            end, rest = -ref - 1, pattern[i:]
            if self.text[end + 1 : end + 1 + len(rest)] != rest:
                return None
            return (-1, end + len(rest))
        return (node, -1)

    def occurrences(self, pattern: list[int]) -> int:
        pos = self.locate(pattern)
        if pos is None:
            return 0
        return 1 if pos[0] < 0 else self.count[pos[0]]

    def continuations(self, pos: Position, extension: Sequence[int] = ()) -> list[tuple[int, int, int, Position]]:
        """(token, count, recency, child position) for every token seen after `pos`.

        `extension` is read as if appended to the text (a request's own draft so far): a chain
        that reaches the end of the text goes on through it, so periodic text drafts its period.
        """
        node, end = pos
        children = self.kids[node] if node >= 0 else None
        if children:
            out = []
            for token, ref in children.items():
                if ref >= 0:
                    out.append((token, self.count[ref], self.last[ref], (ref, -1)))
                else:
                    out.append((token, 1, -ref - 1, (-1, -ref - 1)))
            return out
        ends = (self.last[node], self.prev[node]) if node >= 0 else (end,)
        size = len(self.text)
        for end in ends:  # no counted children (depth limit): follow the latest occurrence's text
            following = end + 1  # the latest may be the context itself, with nothing after it
            if following <= 0:
                continue
            if following < size:
                token = self.text[following]
            elif following - size < len(extension):
                token = extension[following - size]
            else:
                continue
            if token != DOC_SEPARATOR:
                return [(token, 1, following, (-1, following))]
        return []


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 32  # trie depth: longest counted string
    max_pattern: int = 32  # longest context suffix matched against the shared history
    history_tokens: int = 1 << 16  # cap on tokens kept in the shared history (two generations): ~0.1-1.1 KB each
    min_confidence: float = 0.2  # stop drafting when the confidence product would fall below this
    prior_weight: float = 2.0  # pseudo-count of the match-length prior
    prior_half_length: float = 4.0  # match length at which the prior is 0.5

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_pattern < 1:
            raise SpecError(f"SuffixConfig max_depth and max_pattern must be >= 1, got {self}")
        if self.history_tokens < 2:
            raise SpecError(f"SuffixConfig history_tokens must be >= 2, got {self.history_tokens}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise SpecError(f"SuffixConfig min_confidence must lie in [0, 1], got {self.min_confidence}")
        if self.prior_weight < 0 or self.prior_half_length <= 0:
            raise SpecError(f"SuffixConfig prior_weight >= 0 and prior_half_length > 0 required, got {self}")


def _walk(
    trie: SuffixTrie, pos: Position, match_len: int, max_k: int, cfg: SuffixConfig, own_text: bool,
    pending: Sequence[int] = (),
) -> Draft:
    """Greedy most-frequent continuation from a matched position, with per-token confidence.
    own_text: the trie's text is the context (followed by `pending` tokens not in it yet), so the
    draft continues it (see continuations)."""
    tokens: list[int] = []
    confidence: list[float] = []
    product, depth = 1.0, match_len
    while len(tokens) < max_k:
        options = trie.continuations(pos, [*pending, *tokens] if own_text else ())
        if not options:
            break
        token, hits, _, child = max(options, key=lambda o: (o[1], o[2]))
        total = sum(o[1] for o in options)
        prior = depth / (depth + cfg.prior_half_length)
        conf = (hits + cfg.prior_weight * prior) / (total + cfg.prior_weight)
        if product * conf < cfg.min_confidence:
            break
        product *= conf
        tokens.append(token)
        confidence.append(conf)
        pos, depth = child, depth + 1
    return Draft(tokens=tokens, probs=None, confidence=confidence)


def _other_walks(trie: SuffixTrie, pos: Position, match_len: int, max_k: int, cfg: SuffixConfig, best: Draft,
                 width: int) -> list[Draft]:
    """Up to width - 1 walks from the matched position that start with another token than
    `best` (the next most frequent, then most recent, continuations), each with its first
    token's confidence among all the options."""
    options = trie.continuations(pos, ())
    total = sum(o[1] for o in options)
    prior = match_len / (match_len + cfg.prior_half_length)
    out = []
    for token, hits, _, child in sorted(options, key=lambda o: (o[1], o[2]), reverse=True):
        if len(out) == width - 1:
            break
        conf = (hits + cfg.prior_weight * prior) / (total + cfg.prior_weight)
        if (best.tokens and token == best.tokens[0]) or conf < cfg.min_confidence:
            continue
        rest = _walk(trie, child, match_len + 1, max_k - 1, cfg, own_text=True, pending=[token])
        out.append(Draft(tokens=[token, *rest.tokens], probs=None, confidence=[conf, *rest.confidence]))
    return out


def _score(draft: Draft) -> float:
    score, product = 0.0, 1.0
    for conf in draft.confidence:
        product *= conf
        score += product
    return score


class SuffixDrafter:
    """Deterministic drafter over the request's own text and a shared history of earlier outputs.
    With `digits` (token id -> digit, see progression.digit_tokens), a repeating structure whose
    numbers count is continued with the next numbers rather than copies of the last ones."""

    name = "suffix"
    deterministic = True
    relative_cost = 0.0

    def __init__(self, config: SuffixConfig | None = None, digits: dict[int, int] | None = None,
                 progression: ProgressionConfig = ProgressionConfig(), **overrides: int | float) -> None:
        self.config = SuffixConfig(**overrides) if config is None else config
        self.digits, self.progression = digits, progression
        self._requests: dict[int, SuffixTrie] = {}
        self._history: list[SuffixTrie] = [SuffixTrie(self.config.max_depth)]  # oldest first

    # -- request lifecycle ------------------------------------------------------------------
    def start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        if seq_id in self._requests:
            raise SpecError(f"suffix drafter: seq_id {seq_id} already started")
        trie = SuffixTrie(self.config.max_depth)
        trie.extend(prompt_ids)
        self._requests[seq_id] = trie

    def attach(self, seq_id: int, cursor: GrammarCursor) -> None:
        pass  # copies follow the context; the template drafter adds the grammar

    def propose(self, reqs: list[DraftRequest]) -> list[Draft]:
        return [self._propose_one(req) for req in reqs]

    def on_verified(self, seq_id: int, num_accepted: int, emitted: list[int]) -> None:
        if num_accepted < 0 or len(emitted) > num_accepted + 1:
            raise SpecError(
                f"suffix drafter: seq {seq_id} got num_accepted={num_accepted} with {len(emitted)} emitted tokens"
            )
        # Proposals never enter the trie, so there is nothing to roll back: only emitted tokens do.
        self._trie(seq_id).extend(emitted)

    def finish(self, seq_id: int, output_ids: list[int]) -> None:
        cap = self.config.history_tokens // 2
        tokens = list(output_ids)[-cap:]
        if not tokens:
            return
        if self._history[-1].num_tokens + len(tokens) > cap:
            self._history = [self._history[-1], SuffixTrie(self.config.max_depth)]
        newest = self._history[-1]
        newest.start_document()
        newest.extend(tokens)

    def release(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)

    def sync(self, seq_id: int, context: Sequence[int]) -> None:
        """Make the request's text exactly `context` (after a preemption, say); O(1) when it is."""
        self._sync(seq_id, context)

    def propose_after(self, seq_id: int, pending: Sequence[int], max_k: int) -> Draft:
        """Continue the request's committed context followed by `pending` tokens not emitted yet
        (grammar-forced ones, say), without adding anything to the request's trie."""
        if max_k <= 0:
            return Draft.empty()
        own = self._trie(seq_id)
        tail = (own.text[-self.config.max_pattern :] + list(pending))[-self.config.max_pattern :]
        # In the request's own text the longest match of the tail may be the tail itself at the
        # text's end, with no future: look down to the longest suffix that occurred earlier (a
        # repeated value like "fab-fab-" is found at its period), and walk on through the
        # pending tokens as if they were text.
        best = self._propose_from_history(own, tail, max_k, shortest=1, pending=pending)
        for trie in reversed(self._history):
            draft = self._propose_from_history(trie, tail, max_k)
            if _score(draft) > _score(best):
                best = draft
        return self._counted(best, [*own.text[-self.progression.window:], *pending], max_k)

    def _counted(self, copy: Draft, context: Sequence[int], max_k: int) -> Draft:
        """The progression draft instead of a copy that would repeat numbers (the copy has a
        digit, or the context ends inside a number); the copy otherwise. The check keeps the
        progression scan off the drafting path of text without copied numbers."""
        digits = self.digits
        if not digits or not context or not (context[-1] in digits or any(t in digits for t in copy.tokens)):
            return copy
        counted = progression_draft(context, digits, max_k, self.progression)
        return counted if counted.tokens else copy

    # -- introspection ----------------------------------------------------------------------
    @property
    def history_tokens(self) -> int:
        return sum(trie.num_tokens for trie in self._history)

    def request_text(self, seq_id: int) -> list[int]:
        return list(self._trie(seq_id).text)

    # -- internals --------------------------------------------------------------------------
    def _trie(self, seq_id: int) -> SuffixTrie:
        trie = self._requests.get(seq_id)
        if trie is None:
            raise SpecError(f"suffix drafter: seq_id {seq_id} was not started (call start first)")
        return trie

    def _sync(self, seq_id: int, context: Sequence[int]) -> SuffixTrie:
        """Bring the request's trie to exactly `context`: append what is new, rebuild if it diverged."""
        trie = self._trie(seq_id)
        known = len(trie.text)
        tail = min(known, 8)  # O(1) consistency check; on_verified keeps the two equal anyway
        if known <= len(context) and trie.text[known - tail :] == list(context[known - tail : known]):
            trie.extend(context[known:])
            return trie
        trie = self._requests[seq_id] = SuffixTrie(self.config.max_depth)
        trie.extend(context)
        return trie

    def _propose_one(self, req: DraftRequest) -> Draft:
        trie = self._sync(req.seq_id, req.token_ids)
        if req.max_k == 0:
            return Draft.empty()
        best = Draft.empty()
        drafts: list[Draft] = []
        match = trie.longest_repeated_suffix()
        if match is not None:
            best = _walk(trie, match[0], match[1], req.max_k, self.config, own_text=True)
            if req.max_width > 1:  # the request's other continuations of the same match
                drafts += _other_walks(trie, match[0], match[1], req.max_k, self.config, best, req.max_width)
        tail = list(req.token_ids[-self.config.max_pattern :])
        for history in reversed(self._history):  # newest first: it wins ties
            draft = self._propose_from_history(history, tail, req.max_k)
            drafts.append(draft)
            if _score(draft) > _score(best):
                best = draft
        counted = self._counted(best, req.token_ids, req.max_k)  # a counting structure: next numbers
        if counted is not best or req.max_width == 1:
            return counted
        # the best continuation first, then the others that start differently, as one tree
        others = sorted((d for d in drafts if d.tokens and d is not best), key=_score, reverse=True)
        branches = [best]
        for d in others:
            if len(branches) < req.max_width and all(d.tokens[0] != b.tokens[0] for b in branches):
                branches.append(d)
        return branch_tree(Draft.empty(), branches, req.max_k) if best.tokens else best

    def _propose_from_history(self, trie: SuffixTrie, tail: list[int], max_k: int, shortest: int | None = None,
                              pending: Sequence[int] | None = None) -> Draft:
        """Walk on from the longest suffix of tail found in trie that has a continuation, trying
        lengths down to `shortest` (default: 3 below the longest found: a match at a document's
        end has no future, and much shorter ones are rarely worth drafting)."""
        if trie.num_tokens == 0 or not tail:
            return Draft.empty()
        lo, hi = 0, min(len(tail), trie.max_depth)  # tail[-lo:] present; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if trie.locate(tail[-mid:]) is not None:
                lo = mid
            else:
                hi = mid - 1
        floor = max(lo - 4, 0) if shortest is None else shortest - 1
        for length in range(lo, floor, -1):
            pos = trie.locate(tail[-length:])
            if pos is not None and trie.continuations(pos):
                return _walk(trie, pos, length, max_k, self.config, own_text=pending is not None, pending=pending or ())
        return Draft.empty()
