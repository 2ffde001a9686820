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
