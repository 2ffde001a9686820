"""Driving an LLMEngine by hand in tests: requests added at given steps, run to their ends."""
from __future__ import annotations

import itertools


def run_requests(engine, requests: list[tuple], arrivals: list[int] | None = None) -> list[list[int]]:
    """requests: (prompt, params); arrivals: the loop iteration (an engine step, or an idle one)
    at which each one is added. Returns each request's token ids (a call cut at max_tokens
    reports truncation: its tokens still count)."""
    arrivals = arrivals or [0] * len(requests)
    rids: dict[int, int] = {}
    results: dict[int, list[int]] = {}
    for now in itertools.count():
        if len(results) == len(requests):
            break
        for i, (prompt, params) in enumerate(requests):
            if i not in rids and arrivals[i] <= now:
                rids[i] = engine.add_request(prompt, params)
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result.token_ids
    return [results[rids[i]] for i in range(len(requests))]


def forward_step(model, kv, bm, feeds: list[list[int]], starts: list[int], batch_invariant: bool = False):
    """One ragged model forward by hand: sequence i (its blocks in bm) feeds feeds[i] from
    position starts[i]. Returns the logits."""
    import torch

    from agentrt.engine.models.attention import build_attention_metadata
    from agentrt.engine.models.llama import ForwardBatch

    ids, pos, slots = [], [], []
    for sid, (f, s) in enumerate(zip(feeds, starts)):
        bm.grow(sid, s + len(f))
        ids += f
        pos += range(s, s + len(f))
        slots += bm.slots(sid, s, s + len(f))
    positions = torch.tensor(pos)
    meta = build_attention_metadata([len(f) for f in feeds], [s + len(f) for f, s in zip(feeds, starts)], positions,
                                    [bm.tables[i] for i in range(len(feeds))], bm.block_size, torch.device("cpu"))
    return model.forward(ForwardBatch(torch.tensor(ids), positions, torch.tensor(slots), meta), kv,
                         batch_invariant=batch_invariant).logits
