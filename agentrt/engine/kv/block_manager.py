"""Who owns which KV block: a free list, reference counts and one block table per sequence.

Blocks are shared by reference count (a forked sequence, later the prefix cache). A block is
only ever written while exactly one owner holds it: growing into a shared, partly filled block
copies it first (copy-on-write); the engine performs the copies (`pop_copies`) before the
forward that writes into them.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from agentrt.errors import AgentRTError


class OutOfBlocks(AgentRTError):
    """No free KV block is left; the scheduler preempts or waits."""


class BlockAllocator:
    """Reference counts and a free list in least-recently-freed order. A freed block keeps its
    contents until it is handed out again, so the prefix cache can revive it (incref of a free
    block); `on_reuse` tells the cache a block is about to be overwritten, and `is_pinned` keeps
    pinned blocks back until nothing else is free."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.on_reuse = lambda block: None
        self.pin_expiry = lambda block: 0.0  # > now while pinned
        self.clock = time.monotonic

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("KV cache is full")
        now = self.clock()
        b = next((b for b in self._free if self.pin_expiry(b) <= now), None)
        if b is None:  # only pinned blocks left: release the one that expires first
            b = min(self._free, key=self.pin_expiry)
        del self._free[b]
        self.on_reuse(b)
        self.refcount[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.refcount[b] == 0:  # revive a free block that still holds cached KV
            del self._free[b]
        self.refcount[b] += 1

    def decref(self, b: int) -> None:
        assert self.refcount[b] > 0, f"decref of free block {b}"
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self._free[b] = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens with a reserved slot, per sequence
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies owed before the next write
        self.prefix = None
        if prefix_caching:
            from agentrt.engine.kv.prefix_cache import PrefixCache

            self.prefix = PrefixCache(self.allocator, block_size)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_slots(self) -> int:
        """Token slots the cache holds, used or free."""
        return self.allocator.num_blocks * self.block_size

    def adopt_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Start a sequence on the cached KV of its longest cached prefix; returns the tokens
        covered. At least one token is left to compute: the step needs its logits."""
        if self.prefix is None or self.tables.get(seq_id):
            return 0
        blocks = self.prefix.match(token_ids, len(token_ids) - 1)
        for b in blocks:
            self.allocator.incref(b)
        self.tables[seq_id] = list(blocks)
        self.lengths[seq_id] = len(blocks) * self.block_size
        return self.lengths[seq_id]

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """Tokens adopt_prefix would cover for token_ids now (0 without a prefix cache)."""
        return self.prefix.cached_tokens(token_ids, len(token_ids) - 1) if self.prefix is not None else 0

    def cache_prefix(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Offer a sequence's computed full blocks to the prefix cache."""
        if self.prefix is not None and seq_id in self.tables:
            n = min(num_computed, self.lengths[seq_id]) // self.block_size
            self.prefix.insert(token_ids[: n * self.block_size], self.tables[seq_id][:n])

    def _blocks_for(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def blocks_needed(self, seq_id: int, new_len: int) -> int:
        """Free blocks that grow(seq_id, new_len) would take, copy-on-write included."""
        table, cur = self.tables.get(seq_id, []), self.lengths.get(seq_id, 0)
        if new_len <= cur:
            return 0
        need = max(0, self._blocks_for(new_len) - len(table))
        if cur % self.block_size and self._shared(table[cur // self.block_size]):
            need += 1
        return need

    def _shared(self, block: int) -> bool:
        """Writing into this block would change what someone else reads: another owner, or the
        prefix cache (which keeps full blocks for later requests)."""
        return self.allocator.refcount[block] > 1 or (self.prefix is not None and self.prefix.holds(block))

    def pop_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies grow() made owed since the last call (KVCache.copy_blocks)."""
        copies, self._copies = self._copies, []
        return copies

    def grow(self, seq_id: int, new_len: int) -> None:
        """Reserve slots for positions [len, new_len); a shared, partly filled last block is
        replaced by a private copy (owed through pop_copies)."""
        if self.blocks_needed(seq_id, new_len) > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {self.blocks_needed(seq_id, new_len)} blocks, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        cur = self.lengths.get(seq_id, 0)
        if new_len <= cur:
            return
        if cur % self.block_size:
            i = cur // self.block_size
            if self._shared(table[i]):
                new = self.allocator.allocate()
                self._copies.append((table[i], new))
                self.allocator.decref(table[i])
                table[i] = new
        while len(table) < self._blocks_for(new_len):
            table.append(self.allocator.allocate())
        self.lengths[seq_id] = new_len

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat cache slots of positions [start, end) of a sequence."""
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def truncate(self, seq_id: int, new_len: int) -> None:
        """Drop positions >= new_len (rejected drafts); frees blocks no longer used."""
        cur = self.lengths.get(seq_id, 0)
        if new_len >= cur:
            return
        table = self.tables[seq_id]
        keep = self._blocks_for(new_len)
        for b in table[keep:]:
            self.allocator.decref(b)
        del table[keep:]
        self.lengths[seq_id] = new_len

    def fork(self, src_id: int, dst_id: int, length: int | None = None) -> None:
        """dst shares src's first `length` positions by reference (no copy until written)."""
        n = self.lengths[src_id] if length is None else min(length, self.lengths[src_id])
        if self.tables.get(dst_id):  # an empty table (a prefix lookup that found nothing) is fine
            raise ValueError(f"sequence {dst_id} already has blocks")
        shared = self.tables[src_id][: self._blocks_for(n)]
        for b in shared:
            self.allocator.incref(b)
        self.tables[dst_id] = list(shared)
        self.lengths[dst_id] = n

    def free(self, seq_id: int) -> None:
        for b in self.tables.pop(seq_id, []):
            self.allocator.decref(b)
        self.lengths.pop(seq_id, None)

    def check_invariants(self, external_refs: dict[int, int] | None = None) -> None:
        """Every block's refcount equals its number of owners; free blocks have none. Raises on
        a leaked or double-owned block. external_refs: references held outside the tables."""
        owners = [0] * self.allocator.num_blocks
        for table in self.tables.values():
            for b in table:
                owners[b] += 1
        for b, n in (external_refs or {}).items():
            owners[b] += n
        free = set(self.allocator._free)
        assert len(free) == len(self.allocator._free), "a block is on the free list twice"
        assert len(free) == self.allocator.num_free
        for b, (have, want) in enumerate(zip(self.allocator.refcount, owners)):
            assert have == want, f"block {b}: refcount {have} but {want} owners"
            assert (have == 0) == (b in free), f"block {b}: refcount {have}, on free list: {b in free}"
        for sid, table in self.tables.items():
            assert len(table) == self._blocks_for(self.lengths[sid]), f"sequence {sid}: table/length mismatch"
