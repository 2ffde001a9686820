"""Prefix cache: a radix tree over full KV blocks, so a program's next call reuses the KV of its
previous prompt and output, and sibling branches reuse their shared prefix.

Each tree node is one full block of `block_size` tokens, keyed by those tokens under its parent
(so a node stands for the whole prefix up to it). The tree holds no reference: a block whose
last owner freed it sits on the allocator's free list with its KV intact, least recently freed
first, and a later match revives it. When the allocator hands a block out again the node and its
subtree leave the tree. Only computed, verified tokens are inserted: rolled-back drafts never
enter, and an inserted block is never written again (owners only write past their computed
tokens; a shared block is copied before it is written).

Pins hold a finished call's blocks while its program waits on a tool (time-to-live from the
tool's observed latency): the allocator hands out pinned free blocks last, earliest expiry first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the block manager builds the prefix cache over its allocator
    from agentrt.engine.kv.block_manager import BlockAllocator


@dataclass
class _Node:
    block: int
    key: tuple[int, ...]
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    pinned_until: float = 0.0


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    hit_tokens: int = 0  # prefill tokens saved
    lookup_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0  # cached blocks handed out for new KV
    pin_hits: int = 0  # hits while the prefix was pinned
    released_pins: int = 0  # pinned blocks handed out before their time-to-live ran out

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hits / self.lookups if self.lookups else None
        return d


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.root = _Node(block=-1, key=(), parent=None)
        self._by_block: dict[int, _Node] = {}
        self.stats = PrefixStats()
        allocator.on_reuse = self._forget
        allocator.pin_expiry = self._pin_expiry

    @property
    def num_blocks(self) -> int:
        return len(self._by_block)

    def _keys(self, token_ids: list[int], n_blocks: int):
        bs = self.block_size
        for i in range(n_blocks):
            yield tuple(token_ids[i * bs : (i + 1) * bs])

    def match(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Blocks caching the longest prefix of token_ids (at most max_tokens tokens). The caller
        increfs them right away (reviving free ones)."""
        now = self.allocator.clock()
        node, blocks, pinned = self.root, [], False
        for key in self._keys(token_ids, max_tokens // self.block_size):
            child = node.children.get(key)
            if child is None:
                break
            pinned |= child.pinned_until > now
            blocks.append(child.block)
            node = child
        s = self.stats
        s.lookups += 1
        s.lookup_tokens += len(token_ids)
        if blocks:
            s.hits += 1
            s.hit_tokens += len(blocks) * self.block_size
            s.pin_hits += int(pinned)
        return blocks

    def cached_tokens(self, token_ids: list[int], max_tokens: int) -> int:
        """How many tokens of token_ids' prefix (at most max_tokens) match() would cover now; no
        side effects (no stats, nothing revived)."""
        node, n = self.root, 0
        for key in self._keys(token_ids, max_tokens // self.block_size):
            node = node.children.get(key)
            if node is None:
                break
            n += self.block_size
        return n

    def insert(self, token_ids: list[int], blocks: list[int]) -> None:
        """blocks[i] holds the KV of token_ids' i-th full block (computed tokens only)."""
        node = self.root
        for key, block in zip(self._keys(token_ids, len(token_ids) // self.block_size), blocks):
            child = node.children.get(key)
            if child is None:
                if block in self._by_block:  # already caches another prefix: keep that one
                    return
                child = _Node(block=block, key=key, parent=node)
                node.children[key] = child
                self._by_block[block] = child
                self.stats.inserted_blocks += 1
            node = child

    def pin(self, token_ids: list[int], ttl_s: float) -> int:
        """Pin the cached blocks of token_ids' prefix for ttl_s seconds; returns how many."""
        until = self.allocator.clock() + ttl_s
        node, n = self.root, 0
        for key in self._keys(token_ids, len(token_ids) // self.block_size):
            node = node.children.get(key)
            if node is None:
                break
            node.pinned_until = max(node.pinned_until, until)
            n += 1
        return n

    def num_pinned(self) -> int:
        now = self.allocator.clock()
        return sum(1 for node in self._by_block.values() if node.pinned_until > now)

    def holds(self, block: int) -> bool:
        return block in self._by_block

    def _pin_expiry(self, block: int) -> float:
        node = self._by_block.get(block)
        return node.pinned_until if node is not None else 0.0

    def _forget(self, block: int) -> None:
        """The allocator is handing `block` out: its node and the prefixes extending it go."""
        node = self._by_block.get(block)
        if node is None:
            return
        if node.pinned_until > self.allocator.clock():
            self.stats.released_pins += 1
        del node.parent.children[node.key]
        stack = [node]
        while stack:
            nd = stack.pop()
            del self._by_block[nd.block]
            self.stats.evicted_blocks += 1
            stack.extend(nd.children.values())
