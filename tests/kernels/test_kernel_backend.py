"""The kernel backend seam: AGENTRT_KERNELS and the device pick cpu, torch or triton."""
import pytest
import torch

from agentrt.kernels import backend
from agentrt.kernels.backend import KernelBackend, backend_for, choose_backend


def test_auto_picks_per_device():
    for spelled in ({}, {"AGENTRT_KERNELS": "1"}, {"AGENTRT_KERNELS": "auto"}):
        assert choose_backend("cpu", spelled).backend is KernelBackend.CPU
        assert choose_backend("cuda", spelled).backend is KernelBackend.TRITON
        assert choose_backend("meta", spelled).backend is KernelBackend.TORCH


def test_forced_backends_and_settings_that_cannot_serve_a_device():
    for spelled in ("0", "torch", " Torch "):
        assert choose_backend("cuda", {"AGENTRT_KERNELS": spelled}).backend is KernelBackend.TORCH
    assert choose_backend("cpu", {"AGENTRT_KERNELS": "cpu"}).backend is KernelBackend.CPU
    with pytest.raises(ValueError, match="cannot take cuda tensors"):
        choose_backend("cuda", {"AGENTRT_KERNELS": "cpu"})
    with pytest.raises(ValueError, match="AGENTRT_KERNELS='gpu' is not one of"):
        choose_backend("cpu", {"AGENTRT_KERNELS": "gpu"})


def test_triton_on_cpu_tensors_runs_interpreted_and_needs_the_interpreter(monkeypatch):
    choice = choose_backend("cpu", {"AGENTRT_KERNELS": "triton"})
    assert choice.backend is KernelBackend.TRITON and "interpreted" in choice.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a process that compiles for its GPU
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        choose_backend("cpu", {"AGENTRT_KERNELS": "triton"})
    assert choose_backend("cpu", {"AGENTRT_KERNELS": "triton", "TRITON_INTERPRET": "1"}).backend is KernelBackend.TRITON


def test_the_process_choice_reads_the_environment_once_and_serves_the_triton_ops(monkeypatch):
    monkeypatch.setenv("AGENTRT_KERNELS", "triton")
    backend._process_choice.cache_clear()
    try:
        assert backend_for(torch.device("cpu")) is KernelBackend.TRITON
        monkeypatch.setenv("AGENTRT_KERNELS", "torch")
        assert backend_for("cpu") is KernelBackend.TRITON  # decided once per device type
        from agentrt.kernels.triton.silu_gate import silu_gate, silu_gate_reference
        gate_up = torch.randn(3, 10)
        op = silu_gate if backend_for(gate_up.device) is KernelBackend.TRITON else silu_gate_reference
        torch.testing.assert_close(op(gate_up), silu_gate_reference(gate_up), rtol=1e-5, atol=1e-5)
    finally:
        backend._process_choice.cache_clear()
