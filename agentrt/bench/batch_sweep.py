"""`agentrt bench batch-sweep`: goodput of B concurrent requests (mixed prompts, suffix drafter)
under no speculation, fixed k in {2, 4, 8} and the adaptive controller, side by side per B; the
measured batch size where fixed k = 4 stops beating no speculation, and the calibrated cost
model's prediction of it (controller.break_even_batch at the α fixed k = 4 reached in this run).

Every request generates exactly max_tokens (ignore_eos) so the batch stays at B throughout.
Below B = 4 the prompt mix is served in several waves of B, so every B sees the same four prompt
kinds. Goodput = tokens emitted by decode steps / wall time of those steps (steps carrying no
prefill, timed around engine.step()): speculation changes only decode, and the prefill, identical
for every policy, would dilute the differences; e2e_goodput includes it. Each (B, policy) runs on
a fresh engine (the suffix history never holds another run's output); repeats are interleaved
over policies and the best kept.

Summary: worst_adaptive_vs_best (min over B of adaptive / best policy at that B),
breakeven_measured, breakeven_predicted. Goals: worst_adaptive_vs_best >= 0.95, and adaptive
beats fixed k = 4 wherever fixed k = 4 loses to no speculation.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.bench.prompts import mixed_prompts
from agentrt.bench.spec import new_engine

MIN_REQUESTS = 4  # every B serves at least this many requests (waves of B below it)


@dataclass(frozen=True)
class Policy:
    label: str
    k: int | None  # 0 = no speculation, None = adaptive


POLICIES = [Policy("none", 0), Policy("k=2", 2), Policy("k=4", 4), Policy("k=8", 8), Policy("adaptive", None)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, help="interleaved repeats per (B, policy), best kept")
    p.add_argument("--max-new-tokens", type=int)


def run_batch(loaded, policy: Policy, waves: list[list[list[int]]], max_tokens: int, cost_model) -> dict[str, Any]:
    """Serve each wave of prompts concurrently; decode goodput and α totals over all waves."""
    from agentrt.engine import SamplingParams, SpecConfig

    spec = SpecConfig(drafter="suffix" if policy.k != 0 else "none", k=policy.k)
    max_len = max(len(p) for w in waves for p in w) + max_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    decode_s = e2e_s = 0.0
    decode_tokens = tokens = 0
    ctx, ks, results = [], [], []
    for wave in waves:  # a fresh engine per wave: no wave drafts from an earlier one's output
        engine = new_engine(loaded, spec, max_len * len(wave), cost_model)
        for p in wave:
            engine.add_request(list(p), params)
        t_wave = time.perf_counter()
        while engine.has_work():
            t0 = time.perf_counter()
            events = engine.step()
            dt = time.perf_counter() - t0
            emitted = sum(len(ev.token_ids) for ev in events)
            tokens += emitted
            results += [ev.result for ev in events if ev.finished]
            rec = engine.step_log[-1] if engine.step_log else None
            if rec is not None and rec.num_prefill_tokens == 0 and emitted:
                decode_s += dt
                decode_tokens += emitted
                ctx.append(rec.kv_tokens / rec.batch_size)
                ks += rec.k
        e2e_s += time.perf_counter() - t_wave
    tot: dict[str, int] = {}
    for r in results:
        for key in ("drafted", "accepted", "rejections", "target_passes", "emitted"):
            tot[key] = tot.get(key, 0) + int(r.spec["total"].get(key) or 0)
    tested = tot["accepted"] + tot["rejections"]
    return {
        "goodput": decode_tokens / decode_s,
        "e2e_goodput": tokens / e2e_s,
        "alpha_tested": tot["accepted"] / tested if tested else None,
        "tok_per_pass": tot["emitted"] / tot["target_passes"],
        "mean_k": sum(ks) / len(ks) if ks else 0.0,
        "context": sum(ctx) / len(ctx) if ctx else 0.0,
        "totals": tot,
    }


def waves_for(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    n = max(batch, MIN_REQUESTS)
    n = math.ceil(n / batch) * batch
    pool = [prompts[i % len(prompts)] for i in range(n)]
    return [pool[i : i + batch] for i in range(0, n, batch)]


def measure(loaded, prompts: list[list[int]], batches: list[int], policies: list[Policy], max_tokens: int,
            repeats: int, cost_model, log=lambda msg: None) -> dict[tuple[int, str], dict[str, Any]]:
    run_batch(loaded, policies[-1], [prompts[:2]], 4, cost_model)  # warm-up
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for r in range(repeats):
        for b in batches:
            log(f"  repeat {r + 1}/{repeats}: B = {b}")
            for p in policies:
                got = run_batch(loaded, p, waves_for(prompts, b), max_tokens, cost_model)
                if (b, p.label) not in best or got["goodput"] > best[b, p.label]["goodput"]:
                    best[b, p.label] = got
    return best


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

    acc = rej = 0
    ctx = []
    for b in batches:
        t = best[b, f"k={k}"]["totals"]
        acc, rej = acc + t["accepted"], rej + t["rejections"]
        ctx.append(best[b, f"k={k}"]["context"])
    alpha = acc / (acc + rej) if acc + rej else 0.0
    context = sum(ctx) / len(ctx)
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
    from agentrt.engine.spec_runner import SpecConfig
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
    from agentrt.engine.model_loader import load_model

    console = Console(stderr=True)
    batches = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32]
    max_tokens = getattr(args, "max_new_tokens", None) or (48 if args.quick else 96)
    repeats = getattr(args, "repeats", None) or 3
    loaded = load_model(args.model, args.dtype, progress=False)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in mixed_prompts(max(batches))]
    console.print(f"[bold]bench batch-sweep[/]: {args.model} {args.dtype}, B in {batches}, suffix drafter, "
                  f"{max_tokens} new tokens per request, best of {repeats}")
    cost_model, cost_source = calibrated_cost_model(loaded, args.quick, log=console.print)
    load_before = os.getloadavg()[0]
    best = measure(loaded, prompts, batches, POLICIES, max_tokens, repeats, cost_model, log=console.print)
    load_after = os.getloadavg()[0]
    rows = table(best, batches, POLICIES)
    predicted, alpha, context = predicted_breakeven(best, batches, cost_model)
    summary = summarize(rows, predicted)
    notes = [
        f"predicted break-even: fixed k=4 at α={alpha:.2f} (per-position, measured), mean context {context:.0f} tokens, "
        f"cost model {cost_source} (overhead {cost_model.overhead_s * 1e3:.1f} ms, ridge ~{cost_model.ridge_tokens(int(context)):.0f} tokens)",
        "goodput: tokens/s of decode steps (prefill steps excluded). Goals: worst_adaptive_vs_best >= 0.95; "
        "adaptive > k=4 wherever k=4 < none.",
        f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs",
    ]
    config = {"model": args.model, "dtype": args.dtype, "batches": batches, "max_new_tokens": max_tokens,
              "repeats": repeats, "cost_model": cost_model.to_json(), "cost_model_source": cost_source,
              "alpha_k4": alpha, "context_mean": context, "threads": torch.get_num_threads(), "loadavg_before_after": [load_before, load_after],
              "e2e_goodput": {f"{b}/{p.label}": best[b, p.label]["e2e_goodput"] for b in batches for p in POLICIES}}
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)
