"""`agentrt bench spec`: speculative decoding at batch 1, per drafter and k, side by side with
no speculation, with transformers' plain and prompt-lookup generate, and with llama.cpp's plain
and prompt-lookup generate (llama-cpp-python's `Llama.generate`, with `LlamaPromptLookupDecoding`
as its draft model, on the model's GGUF file; skipped with a note when llama_cpp does not
import: `make peers`; in a process of its own, so that a crash there leaves its rows saying how it
died, in a `failed` column, and the other rows complete), on four prompt kinds.

Every run is greedy, same prompt token ids, same max new tokens, eos honoured. A run of ours uses
a fresh engine, so the suffix drafter's cross-request history never holds an earlier run's output.
tok/s is decode speed: (generated - 1) / (last token - first token), because speculation changes
only the decode phase (the prefill of the 700-token agent prompt is identical for every row;
e2e_tok_s includes it). Runs are interleaved round-robin over repeats and the best repeat is kept
(interference from other processes only slows a run down).

Summary (agent transcript): best_speedup_vs_nospec (best row / our no-spec), vs_hf_prompt_lookup
(that row / transformers prompt lookup), vs_llamacpp_lookup (that row / llama.cpp prompt lookup;
null without llama_cpp). Goals: >= 2.0, >= 1.5 and >= 1.5.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console

from agentrt.bench.common import BenchResult
from agentrt.bench.prompts import SPEC_PROMPTS
from agentrt.spec.report import SpecFigures

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
LLAMACPP_LOOKUP = "llama.cpp prompt-lookup 10"  # llama-cpp-python's default num_pred_tokens (bench/llamacpp.py)


@dataclass(frozen=True)
class Variant:
    """One row configuration: ours with a SpecConfig, or a transformers or llama.cpp baseline
    (hf / llamacpp = "plain" | "lookup")."""

    label: str
    drafter: str = "none"
    k: int | None = 0  # None = adaptive
    hf: str | None = None
    llamacpp: str | None = None

    @property
    def ours(self) -> bool:
        return self.hf is None and self.llamacpp is None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, help="interleaved repeats per row (best kept)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--layerskip", type=int, default=15, help="layers of the layer-skip drafter")


def variants(ks: tuple[int, ...], layerskip: int, layerskip_ks: tuple[int, ...] | None = None,
             llamacpp: bool = False) -> list[Variant]:
    out = [Variant("none")]
    for drafter, dks in (("suffix", ks), (f"layerskip:{layerskip}", ks if layerskip_ks is None else layerskip_ks)):
        out += [Variant(f"{drafter} k={k}", drafter, k) for k in dks]
        out.append(Variant(f"{drafter} adaptive", drafter, None))
    out += [Variant("hf generate", hf="plain"), Variant(f"hf prompt-lookup {HF_PROMPT_LOOKUP_TOKENS}", hf="lookup")]
    if llamacpp:
        out += [Variant("llama.cpp generate", llamacpp="plain"), Variant(LLAMACPP_LOOKUP, llamacpp="lookup")]
    return out


# ---- one timed run ----------------------------------------------------------------------------


def run_ours(loaded, drafter: str, k: int | None, prompt_ids: list[int], max_tokens: int, cost_model=None,
             response_format: dict | None = None, engine=None) -> dict[str, Any]:
    """One greedy request on a fresh engine (or `engine`); decode and end-to-end timings, α totals."""
    from agentrt.engine import SamplingParams, SpecConfig

    if engine is None:
        engine = new_engine(loaded, SpecConfig(drafter=drafter, k=k), len(prompt_ids) + max_tokens, cost_model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, response_format=response_format)
    t0 = time.monotonic()
    result = engine.generate([list(prompt_ids)], params)[0]
    return _timed(result.token_ids, t0, result.timings["first_token"], result.timings["finished"],
                  spec=result.spec.total.to_dict(), result=result)


def new_engine(loaded, spec, max_len: int, cost_model=None):
    from agentrt.engine import EngineConfig, LLMEngine

    # Engines hold reference cycles (engine <-> spec runner): collect the previous run's engine and
    # its KV cache now, not in a garbage-collector pause inside the next timed run.
    gc.collect()
    dtype = getattr(loaded, "weights", None) or str(loaded.model.dtype).removeprefix("torch.")
    cfg = EngineConfig(model=str(loaded.source.path), dtype=dtype, spec=spec,
                       kv_cache_tokens=max(2048, 2 * max_len + 64))
    engine = LLMEngine(cfg, loaded=loaded)
    if cost_model is not None:
        # One cost model for every engine of a run: loading it per engine would re-read (or
        # re-measure) the machine's rates each time.
        engine.spec.cost_model = cost_model
    return engine


class FirstTokenClock:
    """A transformers streamer that only notes when the first generated token arrives
    (put() is called once with the prompt, then with every batch of new tokens)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.monotonic()

    def end(self) -> None:
        pass


def run_hf(model, prompt_ids: list[int], max_tokens: int, eos_ids: tuple[int, ...], prompt_lookup: int | None = None) -> dict[str, Any]:
    """transformers' generate, greedy, batch 1, same stopping tokens; prompt_lookup = its
    prompt_lookup_num_tokens (n-gram assisted generation) or None for plain decoding."""
    ids = torch.tensor([prompt_ids])
    clock = FirstTokenClock()
    kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    t0 = time.monotonic()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=list(eos_ids), pad_token_id=eos_ids[0], streamer=clock, **kw)
    finished = time.monotonic()
    new = out[0, len(prompt_ids):].tolist()
    return _timed(new, t0, clock.first or finished, finished)


def _timed(token_ids: list[int], t0: float, first: float, finished: float, spec: dict | None = None,
           result=None) -> dict[str, Any]:
    n = len(token_ids)
    decode_s = finished - first
    return {
        "tokens": n,
        "token_ids": list(token_ids),
        "decode_s": decode_s,
        "e2e_s": finished - t0,
        "tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan"),
        "e2e_tok_s": n / (finished - t0),
        "spec": spec or {},
        "result": result,
    }


def load_hf(loaded):
    """transformers' model over the same weights directory and dtype as ours. For a quantized
    model (whose directory may hold no weights): the float conversion of the same GGUF, in fp32,
    the dtype of the quantized path's activations."""
    import transformers

    from agentrt.engine.loading.registry import KNOWN_MODELS, resolve_model

    path = loaded.source.path
    if getattr(loaded.model, "quantized", None):
        name = loaded.source.name if loaded.source.name in KNOWN_MODELS else str(loaded.source.gguf)
        path = resolve_model(name, progress=False).path
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=loaded.model.dtype).eval()


def measure(loaded, hf_model, prompts: dict[str, list[int]], vs: list[Variant], max_tokens: int, repeats: int,
            cost_model=None, log=lambda msg: None, peer=None,
            failed: dict[str, str] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """Best (highest decode tok/s) run per (prompt kind, variant label), interleaved over repeats.
    peer: the llama.cpp peer (bench/llamacpp.py) for llama.cpp variants. A variant whose peer
    failed (its process died, or the call raised) runs no more: failed[label] says how and
    where, and its best runs are those before."""
    from agentrt.bench.peer_process import PeerFailed

    eos = tuple(loaded.tokenizer.eos_token_ids)
    failed = {} if failed is None else failed
    death: list[str] = []  # how and where the peer's process ended, once it has

    def once(v: Variant, ids: list[int], n: int) -> dict[str, Any] | None:
        if v.llamacpp is not None:
            if v.label not in failed and peer.gone is not None:  # it ended loading, or in another row's run
                failed[v.label] = death[0] if death else f"{peer.gone.how} loading the model"
            if v.label in failed:
                return None
            try:
                return _timed(*peer.generate_run(ids, n, eos, lookup=v.llamacpp == "lookup"))
            except PeerFailed as e:
                failed[v.label] = f"{e.how} in a {v.label} run ({len(ids)} prompt tokens)"
                if peer.gone is not None:
                    death.append(failed[v.label])
                return None
        if v.hf is not None:
            return run_hf(hf_model, ids, n, eos, HF_PROMPT_LOOKUP_TOKENS if v.hf == "lookup" else None)
        return run_ours(loaded, v.drafter, v.k, ids, n, cost_model)

    shortest = min(prompts.values(), key=len)
    for v in vs:  # warm-up: first-call allocations, kernel selection, lazy imports
        once(v, shortest, 8)
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in range(repeats):
        for kind, ids in prompts.items():
            log(f"  repeat {r + 1}/{repeats}: {kind} ({len(ids)} prompt tokens)")
            for v in vs:
                got = once(v, ids, max_tokens)
                key = (kind, v.label)
                if got is not None and (key not in best or got["tok_s"] > best[key]["tok_s"]):
                    best[key] = got
    return best


def table_rows(best: dict, prompts: dict, vs: list[Variant], failed: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per (prompt kind, variant); failed: {label: how its peer failed} (measure), for the
    variants whose best run may be missing (their figures are then null)."""
    failed = failed or {}
    hf_pl = next(v.label for v in vs if v.hf == "lookup")
    lcpp_pl = next((v.label for v in vs if v.llamacpp == "lookup"), None)
    rows = []
    for kind in prompts:
        base, plain, pl = best[kind, "none"]["tok_s"], best[kind, "hf generate"]["tok_s"], best[kind, hf_pl]["tok_s"]
        lcpp = best.get((kind, lcpp_pl))
        for v in vs:
            b = best.get((kind, v.label))
            if b is None:  # a peer that failed before its first run on this prompt
                rows.append({"prompt": kind, "config": v.label, **dict.fromkeys(FIGURES),
                             **({"vs_lcpp_pl": None} if lcpp_pl else {}), "failed": failed.get(v.label)})
                continue
            s = b["spec"]
            rows.append({
                "prompt": kind,
                "config": v.label,
                "tokens": b["tokens"],
                "alpha": s.get("alpha"),
                "tok_per_pass": s.get("tokens_per_pass"),
                "drafts_per_pass": SpecFigures.from_dict(s).drafts_per_pass,
                "tok_s": b["tok_s"],
                "e2e_tok_s": b["e2e_tok_s"],
                "vs_nospec": b["tok_s"] / base,
                "vs_hf": b["tok_s"] / plain,
                "vs_hf_pl": b["tok_s"] / pl,
            })
            if lcpp_pl is not None:
                rows[-1]["vs_lcpp_pl"] = b["tok_s"] / lcpp["tok_s"] if lcpp is not None else None
            if v.label in failed:
                rows[-1]["failed"] = failed[v.label]
    return rows


FIGURES = ("tokens", "alpha", "tok_per_pass", "drafts_per_pass", "tok_s", "e2e_tok_s", "vs_nospec", "vs_hf", "vs_hf_pl")


def summarize(rows: list[dict[str, Any]], kind: str = "agent") -> dict[str, Any]:
    mine = [r for r in rows if r["prompt"] == kind and _is_ours(r["config"]) and r["config"] != "none"]
    top = max(mine, key=lambda r: r["tok_s"])
    adaptive = next(r for r in mine if r["config"] == "suffix adaptive")
    return {
        "best_speedup_vs_nospec": top["vs_nospec"],
        "vs_hf_prompt_lookup": top["vs_hf_pl"],
        "best_config": top["config"].replace(" ", "_"),
        "adaptive_vs_nospec": adaptive["vs_nospec"],
        "adaptive_vs_hf_prompt_lookup": adaptive["vs_hf_pl"],
        "vs_llamacpp_lookup": top.get("vs_lcpp_pl"),
    }


def _is_ours(config: str) -> bool:
    return not config.startswith(("hf", "llama.cpp"))


def encode_prompts(loaded, chats: dict[str, list[dict]]) -> dict[str, list[int]]:
    tok = loaded.tokenizer
    return {kind: tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True)) for kind, msgs in chats.items()}


def shared_cost_model(loaded):
    """The cost model the adaptive rows use: what `agentrt run` and `serve` would use. The cached
    calibration for this model, dtype, machine (and quantized kernels) when there is one; else,
    on the quantized path, the warm-up fit on quick_grid's forwards (made and cached here, as they make
    it); else the analytic roofline."""
    from agentrt.engine.calibration import load_or_estimate_cost_model, model_cost_path, quick_cost_model
    from agentrt.engine.step.spec_runner import SpecConfig

    engine = new_engine(loaded, SpecConfig(), 2048)  # KV room for every point of the warm-up fit's grid
    path = model_cost_path(engine)
    if engine.model.quantized and not path.exists():
        model = quick_cost_model(engine)
        try:
            model.save(path)
        except OSError:  # used in this run all the same
            pass
        return model
    return load_or_estimate_cost_model(engine)


def run(args: argparse.Namespace) -> BenchResult:
    from agentrt.bench import llamacpp
    from agentrt.engine.loading.model_loader import load_model
    from agentrt.engine.loading.registry import find_model_gguf

    console = Console(stderr=True)
    quick = args.quick
    ks = (2, 4, 8) if quick else (1, 2, 4, 8)
    # layer-skip drafts cost a partial forward each: at α ~ 0, k = 8 runs ~4x slower than plain
    layerskip_ks = (2,) if quick else ks
    max_tokens = getattr(args, "max_new_tokens", None) or (48 if quick else 128)
    # Step times of ~15 ms swing several-fold when other processes take a core: interleaved
    # repeats, best kept, make the side-by-side ratios usable on a shared machine.
    repeats = getattr(args, "repeats", None) or (3 if quick else 5)
    layerskip = getattr(args, "layerskip", None) or 15
    loaded = load_model(args.model, args.dtype, progress=False)
    hf_model = load_hf(loaded)
    cost_model = shared_cost_model(loaded)
    prompts = encode_prompts(loaded, SPEC_PROMPTS)
    gguf = find_model_gguf(args.model)
    peer = llamacpp.load(gguf)
    vs = variants(ks, layerskip, layerskip_ks, llamacpp=peer is not None)
    console.print(f"[bold]bench spec[/]: {args.model} {getattr(loaded, 'weights', args.dtype)}, batch 1, greedy, {max_tokens} new tokens max, "
                  f"{len(vs)} rows x {len(prompts)} prompts, best of {repeats}; cost model: {cost_model.source}")
    load_before = os.getloadavg()[0]
    failed: dict[str, str] = {}
    best = measure(loaded, hf_model, prompts, vs, max_tokens, repeats, cost_model, log=console.print, peer=peer,
                   failed=failed)
    if peer is not None:
        peer.close()
    load_after = os.getloadavg()[0]
    rows = table_rows(best, prompts, vs, failed)
    summary = summarize(rows)
    notes = [f"{kind}: best {r['config']} {r['vs_nospec']:.2f}x no-spec, {r['vs_hf_pl']:.2f}x hf prompt lookup"
             + (f", {r['vs_lcpp_pl']:.2f}x llama.cpp prompt lookup" if r.get("vs_lcpp_pl") is not None else "")
             for kind in prompts
             for r in [max((x for x in rows if x["prompt"] == kind and x["config"] != "none" and _is_ours(x["config"])),
                           key=lambda x: x["tok_s"])]]
    notes += [f"{label}: the llama.cpp peer {how}; its rows hold what it measured before" for label, how in failed.items()]
    if peer is None:
        notes.append(llamacpp.SKIP_NOTE if gguf is not None else f"llama.cpp rows skipped: {args.model} is not a GGUF model")
    notes.append("tok_s: decode tokens/s after the first token; vs_*: ratios of tok_s in this run. Goals (agent): "
                 "best_speedup_vs_nospec >= 2.0, vs_hf_prompt_lookup >= 1.5, vs_llamacpp_lookup >= 1.5.")
    notes.append(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs")
    config = {"model": args.model, "dtype": args.dtype, "max_new_tokens": max_tokens, "ks": list(ks), "layerskip_ks": list(layerskip_ks),
              "repeats": repeats,
              "layerskip": layerskip, "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS,
              "prompt_tokens": {k: len(v) for k, v in prompts.items()}, "cost_model": cost_model.source,
              "threads": torch.get_num_threads(), "loadavg_before_after": [load_before, load_after],
              "weights": getattr(loaded, "weights", args.dtype), "llama_cpp": peer.version if peer is not None else None,
              "llamacpp_lookup_num_pred_tokens": llamacpp.LOOKUP_NUM_PRED_TOKENS}
    return BenchResult(rows=rows, summary=summary, notes=notes, config=config)
