"""The read floor's plain read (csrc/cpu_stream_read.c): every byte read once, on any number of
threads, whatever the buffer's length and alignment (the byte sum must equal torch's)."""
from __future__ import annotations

import pytest
import torch

from agentrt.kernels import quant_build
from agentrt.kernels import stream_read as stream_read_module
from agentrt.kernels.stream_read import stream_read, stream_read_reference, stream_read_seconds


@pytest.fixture(scope="module", params=["avx2", "scalar"])
def read_lib(request):
    lib, why = quant_build.quant_kernels(scalar=request.param == "scalar"), quant_build.unsupported_reason()
    if request.param == "avx2" and why is None and not quant_build.has_fast_path():
        why = "the CPU lacks AVX2/FMA/F16C"
    if why is not None:
        pytest.skip(f"{request.param} build cannot run here: {why}")
    assert lib is not None
    return lib


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 127, 1000, 4096 + 37, (1 << 20) + 3])
@pytest.mark.parametrize("offset", [0, 33])
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_every_byte_read_once(read_lib, n, offset, threads):
    g = torch.Generator().manual_seed(n + offset)
    whole = torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=g)
    buf = whole[offset:]  # a start off the 64-byte lines: the parts' cuts move, no byte is lost
    assert stream_read(buf, threads, lib=read_lib) == stream_read_reference(buf)


def test_many_threads_for_few_bytes_and_other_dtypes(read_lib):
    buf = torch.full((5,), 255, dtype=torch.uint8)
    assert stream_read(buf, 64, lib=read_lib) == 5 * 255  # more threads than lines
    x = torch.randn(1001)  # read as bytes whatever the dtype
    assert stream_read(x, 2, lib=read_lib) == stream_read_reference(x)


def test_the_timed_read_reads_every_byte_on_the_kernel_or_sums_floats_without_it(monkeypatch):
    calls = []

    class Lib:
        def agentrt_stream_read(self, ptr, n, threads):
            calls.append((ptr, n, threads))
            return 0

    x = torch.ones(3, 7)  # [3, 7] fp32: 84 bytes
    monkeypatch.setattr(stream_read_module, "quant_kernels", lambda: Lib())
    stream_read_seconds(x, 3)
    assert calls == [(x.data_ptr(), 84, 3)]
    summed = []
    monkeypatch.setattr(stream_read_module, "quant_kernels", lambda: None)
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: summed.append(t.numel()))
    stream_read_seconds(torch.ones(11, dtype=torch.uint8))  # 11 bytes: the first 8 as 2 floats
    assert summed == [2]
