"""The engine's timings on one CUDA GPU, on the Triton path: greedy decode at several batch sizes,
speculation (suffix drafter) against plain decoding, and constrained tool calls with the template
drafter, with steps replayed from CUDA graphs (the default) and, for decode and the verify cost,
without. The verify cost: one sequence at 300 cached positions fed 1, 2, 4, 8 and 16 rows, the
forward's median time over the one-row step's; the step against the read floor of the bytes it
reads once (bench/decode.step_bytes) at the GPU's measured read rate. `agentrt bench decode/spec/toolcall/batch-sweep` time the CPU engine and take no device,
so scripts/gpu_check.sh runs this instead; it writes one JSON object to --json.

Each measurement runs once after a short warm-up generation (Triton compiles each kernel for its
shapes' constexprs on first launch) and covers whole generations, prefill included.

A dry run on a CPU, the kernels under Triton's interpreter: `AGENTRT_KERNELS=triton TRITON_INTERPRET=1
python scripts/gpu_engine_bench.py --device cpu --dtype float32 --batches 1 --tokens 4 --model DIR --json PATH`
with DIR a tiny HF model (tests/engine/tiny_models.save_tiny_model: ~1.5 minutes; the embedded
model takes longer than 15). tests/bench/test_gpu_engine_bench.py runs the speculation and
tool-call parts on the CPU engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from agentrt.bench.decode import step_bytes
from agentrt.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from agentrt.engine.loading.model_loader import load_model
from agentrt.engine.calibration import forward_timer
from agentrt.spec.report import SpecReport

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(engine: LLMEngine, prompts: list, params: SamplingParams) -> tuple[list, float]:
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # compile and warm
    _sync(engine.config.device)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    _sync(engine.config.device)
    return results, time.perf_counter() - t0


def _median_s(fn, device: str, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def verify_cost(engine: LLMEngine, reps: int, ctx: int = 300) -> dict:
    """Forward ms of one sequence at ctx cached positions fed n rows (median of reps, each timed
    as the warm-up cost fit times it: calibration.forward_timer, through the engine's step graphs
    where it has them), over the one-row forward's."""
    timer = forward_timer(engine)
    ms = {}
    for n in (1, 2, 4, 8, 16):
        for _ in range(3):  # a bucket's first forward captures it
            timer(n, ctx)
        ms[n] = 1e3 * sorted(timer(n, ctx) for _ in range(reps))[reps // 2]
    return {"step_ms": round(ms[1], 4), **{f"verify{n}_over_step1": round(ms[n] / ms[1], 3) for n in ms if n > 1}}


def spec_summary(engine, tokens: int) -> dict:
    """Suffix speculation against plain decoding on one repetitive chat, `tokens` greedy tokens
    each; engine(**config) makes an engine."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    chat = [[{"role": "user", "content": "Repeat this line five times: alpha beta gamma delta epsilon."}]]
    plain, plain_s = _timed(engine(), chat, greedy)
    spec, spec_s = _timed(engine(spec=SpecConfig(drafter="suffix")), chat, greedy)
    return {"drafter": "suffix", "plain_tokens_per_s": round(tokens / plain_s, 1),
            "spec_tokens_per_s": round(tokens / spec_s, 1), "same_tokens": plain[0].token_ids == spec[0].token_ids,
            "spec": spec[0].spec.to_dict() if spec[0].spec else None}


def toolcall_summary(engine) -> dict:
    """Eight constrained weather calls with the template drafter: how many are valid, their time,
    tokens, forced drafts and tokens per target pass."""
    asks = [[{"role": "user", "content": f"What's the weather in {city}?"}] for city in ("Lisbon", "Rome", "Oslo", "Lima")] * 2
    tool = SamplingParams(max_tokens=96, temperature=0, response_format={"type": "tool_call", "tools": [WEATHER]})
    calls, calls_s = _timed(engine(spec=SpecConfig(drafter="template")), asks, tool)
    valid = [r.error is None and r.parsed is not None and r.parsed.get("name") == "get_weather" for r in calls]
    figures = SpecReport.sum(r.spec for r in calls if r.spec).total
    return {"requests": len(calls), "valid": sum(valid), "seconds": round(calls_s, 4),
            "tokens": sum(len(r.token_ids) for r in calls), "forced": figures.forced,
            "tokens_per_pass": figures.tokens_per_pass}


def read_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large on-device read (a sum over 1 GiB, median of 10)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / _median_s(lambda: x.sum(), device, 10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--json", required=True, metavar="PATH")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script (AGENTRT_KERNELS=triton: the interpreter)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_engine_bench: no CUDA device in this process (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    loaded = load_model(args.model, args.dtype, device=args.device, progress=False)
    model = loaded.model
    engine = lambda **kw: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,  # noqa: E731
                                                 kv_cache_tokens=65536, **kw), loaded=loaded)
    summary: dict = {"gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None, "model": args.model, "dtype": str(model.dtype),
                     "kernel_backend": model.kernel_backend.value, "triton_layers": model.triton_enabled}

    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    summary["decode"] = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [[{"role": "user", "content": f"Tell a long story about the number {i}."}] for i in range(b)]
        for graphs in (True, False):
            results, secs = _timed(engine(cuda_graphs=graphs), prompts, greedy)
            n = sum(len(r.token_ids) for r in results)
            summary["decode"].append({"batch": b, "cuda_graphs": graphs, "tokens": n, "seconds": round(secs, 4),
                                      "tokens_per_s": round(n / secs, 1)})

    reps = 50 if args.device.startswith("cuda") else 2
    summary["verify_cost"] = {"graphs": verify_cost(engine(cuda_graphs=True), reps),
                              "eager": verify_cost(engine(cuda_graphs=False), reps)}
    if args.device.startswith("cuda"):
        bw = read_bandwidth(args.device)
        floor_ms = 1e3 * step_bytes(model) / bw
        summary["read_floor"] = {"step_bytes": step_bytes(model), "read_gb_per_s": round(bw / 1e9, 1),
                                 "floor_ms": round(floor_ms, 4),
                                 "floor_ratio": round(summary["verify_cost"]["graphs"]["step_ms"] / floor_ms, 3)}

    summary["spec"] = spec_summary(engine, args.tokens)
    summary["toolcall"] = toolcall_summary(engine)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print(json.dumps({k: summary[k] for k in ("gpu", "kernel_backend", "triton_layers")}))
    return 0 if summary["toolcall"]["valid"] == summary["toolcall"]["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
