"""`agentrt generate "PROMPT"`: stream a chat completion from the engine."""
from __future__ import annotations

import argparse
import asyncio
import sys

from agentrt.cli.engine_args import add_model_arguments, engine_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name, a .gguf file or a local HF directory")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    add_model_arguments(p)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--spec", default="none", help="drafter: none | suffix | layerskip:N | draft:PATH")
    p.add_argument("--k", type=int, default=None, help="fixed draft length (default: adaptive)")


async def _stream(engine, prompt, params) -> object:
    result = None
    async for ev in engine.stream(prompt, params):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        if ev.finished:
            result = ev.result
    sys.stdout.write("\n")
    return result


def run(args: argparse.Namespace) -> int:
    from agentrt.engine import AsyncEngine, SamplingParams
    from agentrt.engine.spec_report import print_spec_summary

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop),
    )
    engine = AsyncEngine.from_config(engine_config(args, spec={"k": args.k}))
    # on stderr: stdout is the generated text alone (pipes, and bench decode's time to first byte)
    print(f"model: {args.model} ({engine.engine.loaded.precision}; {args.device})", file=sys.stderr, flush=True)
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
    try:
        result = asyncio.run(_stream(engine, prompt, params))
    finally:
        engine.close()
    if result is not None and result.error:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    if args.spec != "none" and result is not None:
        print_spec_summary(result)
    return 0
