"""Greedy decoding's row argmax (csrc/cpu_argmax_f32.c) in each library that carries it: the AMX
library's AVX-512 build, the quantized kernels' AVX2 build and their scalar one; each must give
argmax_reference's index exactly (first maximum, first NaN, masked entries as -inf)."""
from __future__ import annotations

import pytest
import torch

from agentrt.kernels import cpu_build, quant_build
from agentrt.kernels.argmax import argmax_reference, argmax_rows


@pytest.fixture(scope="module", params=["avx512", "avx2", "scalar"])
def argmax_lib(request):
    if request.param == "avx512":
        lib, why = cpu_build.cpu_kernels(), cpu_build.unsupported_reason()
    else:
        lib, why = quant_build.quant_kernels(scalar=request.param == "scalar"), quant_build.unsupported_reason()
        if request.param == "avx2" and not quant_build.has_fast_path():
            why = "the CPU lacks AVX2/FMA/F16C"
    if why is not None:
        pytest.skip(f"{request.param} argmax cannot run here: {why}")
    assert lib is not None  # a supported machine whose build failed: see the log
    return lib


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 49152), (3, 17), (5, 1000), (40, 49152), (7, 33)])
def test_argmax_matches_torch(argmax_lib, rows, cols):
    g = torch.Generator().manual_seed(rows * 7 + cols)
    # bf16-rounded values, as the LM head writes them: ties are common and the first index wins
    x = torch.randn(rows, cols, generator=g).bfloat16().float()
    x[0, cols // 2] = x[0].max()  # a tie with the maximum at a later index
    assert torch.equal(argmax_rows(x, num_threads=2, lib=argmax_lib), argmax_reference(x))


def test_argmax_edge_values_and_strided_rows(argmax_lib):
    x = torch.full((6, 70), -float("inf"))
    x[1, 69] = 0.0  # max in the scalar tail
    x[2, 5], x[2, 40] = float("nan"), float("nan")  # first NaN wins, as in torch
    x[3, 3], x[3, 50] = -0.0, 0.0  # equal zeros: the first
    x[4] = 1.0  # all tied
    x[5, 64], x[5, 10] = 2.0, float("nan")
    assert torch.equal(argmax_rows(x, lib=argmax_lib), argmax_reference(x))
    wide = torch.randn(9, 128)
    assert torch.equal(argmax_rows(wide[:, 3:90], lib=argmax_lib), argmax_reference(wide[:, 3:90]))  # rows with a stride
    assert argmax_rows(torch.empty(0, 5), lib=argmax_lib).shape == (0,)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V / 32)] int32 bitmask."""
    R, V = allowed.shape
    packed = torch.zeros(R, (V + 31) // 32, dtype=torch.int64)
    for t in range(V):
        packed[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


@pytest.mark.parametrize("rows,cols,p", [(1, 17, 0.5), (6, 100, 0.3), (9, 1000, 0.01), (4, 49152, 0.001), (5, 70, 0.0)])
def test_masked_argmax_matches_masking_then_argmax(argmax_lib, rows, cols, p):
    g = torch.Generator().manual_seed(rows + cols)
    x = torch.randint(0, 5, (rows, cols), generator=g).float()  # few values: ties everywhere
    x[0, :3] = -float("inf")
    allowed = torch.rand(rows, cols, generator=g) < p
    mask = _bitmask(allowed)
    mask_rows = torch.tensor([r if r % 3 else -1 for r in range(rows)])  # some rows unmasked
    got = argmax_rows(x, mask, mask_rows, lib=argmax_lib)
    ref = x.clone()
    for r in range(rows):
        if mask_rows[r] >= 0:
            ref[r][~allowed[r]] = -float("inf")
    assert torch.equal(got, ref.argmax(dim=-1))
    assert torch.equal(got, argmax_reference(x, mask, mask_rows))


def test_masked_argmax_edge_rows(argmax_lib):
    x = torch.full((5, 40), -float("inf"))
    allowed = torch.zeros(5, 40, dtype=torch.bool)
    allowed[0, 35] = True  # only an allowed -inf, in the tail: the first entry (masked to -inf) wins
    x[1, 2], x[1, 30] = float("nan"), float("nan")
    allowed[1, 30] = True  # the masked NaN is -inf, the allowed one wins
    x[2, 10], x[2, 33] = 5.0, 1.0
    allowed[2, 33] = True  # the larger value is masked
    x[3] = 1.0  # all tied, none allowed: 0
    x[4, 39] = 3.0
    allowed[4, 39] = True
    mask = _bitmask(allowed)
    assert argmax_rows(x, mask, lib=argmax_lib).tolist() == [0, 30, 33, 0, 39]
    assert torch.equal(argmax_reference(x, mask), torch.tensor([0, 30, 33, 0, 39]))
