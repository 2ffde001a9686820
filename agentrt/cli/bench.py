"""Dispatch `agentrt bench NAME` to agentrt/bench/NAME.py (module names use underscores)."""
from __future__ import annotations

import argparse
import importlib
import sys

from agentrt.cli.engine_args import add_dtype_argument

# bench name -> module. Each module has add_arguments(parser) (optional) and run(args) -> BenchResult.
BENCHES = {
    "decode": "agentrt.bench.decode",
    "spec": "agentrt.bench.spec",
    "batch-sweep": "agentrt.bench.batch_sweep",
    "toolcall": "agentrt.bench.toolcall",
    "workload": "agentrt.bench.workload",
    "tools": "agentrt.bench.tools",
    "attention": "agentrt.bench.attention",
    "serve": "agentrt.bench.serve",
    "scale": "agentrt.bench.scale",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a fast look")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    p.add_argument("--model", default="smollm2-135m-instruct")
    add_dtype_argument(p)
    # The bench's own options (only the named bench's module is imported).
    argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else []
    name = next((a for a in argv if not a.startswith("-")), None)
    if name in BENCHES:
        extra = getattr(importlib.import_module(BENCHES[name]), "add_arguments", None)
        if extra is not None:
            extra(p)


def run(args: argparse.Namespace) -> int:
    from agentrt.bench.common import finish

    module = importlib.import_module(BENCHES[args.name])
    result = module.run(args)
    finish(args.name, result, args.json)
    return 0
