"""The determinism section of `agentrt bench decode --determinism`: greedy output with and
without speculation, and what a verification step costs, in the engine's dtype (bf16 on the C
kernels is batch-invariant; fp32, and bf16 with AGENTRT_KERNELS=0, run the PyTorch path, which
is not).

* identical outputs: the bench's tool-call requests (tests: agentrt/bench/prompts.py), greedy,
  each alone without drafts as the reference; then all of them at once (8 in flight, prefill and
  decode mixed) with each drafter and k. Reported: the fraction of requests whose tokens equal
  the reference (goal 1.0), and the drafted run's tokens/s over the plain batch's.
* verify step: one sequence with `ctx` cached positions, a forward of 1, 5 (k = 4) and 16
  (k = 15) tokens, median of `reps`; reported in ms and over the 1-token step.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

DRAFTERS = [("none", None), ("template", None), ("template", 4), ("template", 15), ("suffix", None), ("suffix", 15)]


def _generate(engine, requests: list[tuple[list[dict], Any]], max_in_flight: int) -> tuple[list[list[int]], float]:
    """Run requests keeping up to max_in_flight at once; their tokens and the wall time."""
    pending, rids, done = list(enumerate(requests)), {}, {}
    t0 = time.perf_counter()
    while len(done) < len(requests):
        while pending and len(rids) - len(done) < max_in_flight:
            i, (chat, params) = pending.pop(0)
            rids[engine.add_request(chat, params)] = i
        for ev in engine.step():
            if ev.finished:
                done[rids[ev.request_id]] = ev.result.token_ids
    return [done[i] for i in range(len(requests))], time.perf_counter() - t0


def identical_outputs(loaded, max_tokens: int, progress=None, limit: int | None = None,
                      batch_invariant: bool = False) -> list[dict[str, Any]]:
    """One row per drafter and k: requests identical to their alone-without-drafts reference,
    and tokens/s against the plain batch. limit: only the first `limit` requests.
    batch_invariant: engines with EngineConfig.batch_invariant (the PyTorch path's invariant mode)."""
    from agentrt.bench.prompts import TOOLS, toolcall_messages
    from agentrt.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig

    params = SamplingParams(max_tokens=max_tokens, temperature=0, response_format={"type": "tool_call", "tools": TOOLS})
    requests = [(chat, params) for chat in toolcall_messages()[:limit]]

    def engine(spec: SpecConfig, prefix_caching: bool = True) -> LLMEngine:
        dtype = str(loaded.model.dtype).removeprefix("torch.")
        cfg = EngineConfig(model=str(loaded.source.path), dtype=dtype, spec=spec, prefix_caching=prefix_caching,
                           batch_invariant=batch_invariant)
        return LLMEngine(cfg, loaded=loaded)

    alone = [_generate(engine(SpecConfig(), prefix_caching=False), [r], 1)[0][0] for r in requests]
    rows, plain_tok_s = [], None
    for drafter, k in DRAFTERS:
        label = (drafter if drafter == "none" else f"{drafter} k={'adaptive' if k is None else k}") + (
            " (batch-invariant)" if batch_invariant else "")
        if progress is not None:
            progress.print(f"  determinism: {label}")
        tokens, wall = _generate(engine(SpecConfig(drafter=drafter, k=k)), requests, 8)
        tok_s = sum(map(len, tokens)) / wall
        plain_tok_s = plain_tok_s or tok_s
        same = sum(a == b for a, b in zip(tokens, alone))
        rows.append({"drafter": label, "identical": f"{same}/{len(requests)}", "identical_fraction": same / len(requests),
                     "tok_s": tok_s, "vs_plain_batch": tok_s / plain_tok_s})
    return rows


def verify_step_ms(loaded, ks=(0, 4, 15), ctx: int = 300, reps: int = 20,
                   batch_invariant: bool = False) -> dict[int, float]:
    """Median ms of a forward of k + 1 tokens for one sequence with ctx cached positions."""
    from agentrt.engine.kv.block_manager import BlockManager
    from agentrt.engine.kv.kv_cache import KVCache
    from agentrt.engine.models.attention import build_attention_metadata
    from agentrt.engine.models.batch import ForwardBatch

    model, block = loaded.model, 16
    num_blocks = (ctx + max(ks) + 1) // block + 2
    blocks = BlockManager(num_blocks, block)
    kv = KVCache(model.cfg, num_blocks, block, model.kv_dtype)
    ids = torch.randint(0, model.cfg.vocab_size, (ctx + max(ks) + 1,), generator=torch.Generator().manual_seed(0))

    def batch(start: int, n: int) -> ForwardBatch:
        blocks.grow(0, start + n)
        positions = torch.arange(start, start + n)
        meta = build_attention_metadata([n], [start + n], positions, [blocks.tables[0]], block, torch.device("cpu"))
        return ForwardBatch(ids[start : start + n], positions, torch.tensor(blocks.slots(0, start, start + n)), meta)

    with torch.inference_mode():
        model.forward(batch(0, ctx), kv)  # the context's KV
        out = {}
        for k in ks:
            fb = batch(ctx, k + 1)
            times = []
            for _ in range(reps + 2):
                t0 = time.perf_counter()
                model.forward(fb, kv, batch_invariant=batch_invariant)
                times.append(time.perf_counter() - t0)
            out[k] = 1000 * statistics.median(times[2:])
    return out
