"""`agentrt bench attention`: the CPU paged-attention kernel on decode-shaped batches, without
and with software prefetch of the context rows (the default).

B sequences of `ctx` cached positions each feed 1 or 2 new tokens (decode, and verification of
one draft), with the model's head shapes, over as many layers as the model has, each with its own
K/V cache of shuffled 16-slot blocks: one pass reads every layer's K and V once, as a step does,
so they come from memory rather than from a cache level a single layer would fit in. Variants
alternate pass by pass (the machine's load drifts by +-15% over seconds); per variant the 25th
percentile of the passes. Both variants compute the same bits (tests/kernels/test_cpu_kernels.py).

Also the rotary + KV-write kernel at prefill: 1000-token steps into fresh slots of every layer's
cache, as a new engine's first prompts write, on a cache mapped with 4 KB pages, with huge pages
(the default: every first touch of a page is a fault), and already touched; the fastest of 3.

Summary: b16_decode_speedup (the default over no prefetch at B = 16, the first context, 1
token: the largest decode batch measured), worst_speedup and best_speedup over all shapes;
kv_write_ms_4k_pages, kv_write_ms_huge_pages, kv_write_ms_touched (per 1000-token step).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.kernels.paged_attention import PREFETCH_ROWS, paged_attention

BLOCK = 16
VARIANTS = {"no prefetch": 0, "default": PREFETCH_ROWS}  # name -> prefetch_rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--passes", type=int, default=None, help="timed passes per variant and shape")


def _shape_case(g: torch.Generator, layers: int, B: int, ctx: int, new: int, nq: int, nkv: int, d: int) -> dict[str, Any]:
    per_seq = (ctx + new + BLOCK - 1) // BLOCK
    num_blocks = B * per_seq
    tables = torch.randperm(num_blocks, generator=g).view(B, per_seq).contiguous()
    shape = (num_blocks * BLOCK, nkv, d)
    k = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    q = torch.randn(B * new, nq * d, generator=g).to(torch.bfloat16)
    positions = torch.arange(ctx, ctx + new).repeat(B)
    cu_q = torch.arange(0, B * new + 1, new, dtype=torch.long)
    return dict(k=k, v=v, q=q, positions=positions, cu_q=cu_q, tables=tables, out=torch.empty_like(q))


def _pass(case: dict[str, Any], prefetch: int, nq: int, d: int) -> float:
    t0 = time.perf_counter()
    for kc, vc in zip(case["k"], case["v"]):
        paged_attention(case["q"], kc, vc, case["cu_q"], case["positions"], case["tables"], BLOCK, d**-0.5, nq,
                        out=case["out"], prefetch_rows=prefetch)
    return time.perf_counter() - t0


def measure(shapes: list[tuple[int, int, int]], heads: tuple[int, int, int], layers: int, passes: int,
            progress: Console | None = None) -> list[dict[str, Any]]:
    """One row per (B, ctx, new tokens): ms per pass of each variant, and the default's speedup."""
    nq, nkv, d = heads
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, (B, ctx, new) in enumerate(shapes):
        if progress is not None:
            progress.print(f"[{i + 1}/{len(shapes)}] B={B} ctx={ctx} new={new}")
        case = _shape_case(g, layers, B, ctx, new, nq, nkv, d)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for variant in VARIANTS.values():  # warm-up
            _pass(case, variant, nq, d)
        for _ in range(passes):
            for name, variant in VARIANTS.items():
                times[name].append(_pass(case, variant, nq, d))
        ms = {name: 1000 * sorted(t)[len(t) // 4] for name, t in times.items()}
        rows.append({"B": B, "ctx": ctx, "new tokens": new, "queries per kv head": new * nq // nkv,
                     **{f"{name} ms": ms[name] for name in VARIANTS},
                     "speedup": ms["no prefetch"] / ms["default"]})
    return rows


def measure_kv_write(heads: tuple[int, int, int], layers: int, tokens: int = 1000, steps: int = 8,
                     repeats: int = 3, cache_tokens: int = 32768) -> dict[str, float]:
    """ms per `tokens`-token prefill step of rotary + KV write over every layer, into fresh slots
    of caches as large as the engine's default (the mapping's size changes what a fault costs)."""
    from agentrt.engine.kv.kv_cache import cache_buffer
    from agentrt.kernels.paged_attention import rotary_kv_write

    nq, nkv, d = heads
    g = torch.Generator().manual_seed(1)
    cos, sin = torch.randn(tokens, d // 2, generator=g), torch.randn(tokens, d // 2, generator=g)
    qkv = torch.randn(tokens, (nq + 2 * nkv) * d, generator=g).to(torch.bfloat16)
    positions = torch.arange(tokens)
    shape = (max(cache_tokens, tokens * steps), nkv, d)
    variants = {"4k_pages": (False, False), "huge_pages": (True, False), "touched": (True, True)}
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, (huge, touch) in variants.items():
            caches = [(cache_buffer(shape, torch.bfloat16, "cpu", huge), cache_buffer(shape, torch.bfloat16, "cpu", huge))
                      for _ in range(layers)]
            if touch:
                for kc, vc in caches:
                    kc.fill_(0)
                    vc.fill_(0)
            t0 = time.perf_counter()
            for step in range(steps):
                slots = torch.arange(step * tokens, (step + 1) * tokens)
                for kc, vc in caches:
                    rotary_kv_write(qkv, positions, cos, sin, slots, kc, vc, nq)
            best[name] = min(best[name], 1000 * (time.perf_counter() - t0) / steps)
            del caches
    return best


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    speedups = [r["speedup"] for r in rows]
    decode = [r for r in rows if r["new tokens"] == 1] or rows
    head = max(decode, key=lambda r: r["B"])  # the first context of the largest batch
    return {"b16_decode_speedup": head["speedup"], "worst_speedup": min(speedups),
            "best_speedup": max(speedups)}


def run(args: argparse.Namespace) -> BenchResult:
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.kernels.cpu_build import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        raise SystemExit(f"bench attention needs the CPU kernels: {reason}")
    cfg = load_model(args.model, "bfloat16", progress=False).model.cfg
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    layers = cfg.num_hidden_layers
    batches, contexts = ((4, 16), (300,)) if args.quick else ((1, 4, 16), (300, 600))
    passes = args.passes or (12 if args.quick else 30)
    shapes = [(B, ctx, new) for B in batches for ctx in contexts for new in (1, 2)]
    console = Console(stderr=True)
    rows = measure(shapes, heads, layers, passes, console)
    console.print("rotary + KV write, 1000-token steps into fresh slots")
    kv = measure_kv_write(heads, layers)
    return BenchResult(
        rows=rows,
        summary={**summarize(rows), **{f"kv_write_ms_{name}": ms for name, ms in kv.items()}},
        notes=[f"ms: one pass over {layers} layers' attention (nq, nkv, d = {heads}), 25th percentile of "
               f"{passes} interleaved passes; speedup: no prefetch ms / default ms.",
               "rotary + KV write of a 1000-token prefill step into fresh slots of every layer, ms: "
               + ", ".join(f"{name} {ms:.1f}" for name, ms in kv.items())],
        config={"model": args.model, "layers": layers, "heads": list(heads), "passes": passes,
                "batches": list(batches), "contexts": list(contexts), "threads": torch.get_num_threads()},
    )
