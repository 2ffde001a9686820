"""The parallel-calls part of `agentrt bench toolcall`: requests that need several calls in one
turn (the output is a JSON list of calls, each under its tool's schema), timed like the
single-call prompts (same policies, fastest run per prompt kept). On these the first call's
arguments close long before the turn ends (the model still writes the other calls), so this is
where starting an idempotent tool at its own arguments' "}" gains most: the runtime does that for
every call of an agent_loop(parallel_calls=True) turn.

Summary keys (the template-adaptive policy's runs, mean over the prompts whose output holds a
call): first_call_start_earlier_tokens / _ms (tokens generated after the first call's arguments
closed, and their time at the run's decode speed), parallel_calls_per_turn (calls whose arguments
closed, per output), parallel_valid / parallel_total.
"""
from __future__ import annotations

from typing import Any, Callable

from agentrt.bench.prompts import multi_call_messages
from agentrt.bench.toolcall_budget import multi_call_format
from agentrt.dag.streamed_calls import StreamedCalls

PARALLEL_MAX_TOKENS = 160  # a small model may go on listing calls: the turn then ends at this budget


def calls_closed(text: str) -> int:
    """How many calls of a turn's text had their arguments close."""
    scanner = StreamedCalls()
    scanner.feed(text)
    return len(scanner.closed_at)


def parallel_row(label: str, runs: list[dict[str, Any]], tokenizer, start_earlier: Callable) -> dict[str, Any]:
    """Totals over the parallel prompts of one policy."""
    texts = [tokenizer.decode(r["token_ids"]) for r in runs]
    earlier = [e for r in runs if (e := start_earlier(tokenizer.decode, r["token_ids"], r["decode_s"]))]
    valid = sum(r["result"] is not None and r["result"].error is None and bool(r["result"].parsed) for r in runs)
    return {
        "policy": label,
        "valid": valid,
        "calls_per_turn": sum(map(calls_closed, texts)) / len(texts),
        "tokens": sum(r["tokens"] for r in runs),
        "tok_s": sum(r["tokens"] - 1 for r in runs) / sum(r["decode_s"] for r in runs),
        "start_earlier_tokens": sum(t for t, _ in earlier) / len(earlier) if earlier else None,
        "start_earlier_ms": sum(ms for _, ms in earlier) / len(earlier) if earlier else None,
    }


def run_parallel(loaded, policies: list, repeats: int, cost_model, measure: Callable, encode: Callable,
                 start_earlier: Callable, spec_label: str, log: Callable[[str], None], tools: list[dict] | None = None,
                 chats: list[list[dict]] | None = None,
                 max_tokens: int = PARALLEL_MAX_TOKENS) -> tuple[list[dict], dict]:
    """Time the parallel-call prompts (or `chats` over `tools`) under `policies` (the engine
    ones); the rows, and the summary keys read from the `spec_label` policy's row."""
    rf = multi_call_format() if tools is None else multi_call_format(tools)
    prompts = encode(loaded, multi_call_messages() if chats is None else chats, rf, max_tokens)
    log(f"[bold]parallel calls[/]: {len(prompts)} prompts that need several calls in one turn, max "
        f"{max_tokens} tokens")
    best = measure(loaded, None, prompts, rf, policies, max_tokens, repeats, cost_model, log=log)
    rows = [parallel_row(p.label, best[p.label], loaded.tokenizer, start_earlier) for p in policies]
    spec = next(r for r in rows if r["policy"] == spec_label)
    summary = {"first_call_start_earlier_tokens": spec["start_earlier_tokens"],
               "first_call_start_earlier_ms": spec["start_earlier_ms"],
               "parallel_calls_per_turn": spec["calls_per_turn"],
               "parallel_valid": spec["valid"], "parallel_total": len(prompts)}
    return rows, summary
