"""`agentrt bench decode`: our engine vs transformers' generate, same weights and dtype, side by side.

Reports tokens/s at batch 1 and 8, our batch-1 step time against the memory-bandwidth floor
(weight bytes / read bandwidth measured in this run), and process start -> first token.

--determinism adds (agentrt/bench/determinism.py): the fraction of greedy tool calls identical
with every drafter and k against each request alone without drafts, and the verify step's cost
at k = 4 and 15 against a 1-token step."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
from rich.console import Console

from agentrt.bench.common import BenchResult

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Summarise the plot of Hamlet in two sentences.",
    "What is 17 times 23?",
    "Give me a packing list for a weekend hike.",
]


def _ours(engine, prompts, n_tokens: int) -> tuple[float, list[float]]:
    from agentrt.engine import SamplingParams

    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    engine.step_log.clear()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    decode_steps = [r.duration_s for r in engine.step_log if r.num_prefill_tokens == 0]
    return len(prompts) * n_tokens / dt, decode_steps


def _hf(model, tok, prompts, n_tokens: int) -> float:
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in prompts]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return len(prompts) * n_tokens / (time.perf_counter() - t0)


def _startup_s(model: str, dtype: str) -> float:
    """Wall time from spawning `agentrt generate` to its first byte of output (warm caches)."""
    cmd = [sys.executable, "-m", "agentrt.cli", "generate", "Hi", "--max-tokens", "2", "--temperature", "0",
           "--model", model, "--dtype", dtype]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.communicate()
    return first


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--determinism", action="store_true",
                   help="also: greedy outputs with vs without speculation, and the verify step's cost")
    p.add_argument("--batch-invariant", action="store_true",
                   help="with --determinism: also the PyTorch path's batch-invariant mode, and what it costs")
    p.add_argument("--determinism-requests", type=int, default=None, metavar="N",
                   help="with --determinism: only the first N of the 24 tool-call requests")


def run(args: argparse.Namespace) -> BenchResult:
    import transformers

    from agentrt.engine import EngineConfig, LLMEngine
    from agentrt.spec.machine import measure_read_bandwidth

    console = Console(stderr=True)
    n_tokens = 32 if args.quick else 128
    repeats = 1 if args.quick else 2
    from agentrt.engine.model_loader import parse_dtype

    dtype = parse_dtype(args.dtype)
    console.print(f"[bold]bench decode[/]: {args.model} {args.dtype}, {n_tokens} new tokens, best of {repeats}")
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    path = engine.loaded.source.path
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    rows = []
    steps_b1: list[float] = []
    for batch in (1, 8):
        prompts = PROMPTS[:batch]
        ours, hf = [], []
        _ours(engine, prompts, 4), _hf(hf_model, hf_tok, prompts, 4)  # warm-up
        for r in range(repeats):
            console.print(f"  batch {batch}: repeat {r + 1}/{repeats}")
            tps, steps = _ours(engine, prompts, n_tokens)
            ours.append(tps)
            if batch == 1:
                steps_b1 += steps
            hf.append(_hf(hf_model, hf_tok, prompts, n_tokens))
        rows.append({"batch": batch, "ours_tok_s": max(ours), "hf_tok_s": max(hf), "speedup": max(ours) / max(hf)})

    console.print("  measuring read bandwidth and startup")
    bw = measure_read_bandwidth(budget_s=1.0)
    weight_bytes = sum(t.numel() * t.element_size() for t in _weights(engine.model))
    floor_s = weight_bytes / bw
    step_s = statistics.median(steps_b1)
    startup = min(_startup_s(args.model, args.dtype) for _ in range(1 if args.quick else 2))
    notes = [
        f"batch-1 decode step: median {step_s * 1e3:.1f} ms; floor {floor_s * 1e3:.1f} ms "
        f"({weight_bytes / 1e6:.0f} MB of weights at {bw / 1e9:.1f} GB/s)",
    ]
    summary = {
        "b1_vs_hf": rows[0]["speedup"],
        "b8_vs_hf": rows[1]["speedup"],
        "floor_ratio": step_s / floor_s,
        "startup_s": startup,
    }
    config = {"model": args.model, "dtype": args.dtype, "new_tokens": n_tokens, "repeats": repeats,
              "step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3, "read_bw_gb_s": bw / 1e9}
    if getattr(args, "determinism", False):
        summary |= _determinism(engine, args.quick, console, notes, config, getattr(args, "batch_invariant", False),
                                getattr(args, "determinism_requests", None))
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)


def _determinism(engine, quick: bool, console: Console, notes: list[str], config: dict, invariant: bool = False,
                 limit: int | None = None) -> dict:
    from agentrt.bench.determinism import identical_outputs, verify_step_ms
    from agentrt.tables import print_table

    rows = identical_outputs(engine.loaded, max_tokens=64 if quick else 96, progress=console, limit=limit)
    console.print("  determinism: verify steps")
    ms = verify_step_ms(engine.loaded, reps=10 if quick else 30)
    print_table("greedy tool calls vs each request alone without drafts", rows, console)
    notes.append("verify step, 300 cached positions: " + ", ".join(f"{k + 1} tokens {v:.1f} ms" for k, v in ms.items()))
    config["determinism"] = rows
    config["verify_ms"] = ms
    out = {"identical_min": min(r["identical_fraction"] for r in rows), "verify_k4_ms": ms[4], "verify_k15_ms": ms[15],
           "verify_k4_over_1": ms[4] / ms[0], "verify_k15_over_1": ms[15] / ms[0]}
    if invariant:
        if engine.loaded.model.kernels_enabled:
            notes.append("--batch-invariant: the C kernels run here and are invariant already; the mode applies to "
                         "the PyTorch path (fp32, or AGENTRT_KERNELS=0)")
        inv_rows = identical_outputs(engine.loaded, max_tokens=64 if quick else 96, progress=console, limit=limit,
                                     batch_invariant=True)
        inv_ms = verify_step_ms(engine.loaded, reps=10 if quick else 30, batch_invariant=True)
        prefill = {inv: verify_step_ms(engine.loaded, ks=(255,), ctx=16, reps=3, batch_invariant=inv)[255]
                   for inv in (False, True)}
        notes.append(f"prefill of 256 tokens: {prefill[False]:.0f} ms, batch-invariant {prefill[True]:.0f} ms")
        print_table("the same, batch-invariant mode", inv_rows, console)
        notes.append("verify step, batch-invariant mode: " + ", ".join(f"{k + 1} tokens {v:.1f} ms" for k, v in inv_ms.items()))
        config["determinism_invariant"] = inv_rows
        config["verify_ms_invariant"] = inv_ms
        out |= {"identical_min_invariant": min(r["identical_fraction"] for r in inv_rows),
                "invariant_batch_tok_s_ratio": inv_rows[0]["tok_s"] / rows[0]["tok_s"],
                "invariant_step_ratio": inv_ms[0] / ms[0], "invariant_k15_ratio": inv_ms[15] / ms[15],
                "invariant_prefill256_ratio": prefill[True] / prefill[False]}
    return out


def _weights(model) -> list[torch.Tensor]:
    """The tensors a decode step reads once: every linear, the norms, the head."""
    ts = [model.lm_head.weight, model.norm]
    for layer in model.layers:
        ts += [layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight, layer.attn_norm, layer.mlp_norm]
    return ts
