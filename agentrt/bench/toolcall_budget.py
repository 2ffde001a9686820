"""The budget part of `agentrt bench toolcall`: lists of tool calls (parallel calls, several per
turn) generated under every max_tokens from the schema's minimum up, without speculation and with
the template drafter; how many outputs parse and meet the schema (engine.step.budget completes a
constrained output within its budget). A small model loops in a list of calls, so most of these
outputs reach their budget: before the completion, such outputs were cut mid-JSON.

Summary keys: valid_under_budget (valid outputs / outputs, over every prompt, budget and
drafter; goal 1.0), budget_outputs, budget_length_share (outputs that reached their budget).
"""
from __future__ import annotations

from typing import Any, Callable

from agentrt.bench.prompts import TOOLS, multi_call_messages

BUDGET_SPAN = 40  # budgets from the minimum to the minimum + BUDGET_SPAN - 1 (every one; --quick: every 4th)


def multi_call_format(tools: list[dict] = TOOLS) -> dict:
    return {"type": "tool_call", "tools": tools, "parallel": True}


def minimum_budget(engine, rf: dict) -> int:
    """Tokens of the completion from an empty output: the least max_tokens that can be valid."""
    from agentrt.structured.output_format import parse_response_format

    return engine.constraints.grammars.minimum_tokens(parse_response_format(rf), engine.tokenizer.encode)


def sweep(engine, rf: dict, chats: list[list[dict]], budgets: list[int], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every prompt at every budget, all in one batch (greedy)."""
    from agentrt.engine import SamplingParams

    rids = {}
    for i, chat in enumerate(chats):
        for b in budgets:
            rids[engine.add_request(chat, SamplingParams(max_tokens=b, temperature=0, response_format=rf))] = (i, b)
    results: dict[int, Any] = {}
    while len(results) < len(rids):
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result
                if len(results) % 50 == 0:
                    log(f"    {len(results)}/{len(rids)} outputs")
    out = []
    for rid, (i, b) in rids.items():
        r = results[rid]
        out.append({"prompt": i, "budget": b, "valid": r.parsed is not None and r.error is None,
                    "calls": len(r.parsed) if isinstance(r.parsed, list) else 0, "tokens": len(r.token_ids),
                    "finish_reason": r.finish_reason, "completion_tokens": r.completion_tokens,
                    "error": r.error})
    return out


def run_budgets(loaded, cost_model, drafters: list[str], quick: bool, log: Callable[[str], None],
                tools: list[dict] = TOOLS, chats: list[list[dict]] | None = None,
                span: int = BUDGET_SPAN) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows per drafter, summary keys). chats: the multi-call requests by default."""
    from agentrt.bench.spec import new_engine
    from agentrt.engine import SpecConfig

    rf = multi_call_format(tools)
    chats = multi_call_messages() if chats is None else chats
    rows, outputs = [], []
    for drafter in drafters:
        engine = new_engine(loaded, SpecConfig(drafter=drafter), 1024, cost_model)
        low = minimum_budget(engine, rf)
        budgets = list(range(low, low + span, 4 if quick else 1))
        log(f"  budgets {budgets[0]}..{budgets[-1]} x {len(chats)} multi-call prompts, drafter {drafter}")
        got = sweep(engine, rf, chats, budgets, log)
        outputs += got
        rows.append({"policy": f"multi-call under budget ({drafter})", "outputs": len(got),
                     "valid": sum(o["valid"] for o in got), "reached_budget": sum(o["finish_reason"] == "length" for o in got),
                     "completed": sum(o["completion_tokens"] > 0 for o in got),
                     "mean_calls": sum(o["calls"] for o in got) / len(got), "min_budget": low})
    n = len(outputs)
    summary = {"valid_under_budget": sum(o["valid"] for o in outputs) / n, "budget_outputs": n,
               "budget_length_share": sum(o["finish_reason"] == "length" for o in outputs) / n}
    return rows, summary
