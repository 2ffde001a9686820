"""Fixtures of the Triton kernel tests.

`edge_uniforms`: uniforms on the edges of an inverse-CDF sampler's steps, where a one-ulp difference in any
cdf value changes the token: a test that samples there compares the cdfs themselves."""
import pytest
import torch


def _edge_uniforms(draw, u0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draw(u [N] fp32) -> tokens [N], non-decreasing in each u. Per row, the smallest fp32
    u > u0 whose token is past draw(u0)'s (1.0 where none is), and the fp32 just below it."""
    first = draw(u0)
    lo = u0.float().view(torch.int32).clone()  # positive floats order like their bit patterns
    hi = torch.full_like(lo, int(torch.tensor(1.0).view(torch.int32)))
    while bool(((hi - lo) > 1).any()):
        mid = (lo + hi) // 2
        past = draw(mid.view(torch.float32)) > first
        hi, lo = torch.where(past, mid, hi), torch.where(past, lo, mid)
    return hi.view(torch.float32), lo.view(torch.float32)


@pytest.fixture
def edge_uniforms():
    return _edge_uniforms
