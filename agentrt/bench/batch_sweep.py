"""`agentrt bench batch-sweep`: goodput of B concurrent requests (mixed prompts, suffix drafter)
under no speculation, fixed k in {2, 4, 8} and the adaptive controller, side by side per B; the
measured batch size where fixed k = 4 stops beating no speculation, and the calibrated cost
model's prediction of it (controller.break_even_batch at the α fixed k = 4 reached in this run).

Concurrency B, kept: B + max(B / 2, 4) requests, B admitted at once and each finished one
replaced by the next from the queue, as a client with B streams would. Every request generates
exactly max_tokens (ignore_eos). Goodput = tokens emitted by steps in which all B sequences
decoded / wall time of those steps (timed around engine.step()): steps carrying prefill are left
out (speculation changes only decode; the prefill, the same for every policy, would dilute the
differences; e2e_goodput includes it), and so is the drain at the end, where fewer than B run.
Why refill: in a closed batch of equal-length requests every step lasts until its slowest
sequence is done, so tokens a drafter wins for the others buy nothing, which is not how a server
with a queue behaves (the first version of this bench did that, and no policy beat no-spec at
B = 16 by more than noise while the same drafts paid at the forward level). Each (B, policy) runs
on its own fresh engine (the suffix history never holds another run's output), and the policies
of one B advance together, one engine step each in turn, so the machine's load drifts (identical
runs here vary by +-15% over seconds) hit them alike; goodput pools the repeats (sum of tokens
over sum of step seconds).

Summary: worst_adaptive_vs_best (min over B of adaptive / best policy at that B),
breakeven_measured, breakeven_predicted. Goals: worst_adaptive_vs_best >= 0.95, and adaptive
beats fixed k = 4 wherever fixed k = 4 loses to no speculation.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.bench.prompts import mixed_prompts
from agentrt.bench.spec import new_engine
from agentrt.spec.report import SpecFigures

MIN_QUEUED = 4  # requests waiting behind the first B, at least


@dataclass(frozen=True)
class Policy:
    label: str
    k: int | None  # 0 = no speculation, None = adaptive


POLICIES = [Policy("none", 0), Policy("k=2", 2), Policy("k=4", 4), Policy("k=8", 8), Policy("adaptive", None)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, help="repeats per (B, policy), pooled")
    p.add_argument("--max-new-tokens", type=int)


def requests_for(batch: int) -> int:
    return batch + max(batch // 2, MIN_QUEUED)


class PolicyRun:
    """One policy serving the prompts at concurrency `batch` on its own engine, a step at a time."""

    def __init__(self, loaded, policy: Policy, prompts: list[list[int]], batch: int, max_tokens: int, cost_model):
        from agentrt.engine import SamplingParams, SpecConfig

        spec = SpecConfig(drafter="suffix" if policy.k != 0 else "none", k=policy.k)
        max_len = max(len(p) for p in prompts) + max_tokens
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine = new_engine(loaded, spec, max_len * (batch + 1), cost_model)
        self.batch, self.queue = batch, deque(prompts)
        for _ in range(min(batch, len(self.queue))):
            self.engine.add_request(list(self.queue.popleft()), self.params)
        self.decode_s = self.all_s = 0.0
        self.decode_tokens = self.tokens = 0
        self.ctx: list[float] = []
        self.ks: list[int] = []
        self.results: list = []

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        t0 = time.perf_counter()
        events = self.engine.step()
        dt = time.perf_counter() - t0
        emitted = sum(len(ev.token_ids) for ev in events)
        self.tokens += emitted
        self.all_s += dt
        for ev in events:
            if ev.finished:
                self.results.append(ev.result)
                if self.queue:
                    self.engine.add_request(list(self.queue.popleft()), self.params)
        rec = self.engine.step_log[-1] if self.engine.step_log else None
        if rec is not None and rec.num_prefill_tokens == 0 and rec.batch_size == self.batch and emitted:
            self.decode_s += dt
            self.decode_tokens += emitted
            self.ctx.append(rec.kv_tokens / rec.batch_size)
            self.ks += rec.k


def pooled(runs: list[PolicyRun]) -> dict[str, Any]:
    """Goodput and α totals over the runs of one (B, policy): sums of tokens over sums of seconds."""
    tot = SpecFigures.sum(res.spec.total for run in runs for res in run.results)
    decode_s = sum(r.decode_s for r in runs)
    ctx = [c for r in runs for c in r.ctx]
    ks = [k for r in runs for k in r.ks]
    return {
        "goodput": sum(r.decode_tokens for r in runs) / decode_s if decode_s else 0.0,
        "e2e_goodput": sum(r.tokens for r in runs) / sum(r.all_s for r in runs),
        "alpha_tested": tot.alpha_tested,
        "tok_per_pass": tot.tokens_per_pass,
        "mean_k": sum(ks) / len(ks) if ks else 0.0,
        "context": sum(ctx) / len(ctx) if ctx else 0.0,
        "full_batch_steps": len(ctx),
        "totals": tot,
    }


def interleaved(runs: list[PolicyRun]) -> None:
    """One step of each policy in turn until all are done: a burst of load from other processes
    (this machine's identical runs vary by +-15% over seconds) hits every policy alike."""
    while any(r.has_work() for r in runs):
        for r in runs:
            if r.has_work():
                r.step()


def measure(loaded, prompts: list[list[int]], batches: list[int], policies: list[Policy], max_tokens: int,
            repeats: int, cost_model, log=lambda msg: None) -> dict[tuple[int, str], dict[str, Any]]:
    interleaved([PolicyRun(loaded, p, prompts[:2], 2, 4, cost_model) for p in policies])  # warm-up
    runs: dict[tuple[int, str], list[PolicyRun]] = {}
    for r in range(repeats):
        for b in batches:
            log(f"  repeat {r + 1}/{repeats}: B = {b}")
            batch_runs = [PolicyRun(loaded, p, prompts[: requests_for(b)], b, max_tokens, cost_model) for p in policies]
            interleaved(batch_runs[r % len(batch_runs):] + batch_runs[: r % len(batch_runs)])
            for p, run in zip(policies, batch_runs):
                runs.setdefault((b, p.label), []).append(run)
    return {key: pooled(v) for key, v in runs.items()}


def table(best: dict, batches: list[int], policies: list[Policy]) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        row: dict[str, Any] = {"B": b}
        for p in policies:
            row[p.label] = best[b, p.label]["goodput"]
        top = max(row[p.label] for p in policies)
        row["adaptive/best"] = row["adaptive"] / top
        row["adaptive_mean_k"] = best[b, "adaptive"]["mean_k"]
        row["alpha_k4"] = best[b, "k=4"]["alpha_tested"]
        row["k4_tok_per_pass"] = best[b, "k=4"]["tok_per_pass"]
        rows.append(row)
    return rows


def breakeven(rows: list[dict[str, Any]]) -> int | None:
    """The first swept B where fixed k = 4 emits fewer tokens/s than no speculation."""
    return next((r["B"] for r in rows if r["k=4"] < r["none"]), None)


def predicted_breakeven(best: dict, batches: list[int], cost_model, k: int = 4) -> tuple[int | None, float, float]:
    """(break-even B from the cost model, the α it used, the mean context it used): α is fixed
    k = 4's per-position acceptance over the whole sweep, weighted by tokens."""
    from agentrt.spec.controller import break_even_batch

    alpha = SpecFigures.sum(best[b, f"k={k}"]["totals"] for b in batches).alpha_tested or 0.0
    context = sum(best[b, f"k={k}"]["context"] for b in batches) / len(batches)
    return break_even_batch(alpha, k, int(context), cost_model=cost_model), alpha, context


def summarize(rows: list[dict[str, Any]], predicted: int | None) -> dict[str, Any]:
    losing = [r for r in rows if r["k=4"] < r["none"]]
    return {
        "worst_adaptive_vs_best": min(r["adaptive/best"] for r in rows),
        "breakeven_measured": breakeven(rows),
        "breakeven_predicted": predicted,
        "adaptive_beats_k4_where_k4_loses": all(r["adaptive"] > r["k=4"] for r in losing),
    }


def calibrated_cost_model(loaded, quick: bool, log=lambda msg: None):
    """The cached calibration for this model, dtype and machine, else a fresh one by
    calibrate_engine, saved where every engine looks for it."""
    from agentrt.engine.calibration import calibrate_engine, model_cost_path
    from agentrt.engine.step.spec_runner import SpecConfig
    from agentrt.spec.cost_model import StepCostModel

    engine = new_engine(loaded, SpecConfig(), 4096)
    path = model_cost_path(engine)
    if path.exists():
        log(f"  cost model: cached calibration {path}")
        return StepCostModel.load(path), "cached"
    log("  cost model: calibrating (once per model, dtype and machine)")
    # up to 128 new tokens per step in quick runs: B = 16 at k = 8 verifies 144
    kw = dict(max_tokens=128, kv_values=(128, 1024), repeats=2) if quick else dict(max_tokens=256, kv_values=(128, 512, 2048))
    model, _, _ = calibrate_engine(engine, progress=False, **kw)
    log(f"  saved {path} (fit error {100 * (model.fit_rel_rmse or 0):.0f}% rms)")
    return model, "calibrated now"


def run(args: argparse.Namespace) -> BenchResult:
    from agentrt.engine.loading.model_loader import load_model

    console = Console(stderr=True)
    batches = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32]
    max_tokens = getattr(args, "max_new_tokens", None) or (48 if args.quick else 96)
    repeats = getattr(args, "repeats", None) or 3
    loaded = load_model(args.model, args.dtype, progress=False)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in mixed_prompts(requests_for(max(batches)))]
    console.print(f"[bold]bench batch-sweep[/]: {args.model} {args.dtype}, B in {batches}, suffix drafter, "
                  f"{max_tokens} new tokens per request, {repeats} repeats pooled, policies stepped in turn")
    cost_model, cost_source = calibrated_cost_model(loaded, args.quick, log=console.print)
    load_before = os.getloadavg()[0]
    best = measure(loaded, prompts, batches, POLICIES, max_tokens, repeats, cost_model, log=console.print)
    load_after = os.getloadavg()[0]
    rows = table(best, batches, POLICIES)
    predicted, alpha, context = predicted_breakeven(best, batches, cost_model)
    summary = summarize(rows, predicted)
    notes = [
        f"predicted break-even: fixed k=4 at α={alpha:.2f} (per-position, measured), mean context {context:.0f} tokens, "
        f"cost model {cost_source} (overhead {cost_model.overhead_s * 1e3:.1f} ms, ridge ~{cost_model.ridge_tokens():.0f} tokens)",
        "goodput: tokens/s of decode steps (prefill steps excluded). Goals: worst_adaptive_vs_best >= 0.95; "
        "adaptive > k=4 wherever k=4 < none.",
        f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs",
    ]
    config = {"model": args.model, "dtype": args.dtype, "batches": batches, "max_new_tokens": max_tokens,
              "repeats": repeats, "cost_model": cost_model.to_json(), "cost_model_source": cost_source,
              "alpha_k4": alpha, "context_mean": context, "threads": torch.get_num_threads(), "loadavg_before_after": [load_before, load_after],
              "e2e_goodput": {f"{b}/{p.label}": best[b, p.label]["e2e_goodput"] for b in batches for p in POLICIES}}
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)
