"""What every benchmark shares: a result shape, a table, a JSON file and one closing line."""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from agentrt.files import write_text_atomic
from agentrt.tables import fmt as _fmt, print_table


@dataclass
class BenchResult:
    """rows: one dict per measured configuration (same keys across rows make one table).
    summary: the figures the benchmark's goals are stated in (docs/benchmarks.md); printed as the final
    `NAME: k=v` line."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    name: str | None = None  # the closing line's and the JSON's name when not the bench's (a mode of it)
    line_keys: tuple[str, ...] | None = None  # the summary keys the closing line shows (default: all)


CPU_FLAGS_OF_NOTE = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and which of the instruction sets the kernels use it has (Linux)."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "cpu_flags": [f for f in CPU_FLAGS_OF_NOTE if f in flags]}


def machine_info() -> dict[str, Any]:
    import os

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            **cpu_info()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def finish(name: str, result: BenchResult, json_path: str | None) -> None:
    console = Console()
    name = result.name or name
    print_table(f"bench {name}", result.rows, console)
    for n in result.notes:
        console.print(n)
    if json_path:
        payload = {
            "bench": name,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": machine_info(),
            "config": result.config,
            "rows": result.rows,
            "summary": result.summary,
        }
        write_text_atomic(json_path, json.dumps(payload, indent=2, default=str))
    cpu = cpu_info()
    console.print(f"machine: {cpu['cpu']}, {os.cpu_count()} CPUs, flags {' '.join(cpu['cpu_flags']) or 'none of note'}")
    keys = result.line_keys or tuple(result.summary)
    print(f"{name}: " + " ".join(f"{k}={_fmt(result.summary.get(k))}" for k in keys), flush=True)
