"""The shared model options become the engine's typed config."""
from __future__ import annotations

import argparse

from agentrt.cli.engine_args import add_model_arguments, engine_config


def _config(*argv: str):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="m")
    add_model_arguments(p)
    return engine_config(p.parse_args(list(argv)))


def test_cuda_graphs_follow_the_device_unless_turned_off():
    assert _config().cuda_graphs is None  # the engine decides: on where a CUDA model runs the Triton kernels
    off = _config("--no-cuda-graphs", "--device", "cuda", "--batch-invariant")
    assert off.cuda_graphs is False and off.device == "cuda" and off.batch_invariant
