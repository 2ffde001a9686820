"""Suffix drafter: trie counts, proposals from the prompt and from shared history, confidence,
state consistency after partial acceptance, the history memory cap, and the max_k bound."""
import itertools
import random

import pytest
import torch

from agentrt.errors import SpecError
from agentrt.spec.drafters import Draft, Drafter, DraftRequest, NullDrafter, SuffixDrafter, SuffixTrie


def naive_count(docs, pattern):
    return sum(
        doc[s : s + len(pattern)] == pattern for doc in docs for s in range(len(doc) - len(pattern) + 1)
    )


@pytest.mark.parametrize("seed", range(60))
def test_trie_counts_equal_naive_counts(seed):
    rng = random.Random(seed)
    depth, alphabet = rng.randint(1, 6), rng.randint(1, 3)
    docs = [[rng.randrange(alphabet) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(1, 3))]
    trie = SuffixTrie(depth)
    for doc in docs:
        trie.start_document()
        trie.extend(doc)
    for length in range(1, depth + 1):
        for pattern in itertools.product(range(alphabet), repeat=length):
            assert trie.occurrences(list(pattern)) == naive_count(docs, list(pattern)), pattern
    last = docs[-1]
    expected = next((n for n in range(min(depth - 1, len(last)), 0, -1) if naive_count(docs, last[-n:]) >= 2), None)
    match = trie.longest_repeated_suffix()
    assert (match[1] if match else None) == expected


def started(drafter, seq_id, prompt):
    drafter.start(seq_id, prompt)
    return drafter


def propose(drafter, seq_id, context, max_k=8):
    return drafter.propose([DraftRequest(seq_id=seq_id, token_ids=context, max_k=max_k)])[0]


def test_proposes_the_continuation_of_a_pattern_in_the_prompt():
    block = [101, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    prompt = block + [50, 51, 52] + block[:6]
    drafter = started(SuffixDrafter(), 0, prompt)
    draft = propose(drafter, 0, prompt, max_k=4)
    assert draft.tokens == block[6:10]
    assert draft.probs is None and len(draft.confidence) == 4
    assert all(0.0 < c <= 1.0 for c in draft.confidence)


def test_propose_after_continues_a_repetition_in_the_requests_own_text():
    """The template drafter's free slots: the tail ends with the committed text itself, so the
    longest match is at the text's end; the draft must come from the repeated period before it
    (a value like "fab-fab-fab-" once went 50 steps without a draft)."""
    prompt = list(range(100, 140))
    drafter = started(SuffixDrafter(), 0, prompt)
    output = [7, 8, 9] * 3 + [7]
    context = prompt + output
    propose(drafter, 0, context, max_k=0)  # the engine syncs the request's trie every step
    forced = [8]  # a grammar-forced token not committed yet
    draft = drafter.propose_after(0, forced, 5)
    assert draft.tokens == [9, 7, 8, 9, 7]
    assert drafter.request_text(0) == context  # nothing added by propose_after


def test_unseen_context_proposes_nothing():
    drafter = started(SuffixDrafter(), 0, list(range(100, 140)))
    assert propose(drafter, 0, list(range(100, 140))).tokens == []


def test_proposes_from_shared_history_of_earlier_requests():
    tool_call = [900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911]
    drafter = SuffixDrafter(min_confidence=0.0)
    started(drafter, 1, [1, 2, 3]).finish(1, [40, 41] + tool_call + [42])
    drafter.release(1)
    context = [5, 6, 7] + tool_call[:5]  # request 2 never saw the call in its own text
    started(drafter, 2, context)
    assert propose(drafter, 2, context, max_k=6).tokens == tool_call[5:11]
    fresh = started(SuffixDrafter(), 2, context)
    assert propose(fresh, 2, context).tokens == []


def test_confidence_drops_when_continuations_diverge():
    pattern = [300, 301, 302]
    agreeing, diverging = [], []
    for i, nxt in enumerate((7, 8, 9, 7)):  # distinct lead-ins: the longest match is the pattern
        agreeing += [10 + i, 20 + i] + pattern + [7]
        diverging += [10 + i, 20 + i] + pattern + [nxt]
    confidences = {}
    for name, text in (("agree", agreeing), ("diverge", diverging)):
        context = text + [98, 99] + pattern
        drafter = started(SuffixDrafter(min_confidence=0.0), 0, context)
        draft = propose(drafter, 0, context, max_k=1)
        assert draft.tokens == [7]
        confidences[name] = draft.confidence[0]
    assert confidences["diverge"] < confidences["agree"]


def test_longer_matches_earn_more_confidence():
    short_ctx = [1, 2, 3, 4, 50, 60, 99, 5, 50]  # a one-token match, seen once
    long_block = list(range(200, 220))
    long_ctx = long_block + [60, 99] + long_block[:12]
    conf = {}
    for name, ctx in (("short", short_ctx), ("long", long_ctx)):
        draft = propose(started(SuffixDrafter(min_confidence=0.0), 0, ctx), 0, ctx, max_k=1)
        conf[name] = draft.confidence[0]
    assert conf["short"] < conf["long"]


def test_state_follows_the_true_context_after_partial_acceptance():
    rng = random.Random(5)
    motif = [rng.randrange(20) for _ in range(12)]
    prompt = motif * 3 + [rng.randrange(20) for _ in range(10)]
    drafter = started(SuffixDrafter(), 0, prompt)
    context = list(prompt)
    for step in range(40):
        draft = propose(drafter, 0, context)
        accepted = rng.randint(0, len(draft.tokens))
        recovered = rng.randrange(20)
        emitted = draft.tokens[:accepted] + [recovered]
        drafter.on_verified(0, accepted, emitted)
        context += emitted
        assert drafter.request_text(0) == context
        reference = started(SuffixDrafter(), 0, context)
        ours, theirs = propose(drafter, 0, context), propose(reference, 0, context)
        assert (ours.tokens, ours.confidence) == (theirs.tokens, theirs.confidence)


def test_context_without_on_verified_or_diverged_is_resynced():
    drafter = started(SuffixDrafter(), 0, [1, 2, 3, 4, 1, 2])
    assert propose(drafter, 0, [1, 2, 3, 4, 1, 2, 3]).tokens[:1] == [4]  # engine skipped on_verified
    assert drafter.request_text(0) == [1, 2, 3, 4, 1, 2, 3]
    rewritten = [9, 8, 7, 9, 8]  # the engine replaced the context (e.g. a truncated prompt)
    assert propose(drafter, 0, rewritten).tokens[:1] == [7]
    assert drafter.request_text(0) == rewritten


def test_history_memory_cap_evicts_oldest():
    cap = 100
    drafter = SuffixDrafter(history_tokens=cap)
    first = list(range(1000, 1030))
    drafter.finish(0, first)
    for i in range(1, 30):
        drafter.finish(i, [2000 + 31 * i + j for j in range(30)])
        assert drafter.history_tokens <= cap
    drafter.finish(99, list(range(5000, 5500)))  # one output longer than the cap: its tail is kept
    assert drafter.history_tokens <= cap
    context = first[:10]
    started(drafter, 7, context)
    assert propose(drafter, 7, context).tokens == []  # the oldest output was evicted
    recent = list(range(5450, 5460))
    started(drafter, 8, recent)
    assert propose(drafter, 8, recent, max_k=3).tokens == [5460, 5461, 5462]


@pytest.mark.parametrize("max_k", [0, 1, 2, 5, 16])
def test_never_more_than_max_k(max_k):
    context = [3, 4] * 50
    drafter = started(SuffixDrafter(min_confidence=0.0), 0, context)
    drafter.finish(1, [3, 4] * 40)
    draft = propose(drafter, 0, context, max_k=max_k)
    assert len(draft.tokens) == len(draft.confidence) <= max_k
    if max_k:
        assert draft.tokens == [3, 4] * (max_k // 2) + [3] * (max_k % 2)


def test_batched_propose_keeps_order():
    drafter = SuffixDrafter()
    contexts = {0: [1, 2, 3, 1, 2], 1: [7, 8, 9, 7, 8], 2: [5]}
    for seq_id, ctx in contexts.items():
        drafter.start(seq_id, ctx)
    drafts = drafter.propose([DraftRequest(i, contexts[i], 4) for i in (2, 0, 1)])
    assert [d.tokens[:1] for d in drafts] == [[], [3], [9]]


def test_protocol_and_lifecycle_errors():
    assert isinstance(SuffixDrafter(), Drafter) and isinstance(NullDrafter(), Drafter)
    null = NullDrafter()
    null.start(0, [1, 2])
    assert null.propose([DraftRequest(0, [1, 2], 4)])[0].tokens == []
    drafter = started(SuffixDrafter(), 0, [1])
    with pytest.raises(SpecError, match="already started"):
        drafter.start(0, [1])
    with pytest.raises(SpecError, match="seq_id 3"):
        propose(drafter, 3, [1])
    with pytest.raises(SpecError, match="num_accepted"):
        drafter.on_verified(0, 1, [1, 2, 3])
    drafter.release(0)
    drafter.release(0)  # idempotent
    with pytest.raises(SpecError, match="max_k"):
        DraftRequest(0, [1], -1)
    with pytest.raises(SpecError, match="top_p"):
        DraftRequest(0, [1], 2, temperature=1.0, top_p=0.0)
    with pytest.raises(SpecError, match="confidence"):
        Draft(tokens=[1, 2], confidence=[0.5])
    with pytest.raises(SpecError, match="probs"):
        Draft(tokens=[1], probs=torch.ones(2, 4), confidence=[0.5])
    with pytest.raises(SpecError, match="min_confidence"):
        SuffixDrafter(min_confidence=2.0)


def test_tree_of_continuations_where_the_context_went_on_differently():
    """After "1 2" the request's text went on with 3 4 (twice) and with 7 8: with width 2 the draft
    is a tree, the likelier branch first; with width 1 the same first branch as a chain."""
    prompt = [1, 2, 3, 4, 9, 1, 2, 7, 8, 9, 1, 2, 3, 4, 9, 5, 1, 2]
    chain = started(SuffixDrafter(), 0, prompt).propose([DraftRequest(0, prompt, 6)])[0]
    tree = started(SuffixDrafter(), 0, prompt).propose([DraftRequest(0, prompt, 6, max_width=2)])[0]
    assert chain.parents is None and chain.tokens[:2] == [3, 4]
    assert tree.parents is not None and tree.tokens[:2] == [3, 7] and tree.parents[:2] == [-1, -1]
    first_branch = tree.first_branch()
    assert first_branch.tokens == chain.tokens[: len(first_branch.tokens)] and len(tree.tokens) <= 6
