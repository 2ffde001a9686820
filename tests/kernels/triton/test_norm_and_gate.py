"""RMSNorm + residual and SiLU gate kernels (Triton's interpreter on CPU) against their references
on odd shapes. The residual is exact; the normed and gated outputs differ by the fp32 sum order
and exp/rsqrt's last bit: within 1e-5 (fp32) and one fp16 ulp (2e-3 relative, fp16)."""
import pytest
import torch

from agentrt.kernels.triton.rmsnorm import rmsnorm_residual, rmsnorm_residual_reference
from agentrt.kernels.triton.silu_gate import silu_gate, silu_gate_reference

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [1000, 4099])
def test_rmsnorm_residual_equals_the_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    residual = (torch.randn(5, hidden, generator=gen) * 10).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out, new_residual = rmsnorm_residual(x, residual, weight, 1e-6)
    ref_out, ref_residual = rmsnorm_residual_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual) and out.dtype == ref_out.dtype
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    out, same = rmsnorm_residual(x, None, weight, 1e-5)  # the first layer: no residual yet
    assert same is x
    torch.testing.assert_close(out, rmsnorm_residual_reference(x, None, weight, 1e-5)[0], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [7, 1537])
def test_silu_gate_equals_the_reference(inter, dtype):
    gen = torch.Generator().manual_seed(inter)
    wide = (torch.randn(6, 2 * inter + 3, generator=gen) * 4).to(dtype)
    gate_up = wide[:, 1 : 2 * inter + 1]  # rows with a stride, as a view of a wider buffer
    torch.testing.assert_close(silu_gate(gate_up), silu_gate_reference(gate_up), **TOLERANCE[dtype])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_gate(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_residual(torch.zeros(2, 8), None, torch.ones(7), 1e-6)
