"""What this machine can do: large-tensor read bandwidth and matmul FLOP rate, per dtype.

The analytic step-cost model (cost_model.analytic) needs both; measuring them takes a second or
two, so results are cached per machine and dtype in a JSON file the caller names.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentrt.errors import CalibrationError, SpecConfigError
from agentrt.files import write_text_atomic

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


@dataclass(frozen=True)
class MachineRates:
    read_bw_bytes_per_s: float
    matmul_flops_per_s: float
    dtype: str  # "bfloat16" | "float16" | "float32"
    machine_id: str = ""
    device: str = "cpu"


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, 'bf16' or 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_NAMES.get(name, name)
    if name not in ("bfloat16", "float16", "float32"):
        raise SpecConfigError(f"dtype {dtype!r} is not one of bfloat16, float16, float32")
    return name


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_id(device: str = "cpu") -> str:
    """A file-name-safe id of the hardware a measurement holds for: the GPU's name, or the CPU
    model with its core count and torch's thread count (2 threads and 1 thread differ ~2x)."""
    import torch

    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        return "cuda-" + _slug(torch.cuda.get_device_name(idx))
    return f"cpu-{_slug(_cpu_model())}-{os.cpu_count()}c-{torch.get_num_threads()}t"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _best_seconds(fn, device: str, budget_s: float, min_reps: int = 2) -> float:
    """Fastest of repeated runs within budget_s (noise on a shared machine only ever slows)."""
    fn()
    _sync(device)  # warm-up: first-touch page faults, kernel selection
    best, spent, reps = math.inf, 0.0, 0
    while reps < min_reps or spent < budget_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
        if reps >= 200:
            break
    return best


def measure_read_bandwidth(device: str = "cpu", buffer_bytes: int | None = None, budget_s: float = 0.5) -> float:
    """Bytes per second of a streaming reduction over a buffer far larger than the caches.
    Read as float32 whatever the model dtype: bytes are bytes, and torch's fp32 sum is the
    fastest streaming read on CPU (its bf16 sum converts and runs at half the rate)."""
    import torch

    if buffer_bytes is None:
        buffer_bytes = (1 << 30) if device.startswith("cuda") else (256 << 20)
    x = torch.ones(max(1, buffer_bytes // 4), dtype=torch.float32, device=device)  # [n]
    seconds = _best_seconds(lambda: x.sum(), device, budget_s)
    return x.numel() * 4 / seconds


def measure_matmul_rate(
    dtype: Any, device: str = "cpu", shape: tuple[int, int, int] = (256, 1024, 4096), budget_s: float = 0.5
) -> float:
    """FLOP/s of [m, k] @ [k, n] in dtype; pass the model's (tokens, hidden, intermediate)."""
    import torch

    m, k, n = shape
    tdtype = getattr(torch, dtype_name(dtype))
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=tdtype)  # [m, k]
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=tdtype)  # [k, n]
    seconds = _best_seconds(lambda: a @ b, device, budget_s)
    return 2.0 * m * k * n / seconds


def _read_cache(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"machine-rates cache {path} is unreadable ({e}); delete it to re-measure") from e
    if not isinstance(data, dict):
        raise CalibrationError(f"machine-rates cache {path} is not a JSON object; delete it to re-measure")
    return data


def _write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def measure_machine(
    dtype: Any,
    seconds_budget: float = 2.0,
    cache_path: str | os.PathLike | None = None,
    *,
    device: str = "cpu",
    gemm_shape: tuple[int, int, int] = (256, 1024, 4096),
    buffer_bytes: int | None = None,
    refresh: bool = False,
) -> MachineRates:
    """Measure (or read from cache_path) this machine's read bandwidth and matmul rate for dtype.
    The budget is split between the two micro-benchmarks; each runs at least twice."""
    if not (seconds_budget > 0):
        raise SpecConfigError(f"seconds_budget must be > 0, got {seconds_budget!r}")
    name, mid = dtype_name(dtype), machine_id(device)
    key = f"{mid}|{name}"
    path = Path(cache_path) if cache_path is not None else None
    if path is not None and not refresh:
        entry = _read_cache(path).get(key)
        if entry is not None:
            return MachineRates(**{k: entry[k] for k in MachineRates.__dataclass_fields__})
    bw = measure_read_bandwidth(device, buffer_bytes, seconds_budget / 2)
    flops = measure_matmul_rate(name, device, gemm_shape, seconds_budget / 2)
    rates = MachineRates(bw, flops, name, mid, device)
    if path is not None:
        data = _read_cache(path)
        data[key] = {**asdict(rates), "measured_at": time.time(), "gemm_shape": list(gemm_shape)}
        _write_json_atomic(path, data)
    return rates
