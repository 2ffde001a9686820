"""KV block ownership under random alloc/append/truncate/share/free sequences.

A shadow model of every sequence's token contents is written through the manager's slots into a
fake cache; reading a sequence back through its table must give its own tokens (this catches a
block written while shared), and the allocator's refcounts must match the owners (no leaked or
double-owned block)."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentrt.engine.kv.block_manager import BlockManager, OutOfBlocks

NUM_BLOCKS, BLOCK = 12, 4


class BlockMachine(RuleBasedStateMachine):
    prefix_caching = False

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK, prefix_caching=self.prefix_caching)
        self.past: list[list[int]] = []  # contents of freed sequences (prefix-cache candidates)
        self.cache = [None] * (NUM_BLOCKS * BLOCK)
        self.content: dict[int, list[int]] = {}
        self.next_id = 0
        self.next_tok = 0

    def _write(self, sid: int, n: int, toks: list[int] | None = None) -> None:
        cur = self.bm.lengths.get(sid, 0)
        try:
            self.bm.grow(sid, cur + n)
        except OutOfBlocks:
            assert self.bm.blocks_needed(sid, cur + n) > self.bm.num_free
            return
        for src, dst in self.bm.pop_copies():  # what KVCache.copy_blocks does
            self.cache[dst * BLOCK : (dst + 1) * BLOCK] = self.cache[src * BLOCK : (src + 1) * BLOCK]
        if toks is None:
            toks = list(range(self.next_tok, self.next_tok + n))
            self.next_tok += n
        for slot, t in zip(self.bm.slots(sid, cur, cur + n), toks):
            self.cache[slot] = t
        self.content.setdefault(sid, []).extend(toks)

    @rule(n=st.integers(1, 9))
    def new_sequence(self, n):
        sid = self.next_id
        self.next_id += 1
        self._write(sid, n)
        if sid not in self.content:
            self.bm.free(sid)  # nothing was allocated; make sure no empty table lingers

    @precondition(lambda self: self.content)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        self._write(data.draw(st.sampled_from(sorted(self.content))), n)

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(sorted(self.content)))
        new_len = data.draw(st.integers(0, len(self.content[sid])))
        self.bm.truncate(sid, new_len)
        del self.content[sid][new_len:]

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.content)))
        length = data.draw(st.integers(0, len(self.content[src])))
        dst = self.next_id
        self.next_id += 1
        self.bm.fork(src, dst, length)
        self.content[dst] = self.content[src][:length]

    @precondition(lambda self: self.past and self.prefix_caching)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def reuse_prefix(self, data, extra):
        """A new sequence whose tokens start like an earlier one: it adopts cached blocks, which
        must still hold exactly those tokens, then writes the rest."""
        old = data.draw(st.sampled_from(self.past))
        keep = data.draw(st.integers(1, len(old)))
        toks = old[:keep] + list(range(self.next_tok, self.next_tok + extra))
        self.next_tok += extra
        sid = self.next_id
        self.next_id += 1
        cached = self.bm.adopt_prefix(sid, toks)
        assert cached % BLOCK == 0 and cached < len(toks)
        assert [self.cache[s] for s in self.bm.slots(sid, 0, cached)] == toks[:cached]
        self.content[sid] = toks[:cached]
        self._write(sid, len(toks) - cached, toks[cached:])
        if len(self.content[sid]) == 0 and not self.bm.tables.get(sid):
            self.bm.free(sid)
            del self.content[sid]

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.content)))
        self.bm.cache_prefix(sid, self.content[sid], len(self.content[sid]))
        if self.content[sid]:
            self.past.append(list(self.content[sid]))
        self.bm.free(sid)
        del self.content[sid]

    @invariant()
    def ownership(self):
        self.bm.check_invariants()

    @invariant()
    def contents(self):
        for sid, toks in self.content.items():
            got = [self.cache[s] for s in self.bm.slots(sid, 0, len(toks))]
            assert got == toks, f"sequence {sid} reads {got}, wrote {toks}"

    def teardown(self):
        for sid in list(self.content):
            self.bm.free(sid)
        assert self.bm.num_free == NUM_BLOCKS, "blocks leaked after freeing every sequence"


TestBlockManager = BlockMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PrefixBlockMachine(BlockMachine):
    prefix_caching = True


TestBlockManagerWithPrefixCache = PrefixBlockMachine.TestCase
TestBlockManagerWithPrefixCache.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_grow_refuses_when_full():
    bm = BlockManager(2, 4)
    bm.grow(0, 8)
    try:
        bm.grow(1, 1)
    except OutOfBlocks as e:
        assert "needs 1 blocks, 0 free" in str(e)
    else:
        raise AssertionError("grow past capacity must raise")


def test_fork_onto_a_sequence_whose_prefix_lookup_found_nothing():
    """A waiting sequence refused for lack of room keeps the empty table its prefix lookup left;
    in-batch sharing may fork onto it a step later."""
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    assert bm.adopt_prefix(1, list(range(10))) == 0 and bm.tables[1] == []
    bm.grow(0, 8)
    bm.fork(0, 1, 8)
    assert bm.tables[1] == bm.tables[0][:2]
    bm.free(0)
    bm.free(1)
    bm.check_invariants()
    assert bm.num_free == 8
