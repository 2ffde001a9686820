"""`agentrt bench decode`: plain greedy decode speed of every path over the same model, side by
side in one run, with each path's perplexity on a fixed text.

Paths (rows): ours on the GGUF's quantized blocks (int8 kernels; when the model has a GGUF and the
kernels build here), ours on the dequantized weights in float (--dtype bfloat16/float32, else
the hardware's float dtype: bf16 with AMX, fp32 without), transformers' generate on those same
float weights, and llama.cpp (llama-cpp-python, `make peers`; skipped with a note when llama_cpp
does not import) on the same GGUF file with the same thread count, in a process of its own: a
crash there (a signal) leaves its row saying how it died, in a `failed` column, and the other
rows complete.

Every path decodes the same prompt token ids (the chat template over PROMPTS), greedy, the same
number of new tokens, at batch 1 and 8 (llama.cpp: 8 sequences in one context, n_seq_max = 8,
through llama_batch / llama_decode). tok/s is decode only: B x (tokens - 1) / (last token - first
token), the first token coming out of the prefill. Best of `repeats` interleaved runs.

floor_ratio / floor_ratio_q4: our batch-1 decode step over the read floor of the bytes a step
reads once (every linear's weights, in GGUF blocks for the quantized path, the head, the norms),
measured in pairs: in a decode run of its own, each step is followed by a plain read of as many
bytes (kernels/stream_read.py: the kernels' threads, each one contiguous part; a buffer on huge
pages like the weights'), and the figure is the median over the steps of step time / read time.
On a shared machine the memory's rate moves with the neighbours' load within a second, so a step
is set against a read of the same moment. config.paths also gives a coarser estimate: the median
step of a tok/s repeat against the best rate of a torch fp32 sum over max(256 MB, 8 x L3) in the
~0.5 s before that repeat (best of the repeats); a best rate against a median step reads high
when the load moves.

Summary: b1_vs_hf, b8_vs_hf (our float path / transformers), b1_vs_llamacpp_q4, b8_vs_llamacpp_q4
(our quantized path / llama.cpp; goals >= 1.2), floor_ratio_q4 (goal <= 1.5), floor_ratio,
startup_s (`agentrt generate` with --dtype, spawn to first byte), ppl_quant, ppl_dequant,
ppl_llamacpp (agentrt/bench/perplexity.py), ppl_ggml_rounding (our fp32 dequantized model with
llama.cpp's activation rounding emulated, bench/ggml_rounding.py: what to hold ppl_llamacpp
against, where ppl_dequant is the model without it). A key whose path did not run, or failed, is null.

Verify cost (bench/verify_cost.py): the forward's time for one sequence fed 1-32 rows and for 8
sequences fed 1 and 8 rows, over the one-row step, per path (the quantized one also capped at each
lower instruction set the CPU has); verify16_over_step1_q4 / verify16_over_step1 (goal for the
quantized path <= 1.6 with AVX512-VNNI or AMX-INT8, <= 2.5 on AVX2); verify16_over_step1_q4_long: the
same at 1024 cached positions (an agent's context; no goal), its table showing how much of what the
extra rows add is attention; verify16_over_step1_q4_tiles / _long_tiles: both with the attention's
dot products on AMX-BF16 tiles (quant_build.attention_tiles, off by default; a row of its own and
a prefill figure; null without AMX-BF16); and prefill_vs_llamacpp_q4: tokens/s of a 512-token
prompt's forward over llama.cpp's prompt evaluation on the same file (goal >= 1.0).

--determinism adds (agentrt/bench/determinism.py): the fraction of greedy tool calls identical
with every drafter and k against each request alone without drafts, and the verify step's cost
at k = 4 and 15 against a 1-token step."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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
BATCHES = (1, 8)


@dataclass
class DecodePath:
    """One row: run(prompt ids, new tokens) -> decode tok/s; ppl() -> perplexity on the text."""

    engine: str
    weights: str
    run: Callable[[list[list[int]], int], float]
    ppl: Callable[[], float]
    tok_s: dict[int, list[float]] = field(default_factory=dict)
    failed: str | None = None  # how the peer's process died or failed, and in what (then no more runs)

    def attempt(self, what: str, measure: Callable[[], float]) -> float | None:
        """measure(), or None once the path's peer has failed (PeerFailed: its process died or
        its call raised), now or before; our own paths' errors are not caught."""
        from agentrt.bench.peer_process import PeerFailed

        if self.failed is not None:
            return None
        try:
            return measure()
        except PeerFailed as e:
            self.failed = f"{e.how} " + ("loading the model" if e.stage == "start" else f"in {what}")
            return None


def _ours(engine, prompts: list[list[int]], n_tokens: int, steps: list[float] | None = None) -> float:
    from agentrt.engine import SamplingParams

    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    engine.step_log.clear()
    results = engine.generate([list(p) for p in prompts], params)
    first = min(r.timings["first_token"] for r in results)
    last = max(r.timings["finished"] for r in results)
    if steps is not None:
        steps += [r.duration_s for r in engine.step_log if r.num_prefill_tokens == 0]
    return len(prompts) * (n_tokens - 1) / (last - first)


def _hf(model, tok, prompts: list[list[int]], n_tokens: int) -> float:
    from agentrt.bench.spec import FirstTokenClock

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    clock = FirstTokenClock()
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                       pad_token_id=tok.pad_token_id, streamer=clock)
    return len(prompts) * (n_tokens - 1) / (time.monotonic() - clock.first)


def _hf_ppl(model, ids: list[int]) -> float:
    from agentrt.bench.perplexity import from_logits

    with torch.inference_mode():
        return from_logits(model(torch.tensor([ids])).logits[0], ids)


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


def float_dtype(dtype: str) -> str:
    """The dtype of our dequantized path: --dtype when it names a float, else what "auto" picks
    for a model without a GGUF on this hardware."""
    from agentrt.engine.loading.model_loader import default_dtype

    return dtype if dtype in ("bfloat16", "float32") else str(default_dtype()).removeprefix("torch.")


def quantized_engine(model: str, notes: list[str]):
    """Our engine on the model's GGUF blocks, or None (with a note) where that path cannot run."""
    from agentrt.engine import EngineConfig, LLMEngine
    from agentrt.engine.loading.registry import find_model_gguf
    from agentrt.kernels.quant_build import unsupported_reason

    if find_model_gguf(model) is None:
        notes.append(f"quantized rows skipped: {model} is not a GGUF model")
        return None
    if unsupported_reason() is not None:
        notes.append(f"quantized rows skipped: the quantized kernels cannot run here ({unsupported_reason()})")
        return None
    return LLMEngine(EngineConfig(model=model, dtype="quantized"))


def step_bytes(model) -> int:
    """Bytes one decode step reads once: every linear's weights (a quantized one's GGUF blocks;
    a tied quantized head is the embedding's blocks, counted once, as the head), the norms. The
    embedding's one row per token is left out."""
    def linear(m) -> int:
        nb = getattr(m, "nbytes", None)
        return nb() if callable(nb) else m.out_features * m.in_features * model.dtype.itemsize

    norms = [model.norm] + [t for ly in model.layers for t in (ly.attn_norm, ly.mlp_norm)]
    linears = [model.lm_head] + [getattr(ly, a) for ly in model.layers for a in ("qkv", "o", "gate_up", "down")]
    return sum(map(linear, linears)) + sum(t.numel() * t.element_size() for t in norms)


def _read_bandwidth(budget_s: float = 0.5) -> float:
    from agentrt.kernels.machine import measure_read_bandwidth

    try:
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        l3_bytes = int(l3.rstrip("K")) << 10 if l3.endswith("K") else int(l3)
    except (OSError, ValueError):
        l3_bytes = 32 << 20
    return measure_read_bandwidth(buffer_bytes=max(256 << 20, 8 * l3_bytes), budget_s=budget_s)


def _paired_floor(engine, prompt: list[int], n_tokens: int, read_buf: torch.Tensor) -> list[tuple[float, float]]:
    """(step seconds, read seconds) of each decode step of one batch-1 greedy run, every step
    followed by a stream_read of read_buf (outside the step's own time)."""
    from agentrt.kernels.stream_read import stream_read_seconds

    pairs: list[tuple[float, float]] = []

    def after_step(record) -> None:
        if record.num_prefill_tokens == 0:
            pairs.append((record.duration_s, stream_read_seconds(read_buf)))

    engine.step_listeners.append(after_step)
    try:
        _ours(engine, [prompt], n_tokens)
    finally:
        engine.step_listeners.remove(after_step)
    return pairs


def _read_buffer(nbytes: int) -> torch.Tensor:
    """nbytes on (transparent) huge pages, as the quantized weights are, every page written; fp32
    ones, so that the torch fallback of stream_read_seconds adds normal floats."""
    from agentrt.engine.kv.kv_cache import cache_buffer

    buf = cache_buffer(((nbytes + 3) // 4,), torch.float32, "cpu").fill_(1.0)
    return buf.view(torch.uint8)[:nbytes]


def run(args: argparse.Namespace) -> BenchResult:
    import transformers

    from agentrt.bench import llamacpp, perplexity
    from agentrt.engine import EngineConfig, LLMEngine
    from agentrt.engine.loading.model_loader import gguf_formats
    from agentrt.engine.loading.registry import find_model_gguf

    console = Console(stderr=True)
    n_tokens = 32 if args.quick else 128
    repeats = 1 if args.quick else 2
    threads = torch.get_num_threads()
    fdt = float_dtype(args.dtype)
    notes: list[str] = []
    deq = LLMEngine(EngineConfig(model=args.model, dtype=fdt))
    quant = quantized_engine(args.model, notes)
    what = f"quantized and {fdt}" if quant is not None else fdt
    console.print(f"[bold]bench decode[/]: {args.model}, {what}, {n_tokens} new tokens, best of {repeats}, "
                  f"{threads} threads")
    gguf = find_model_gguf(args.model)
    peer = llamacpp.load(gguf, threads)
    if peer is None and gguf is not None:
        notes.append(llamacpp.SKIP_NOTE)
    path = deq.loaded.source.path
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=deq.model.dtype).eval()
    tok = deq.loaded.tokenizer
    prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
                  for p in PROMPTS]
    text_ids = perplexity.text_ids(tok, deq.model.cfg.max_position_embeddings)

    steps: dict[str, list[list[float]]] = {"quant": [], "deq": []}  # batch-1 step times, per repeat
    bws: list[float] = []  # the read bandwidth measured before each batch-1 repeat

    def ours(engine, key):
        return lambda prompts, n: _ours(engine, prompts, n, steps[key][-1] if len(prompts) == 1 and steps[key] else None)

    paths: dict[str, DecodePath] = {}
    q_label = "GGUF"
    if quant is not None:
        q_label += " " + gguf_formats(quant.model)
        paths["quant"] = DecodePath("agentrt", q_label, ours(quant, "quant"),
                                    lambda: perplexity.ours(quant.loaded, text_ids))
    paths["deq"] = DecodePath("agentrt", f"{fdt} (dequantized)" if gguf else fdt, ours(deq, "deq"),
                              lambda: perplexity.ours(deq.loaded, text_ids))
    paths["hf"] = DecodePath(f"transformers {transformers.__version__}", fdt,
                             lambda p, n: _hf(hf_model, hf_tok, p, n), lambda: _hf_ppl(hf_model, text_ids))
    if peer is not None:
        paths["llamacpp"] = DecodePath(f"llama.cpp (llama-cpp-python {peer.version})", q_label, peer.decode_tok_s,
                                       lambda: peer.perplexity(text_ids))

    for batch in BATCHES:
        prompts = prompt_ids[:batch]
        for p in paths.values():  # warm-up: first-call allocations, kernel selection
            p.attempt(f"the batch-{batch} warm-up", lambda: p.run(prompts, 4))
        for r in range(repeats):
            console.print(f"  batch {batch}: repeat {r + 1}/{repeats}")
            if batch == 1:
                bws.append(_read_bandwidth())
                steps["quant"].append([]), steps["deq"].append([])
            for p in paths.values():
                got = p.attempt(f"batch {batch}, repeat {r + 1}", lambda: p.run(prompts, n_tokens))
                if got is not None:
                    p.tok_s.setdefault(batch, []).append(got)
    console.print(f"  perplexity on {len(text_ids)} tokens")
    ppl = {k: p.attempt("the perplexity", p.ppl) for k, p in paths.items()}
    ppl_rounding = _ggml_rounding_ppl(args.model, text_ids, notes) if gguf is not None else None
    best = {k: {b: max(v) for b, v in p.tok_s.items()} for k, p in paths.items()}
    rows = [{"engine": p.engine, "weights": p.weights, **{f"b{b}_tok_s": best[k].get(b) for b in BATCHES},
             "ppl": ppl[k], **({"failed": p.failed} if p.failed else {})} for k, p in paths.items()]
    notes += [f"{p.engine} {p.failed}: its row holds what it measured before" for p in paths.values() if p.failed]

    verify = _verify_cost(quant, deq, paths, peer, args.quick, console, notes)
    if peer is not None:
        peer.close()

    console.print("  measuring startup")
    startup = min(_startup_s(args.model, args.dtype) for _ in range(1 if args.quick else 2))

    def ratio(a: str, b: str, batch: int) -> float | None:
        x, y = best.get(a, {}).get(batch), best.get(b, {}).get(batch)
        return x / y if x is not None and y is not None else None

    floor: dict[str, float | None] = {}
    config_paths = {}
    ours_paths = [(k, e) for k, e in (("quant", quant), ("deq", deq)) if e is not None]
    nbytes = {key: step_bytes(engine.model) for key, engine in ours_paths}
    read_buf = _read_buffer(max(nbytes.values()))
    pairs: dict[str, list[tuple[float, float]]] = {key: [] for key, _ in ours_paths}
    for r in range(repeats):
        console.print(f"  read floor: paired steps and reads, repeat {r + 1}/{repeats}")
        for key, engine in ours_paths:
            pairs[key] += _paired_floor(engine, prompt_ids[0], n_tokens, read_buf[: nbytes[key]])
    for key in ("quant", "deq"):
        if key not in pairs:
            floor[key] = None
            continue
        floor[key] = statistics.median(step / read for step, read in pairs[key])
        step_ms = statistics.median(step for step, _ in pairs[key]) * 1e3
        read_ms = statistics.median(read for _, read in pairs[key]) * 1e3
        # the coarser estimate: a tok/s repeat's median step against the torch sum's best rate before it
        best_step, bw = min(((statistics.median(s), bw) for s, bw in zip(steps[key], bws)), key=lambda t: t[0] * t[1])
        notes.append(f"{paths[key].weights}: batch-1 decode step median {step_ms:.2f} ms, a read of its "
                     f"{nbytes[key] / 1e6:.1f} MB right after each step median {read_ms:.2f} ms "
                     f"({nbytes[key] / read_ms / 1e6:.1f} GB/s); step / read median of {len(pairs[key])} pairs "
                     f"{floor[key]:.2f} (against the best torch read rate before a tok/s repeat, "
                     f"{bw / 1e9:.1f} GB/s: {best_step * bw / nbytes[key]:.2f})")
        config_paths[key] = {"step_ms": step_ms, "read_ms": read_ms, "step_bytes": nbytes[key], "pairs": len(pairs[key]),
                             "floor_ratio_best_bw": best_step * bw / nbytes[key], "best_bw_step_ms": best_step * 1e3,
                             "read_bw_gb_s": bw / 1e9}
    notes.append(f"perplexity on {len(text_ids)} tokens of Pride and Prejudice, chapter 1 (bench/perplexity.py): "
                 + ", ".join(f"{p.engine.split(' (')[0]} {p.weights} {ppl[k]:.3f}" for k, p in paths.items()
                             if ppl[k] is not None))
    notes.append("tok/s: decode only, B x (tokens - 1) / (last token - first token)")
    summary = {
        "b1_vs_hf": ratio("deq", "hf", 1),
        "b8_vs_hf": ratio("deq", "hf", 8),
        "b1_vs_llamacpp_q4": ratio("quant", "llamacpp", 1),
        "b8_vs_llamacpp_q4": ratio("quant", "llamacpp", 8),
        "floor_ratio_q4": floor["quant"],
        "floor_ratio": floor["deq"],
        **verify.pop("summary"),
        "startup_s": startup,
        "ppl_quant": ppl.get("quant"),
        "ppl_dequant": ppl["deq"],
        "ppl_llamacpp": ppl.get("llamacpp"),
        "ppl_ggml_rounding": ppl_rounding,
    }
    config = {"model": args.model, "dtype": args.dtype, "float_dtype": fdt, "gguf": str(gguf) if gguf else None,
              "new_tokens": n_tokens, "repeats": repeats, "threads": threads, "read_bw_gb_s": [b / 1e9 for b in bws],
              "ppl_tokens": len(text_ids), "paths": config_paths,
              "llama_cpp": peer.version if peer is not None else None,
              "prompt_tokens": [len(p) for p in prompt_ids], "verify_cost": verify}
    if getattr(args, "determinism", False):
        main = quant if quant is not None and args.dtype in ("auto", "quantized") else deq
        summary |= _determinism(main, args.quick, console, notes, config, getattr(args, "batch_invariant", False),
                                getattr(args, "determinism_requests", None))
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)


def _ggml_rounding_ppl(model: str, ids: list[int], notes: list[str]) -> float | None:
    """The perplexity of our fp32 model with llama.cpp's activation rounding (bench/ggml_rounding.py),
    or None with a note where a weight's type has no emulation."""
    from agentrt.bench import ggml_rounding, perplexity

    try:  # ValueError: a weight type without an emulation, or a row that is no whole number of blocks
        got = perplexity.of_model(ggml_rounding.rounding_model(model)[0], ids)
    except ValueError as e:
        notes.append(f"ppl_ggml_rounding skipped: {e}")
        return None
    notes.append(f"perplexity of our fp32 model with llama.cpp's activation rounding emulated: {got:.3f}")
    return got


def _verify_cost(quant, deq, paths: dict, peer, quick: bool, console: Console, notes: list[str]) -> dict:
    """The verify cost table (printed), the prefill figures; {"summary": {...}, "rows": [...], ...}."""
    from agentrt.bench import verify_cost as vc
    from agentrt.tables import print_table

    reps = 5 if quick else 15
    rows, ratio16, prefill, long_rows, long16, tiles = [], {}, {}, [], None, None
    if quant is not None:
        rows, ratio16 = vc.quantized_rows(quant.model, paths["quant"].weights, reps, console)
        console.print(f"  verify cost: {paths['quant'].weights} at {vc.LONG_CONTEXT} cached positions")
        long_rows, long16 = vc.long_context_rows(quant.model, reps)
        console.print("  prefill: ours, quantized")
        prefill["quant"] = vc.prefill_tok_s(quant.model, 2 if quick else 3)
        tiles = vc.tile_attention(quant.model, paths["quant"].weights, reps, console)
        if tiles is not None:
            rows.append(tiles["row"])
            prefill["quant_attention_tiles"] = tiles["prefill_tok_s"]
    console.print(f"  verify cost: {paths['deq'].weights}")
    deq_ms = vc.forward_ms(deq.model, reps)
    rows.append(vc.cost_row(paths["deq"].weights, deq_ms))
    if "llamacpp" in paths:
        ids = torch.randint(0, deq.model.cfg.vocab_size, (vc.PREFILL_TOKENS,),
                            generator=torch.Generator().manual_seed(1)).tolist()
        console.print("  prefill: llama.cpp")
        got = paths["llamacpp"].attempt("the prefill", lambda: peer.prefill_tok_s(ids, 2 if quick else 3))
        if got is not None:
            prefill["llamacpp"] = got
    print_table(f"verify cost: a forward of S sequences x n rows ({vc.CONTEXT} cached positions each) over "
                "the one-row step", rows, console)
    if long_rows:
        print_table(f"verify cost at {long_rows[0]['context']} cached positions, {paths['quant'].weights}, default "
                    "kernels: one sequence fed n rows, what the rows add and how much of it is attention", long_rows,
                    console)
    if prefill:
        notes.append(f"prefill of a {vc.PREFILL_TOKENS}-token prompt, one forward: "
                     + ", ".join(f"{k} {v:.0f} tok/s" for k, v in prefill.items()))
    default = next((r for r in rows if r["path"].endswith("(default)")), None)
    q16 = default["1x16"] if default else None
    summary = {"verify16_over_step1_q4": q16, "verify16_over_step1": deq_ms[(1, 16)] / deq_ms[(1, 1)],
               "verify16_over_step1_q4_long": long16,
               # the attention on AMX-BF16 tiles (off by default; None where the CPU has none)
               "verify16_over_step1_q4_tiles": tiles["row"]["1x16"] if tiles else None,
               "verify16_over_step1_q4_long_tiles": tiles["long16"] if tiles else None,
               "prefill_vs_llamacpp_q4": (prefill["quant"] / prefill["llamacpp"]
                                          if "quant" in prefill and "llamacpp" in prefill else None)}
    return {"summary": summary, "rows": rows, "verify16_over_step1_q4_by_isa": ratio16, "prefill_tok_s": prefill,
            "context": vc.CONTEXT, "reps": reps, "long_context_rows": long_rows}


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
