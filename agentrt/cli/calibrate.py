"""`agentrt calibrate`: re-measure the engine's step-cost model for this model, dtype and machine."""
from __future__ import annotations

import argparse

from agentrt.cli.engine_args import add_dtype_argument, engine_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    add_dtype_argument(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=256, help="largest step (new tokens) to time")
    p.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    from agentrt.engine import LLMEngine
    from agentrt.engine.calibration import calibrate_engine
    from agentrt.tables import print_table

    engine = LLMEngine(engine_config(args))
    model, report, path = calibrate_engine(engine, max_tokens=args.max_tokens, repeats=args.repeats)
    print_table("predicted vs measured step time", report)
    print(f"overhead {model.overhead_s * 1e3:.1f} ms, ridge at ~{model.ridge_tokens():.1f} tokens, "
          f"K/V read {model.bytes_per_kv_token / 1e3:.1f} KB per cached token, fit error {100 * (model.fit_rel_rmse or 0):.1f}% rms")
    print(f"saved {path}")
    return 0
