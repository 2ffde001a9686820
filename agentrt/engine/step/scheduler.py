"""Continuous batching: which sequences run this step and how many of their tokens.

Waiting and running queues; admission by free KV blocks and a per-step token budget (long
prompts are prefilled in chunks); order by (priority, arrival); when blocks run out, the
lowest-ranked running sequence is preempted by recompute (its blocks freed, its tokens kept).

With a prefix cache, a waiting prompt that shares uncached full blocks with a prompt being
prefilled in this very step shares that prompt's blocks for them and feeds only the rest: each
layer writes the K/V of every token of the step before any attention reads the cache, so the
shared positions are in place when its own tokens attend to them. Agents of one kind arrive
together with the same system prompt, tools and context; without this a step that prefills them
side by side computes the shared part once per copy (SGLang defers such requests a step instead).

Prefill-ahead requests (Sequence.prefill_only: the determined start of a call that waits on a
tool) run only in steps that have nothing else to run, one chunk of at most ahead_chunk_tokens at
a time, so a request that becomes ready waits at most for that one chunk's step; when blocks run
short they give theirs up (computed full blocks to the prefix cache) before any request is
preempted or refused.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.step.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # fewest prompt tokens a waiting sequence must share (beyond what the prefix cache holds)
    # with a prefill of the same step to take them from it; 0 turns in-batch sharing off
    share_prefill_min_tokens: int = 16
    # among waiting requests of equal priority: "arrival" (first come, first served) or
    # "shortest" (fewest prompt tokens left to compute first: least mean time to first token).
    # Opt-in, as is group_prefills: on the agent workload (bench workload) neither shortened
    # mean program completion (docs/benchmarks.md), since a burst's first calls all decode
    # side by side anyway and ordering only moves the wait between them.
    prefill_order: str = "arrival"
    # admit only the first group of waiting prefills this step when the rest would reach their
    # first token sooner, on the whole, in later steps (needs a step cost; see _first_group)
    group_prefills: bool = False
    # under "shortest", a request waiting this long goes before shorter ones (no starvation)
    shortest_first_max_wait_s: float = 1.0
    # prompt tokens a prefill-ahead request feeds per step (the longest a ready request waits for it)
    ahead_chunk_tokens: int = 128

    def __post_init__(self) -> None:
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"SchedulerConfig.prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")


PREFILL_ORDERS = ("arrival", "shortest")
ORDER_WINDOW = 256  # waiting requests ordered by size per step (the rest keep rank order)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens of all_ids fed this step, per seq
    preempted: list[Sequence] = field(default_factory=list)
    # prefill-ahead requests to end now: all computed ("prefilled"), or no blocks for them with
    # nothing else running ("dropped": they would otherwise wait on pinned KV)
    ahead_done: list[tuple[Sequence, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager,
                 step_cost: Callable[[int], float | None] | None = None):
        """step_cost(num_tokens): predicted seconds of a step feeding that many tokens, or None
        while no measured cost is known (grouping weighs a step's fixed cost, which only a
        fitted cost model has measured)."""
        self.cfg = cfg
        self.blocks = blocks
        self.step_cost = step_cost
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.ahead: list[Sequence] = []  # prefill-ahead requests, in arrival order
        self.shared_prefill_tokens = 0  # prompt tokens taken from a prefill of the same step

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        (self.ahead if seq.prefill_only else self.waiting).append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ahead)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[float, float]:
        return (seq.priority, seq.arrival)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        self.running.sort(key=self._rank)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            # Make room: prefill-ahead blocks first, then by preempting from the back of the
            # ranking, never a better-ranked one.
            while self.blocks.blocks_needed(seq.seq_id, seq.num_computed + n) > self.blocks.num_free:
                if self._release_ahead():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # seq itself was preempted; the list shrank under i
            self.blocks.grow(seq.seq_id, seq.num_computed + n)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            i += 1
        self._admit(batch, budget)
        if not batch.seqs and self.ahead:
            self._schedule_ahead(batch, budget)
        return batch

    def _schedule_ahead(self, batch: ScheduledBatch, budget: int) -> None:
        """One chunk of the first prefill-ahead request that has blocks for it (nothing else runs)."""
        for seq in self.ahead:
            if seq.num_computed == 0:
                seq.num_computed = self.blocks.adopt_prefix(seq.seq_id, seq.all_ids)
                seq.cached_tokens = seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, budget, self.cfg.ahead_chunk_tokens)
            if n <= 0:
                batch.ahead_done.append((seq, "prefilled"))
                continue
            if self.blocks.blocks_needed(seq.seq_id, seq.num_computed + n) > self.blocks.num_free:
                batch.ahead_done.append((seq, "dropped"))  # it never evicts anything
                continue
            self.blocks.grow(seq.seq_id, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            batch.seqs.append(seq)
            batch.num_new.append(n)
            return

    def _release_ahead(self) -> bool:
        """Free the blocks of the newest prefill-ahead request that holds any (its computed full
        blocks go to the prefix cache; it starts over when the engine is idle again)."""
        for seq in reversed(self.ahead):
            if self.blocks.tables.get(seq.seq_id):
                self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)
                self.blocks.free(seq.seq_id)
                seq.num_computed = 0
                seq.status = SeqStatus.WAITING
                return True
        return False

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        if not self.waiting:
            return
        self.waiting.sort(key=self._rank)
        limit = len(self.waiting)
        order, group = self.cfg.prefill_order, self.cfg.group_prefills and self.step_cost is not None
        if order == "shortest" or group:
            m = min(len(self.waiting), ORDER_WINDOW)  # bounded work per step with a long queue
            head, sizes = self.waiting[:m], self._prefill_sizes(self.waiting[:m])
            if order == "shortest":
                head, sizes = self._shortest_first(head, sizes)
                self.waiting[:m] = head
            # the prompts that could start this step (the others barely change the split)
            head, sizes = head[: self.cfg.max_num_seqs], sizes[: self.cfg.max_num_seqs]
            if self.blocks.prefix is not None:  # without a prefix cache nothing is shared
                sizes = _shared_sizes(head, sizes, self.blocks.block_size)
            base = self.cfg.max_num_batched_tokens - budget
            if group and len(head) > 1 and self.step_cost(base) is not None:
                limit = self._first_group(sizes, base, budget)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and limit > 0:
            limit -= 1
            seq = self.waiting[0]
            if batch.preempted and seq in batch.preempted:
                break  # don't re-admit what this very step evicted
            adopted = shared = 0
            if seq.num_computed == 0:
                shared = self._share_prefill(seq, batch)
                adopted = seq.num_computed = shared or self.blocks.adopt_prefix(seq.seq_id, seq.all_ids)
            n = min(seq.num_tokens - seq.num_computed, budget)
            while self.blocks.blocks_needed(seq.seq_id, seq.num_computed + n) > self.blocks.num_free:
                if not self._release_ahead():
                    break
            if self.blocks.blocks_needed(seq.seq_id, seq.num_computed + n) > self.blocks.num_free:
                if adopted:  # a waiting sequence must not sit on blocks others could use
                    self.blocks.free(seq.seq_id)
                    seq.num_computed = 0
                break
            seq.cached_tokens += adopted
            self.shared_prefill_tokens += shared
            self.waiting.pop(0)
            self.blocks.grow(seq.seq_id, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n

    def _shortest_first(self, seqs: list[Sequence], sizes: list[int]) -> tuple[list[Sequence], list[int]]:
        """seqs (in rank order) with each priority's fewest prompt tokens first; one that has
        waited shortest_first_max_wait_s or more goes before them, in arrival order, so a long
        prompt is not starved by a stream of short ones."""
        now = time.monotonic()
        max_wait = self.cfg.shortest_first_max_wait_s
        own = self._cluster_sizes(seqs, sizes) if self.blocks.prefix is not None else sizes

        def key(i: int) -> tuple[float, int, int, int]:
            aged = now - seqs[i].arrival >= max_wait
            return (seqs[i].priority, 0, 0, i) if aged else (seqs[i].priority, 1, own[i], i)

        order = sorted(range(len(seqs)), key=key)
        return [seqs[i] for i in order], [sizes[i] for i in order]

    def _cluster_sizes(self, seqs: list[Sequence], sizes: list[int]) -> list[int]:
        """sizes less the full blocks each prompt shares with the first waiting prompt that
        starts with the same block: a family of agents with one system prompt and tool list
        costs its own tail each (and goes together), not its whole prompt. O(prompt blocks)."""
        bs, first_of = self.blocks.block_size, {}
        out = list(sizes)
        for i, seq in enumerate(seqs):
            ids = seq.all_ids
            if seq.num_computed or len(ids) <= bs:
                continue
            j = first_of.setdefault(tuple(ids[:bs]), i)
            if j != i:
                shared = _common_prefix(ids, seqs[j].all_ids, len(ids) - 1, bs)
                out[i] = out[j] = min(out[i], out[j], seq.num_tokens - shared)
        return out

    def _prefill_sizes(self, seqs: list[Sequence]) -> list[int]:
        """Per waiting sequence, the prompt tokens it would feed: those the prefix cache lacks."""
        out = []
        for seq in seqs:
            cached = self.blocks.cached_prefix_len(seq.all_ids) if seq.num_computed == 0 else 0
            out.append(seq.num_tokens - max(seq.num_computed, cached))
        return out

    def _first_group(self, sizes: list[int], base: int, budget: int) -> int:
        """How many of the waiting prefills (in order) to admit this step: the split of the
        queue into consecutive steps that minimises the sum of their times to first token,
        where each step costs step_cost(base + its prompt tokens) and delays every prompt not
        yet fed (batching with a setup cost: one step's fixed overhead against the waits of
        the prompts behind a long one). base: the tokens already in the step (decodes, chunks),
        assumed in every later step too. Sequences decoding meanwhile lose nothing: each step
        still gives them a token. O(m^2) in the m waiting prompts."""
        m, cost, cap = len(sizes), self.step_cost, self.cfg.max_num_batched_tokens
        best_total = [0.0] * (m + 1)  # best_total[i]: least summed wait of prompts i.. from now
        cut = [m] * (m + 1)
        for i in range(m - 1, -1, -1):
            best, tokens = float("inf"), 0
            limit = budget if i == 0 else cap - base
            for j in range(i, m):
                tokens += sizes[j]
                if j > i and tokens > limit:
                    break
                total = (m - i) * cost(base + min(tokens, limit)) + best_total[j + 1]
                if total < best:
                    best, cut[i] = total, j + 1
            best_total[i] = best
        return cut[0]

    def _share_prefill(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Start seq on the blocks of the batch sequence whose KV after this step covers the
        longest prefix of seq's prompt (full blocks, never seq's last token), when that beats
        the prefix cache by share_prefill_min_tokens or more: the blocks are shared (forked)
        now, written by their owner in this step's forward before seq's tokens attend to them.
        Returns the positions taken (0: none)."""
        need = self.cfg.share_prefill_min_tokens
        if need <= 0 or self.blocks.prefix is None:
            return 0
        ids, bs = seq.all_ids, self.blocks.block_size
        best, source = 0, None
        for other, n in zip(batch.seqs, batch.num_new):
            if n <= 1:
                continue  # decoding: its prompt is in the prefix cache already
            end = min(other.num_computed + n, len(ids) - 1) // bs * bs
            shared = _common_prefix(ids, other.all_ids, end, bs)
            if shared > best:
                best, source = shared, other
        if source is None or best - self.blocks.cached_prefix_len(ids) < need:
            return 0
        self.blocks.fork(source.seq_id, seq.seq_id, best)
        return best

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        # Computed blocks go to the prefix cache first: recompute then often costs little.
        self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.ahead:
            self.ahead.remove(seq)
        self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)
        self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED


def _shared_sizes(seqs: list[Sequence], sizes: list[int], block: int) -> list[int]:
    """sizes less the full blocks each prompt shares with one earlier in the list (fed once,
    by the earlier one, and shared in the step or taken from the prefix cache later)."""
    out = list(sizes)
    for i, seq in enumerate(seqs):
        if seq.num_computed or i == 0:
            continue
        ids = seq.all_ids
        shared = max(_common_prefix(ids, other.all_ids, len(ids) - 1, block) for other in seqs[:i])
        out[i] = min(sizes[i], seq.num_tokens - shared)
    return out


def _common_prefix(a: list[int], b: list[int], limit: int, block: int) -> int:
    """Length of the common prefix of a and b in whole blocks, at most limit."""
    n = 0
    while n + block <= limit and a[n : n + block] == b[n : n + block]:
        n += block
    return n
