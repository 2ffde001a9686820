"""Which kernel family serves a device in this process: the C CPU kernels, the pure-torch
references, or the Triton kernels (kernels/triton).

AGENTRT_KERNELS picks it (read once per process and device type):

* unset, "1" or "auto": per device, CUDA tensors -> triton (torch where Triton is not
  installed), CPU tensors -> cpu (each op's dispatcher still falls back to its torch reference
  where the C build cannot run on this CPU), any other device -> torch.
* "0" or "torch": the references everywhere (what AGENTRT_KERNELS=0 already means for the C kernels).
* "cpu": the C kernels; only CPU tensors can take it.
* "triton": Triton on every device; CPU tensors then run in Triton's interpreter, which this
  process must have chosen (no CUDA device, or TRITON_INTERPRET=1: see kernels/triton), slowly,
  for tests and for checking the GPU path's results on a CPU.

A caller asks once where it sets up (a model loader, a step sampler) and keeps the answer:

    if backend_for(logits.device) is KernelBackend.TRITON:
        from agentrt.kernels.triton.verify import verify_drafts
    else:
        from agentrt.spec.verify import verify_drafts
"""
from __future__ import annotations

import enum
import functools
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

ENV = "AGENTRT_KERNELS"


class KernelBackend(enum.Enum):
    CPU = "cpu"  # the C kernels (csrc/), built on first use
    TORCH = "torch"  # the pure-torch references
    TRITON = "triton"  # kernels/triton, compiled for the GPU or interpreted on CPU tensors


_SPELLINGS: dict[str, KernelBackend | None] = {
    "": None, "1": None, "auto": None, "0": KernelBackend.TORCH,
    **{b.value: b for b in KernelBackend},
}


@dataclass(frozen=True)
class BackendChoice:
    backend: KernelBackend
    device_type: str
    reason: str  # why this backend, for logs and banners


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interprets(env: Mapping[str, str]) -> bool:
    """Whether kernels/triton runs (or will run) in the interpreter in this process."""
    return env.get("TRITON_INTERPRET", "") == "1" or not torch.cuda.is_available()


def choose_backend(device: torch.device | str, env: Mapping[str, str] | None = None) -> BackendChoice:
    """The backend for tensors on `device` under `env` (default os.environ); a setting that
    cannot serve that device raises ValueError naming the variable and the reason."""
    env = os.environ if env is None else env
    device_type = torch.device(device).type
    spelled = env.get(ENV, "").strip().lower()
    if spelled not in _SPELLINGS:
        raise ValueError(f"{ENV}={env.get(ENV)!r} is not one of auto, 1, 0, torch, cpu, triton")
    forced = _SPELLINGS[spelled]
    if forced is KernelBackend.TORCH:
        return BackendChoice(forced, device_type, f"{ENV}={env.get(ENV)}")
    if forced is KernelBackend.CPU:
        if device_type != "cpu":
            raise ValueError(f"{ENV}=cpu names the C CPU kernels, which cannot take {device_type} tensors")
        return BackendChoice(forced, device_type, f"{ENV}=cpu")
    if forced is KernelBackend.TRITON:
        if not _triton_installed():
            raise ValueError(f"{ENV}=triton but triton is not installed")
        if device_type == "cpu" and not _triton_interprets(env):
            raise ValueError(f"{ENV}=triton on CPU tensors needs Triton's interpreter, which this process with a "
                             "CUDA device only uses under TRITON_INTERPRET=1")
        how = "interpreted" if device_type == "cpu" else "compiled"
        return BackendChoice(forced, device_type, f"{ENV}=triton ({how})")
    if device_type == "cuda":
        if _triton_installed():
            return BackendChoice(KernelBackend.TRITON, device_type, "CUDA tensors")
        return BackendChoice(KernelBackend.TORCH, device_type, "CUDA tensors, triton not installed")
    if device_type == "cpu":
        return BackendChoice(KernelBackend.CPU, device_type, "CPU tensors")
    return BackendChoice(KernelBackend.TORCH, device_type, f"no kernels for {device_type} tensors")


@functools.cache
def _process_choice(device_type: str) -> BackendChoice:
    return choose_backend(torch.device(device_type))


def process_backend(device: torch.device | str) -> BackendChoice:
    """choose_backend under this process's environment, decided once per device type."""
    return _process_choice(torch.device(device).type)


def backend_for(device: torch.device | str) -> KernelBackend:
    """The backend this process uses for tensors on `device`."""
    return process_backend(device).backend
