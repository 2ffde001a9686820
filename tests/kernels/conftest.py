import pytest

from agentrt.kernels.quant_build import quant_kernels, unsupported_reason


@pytest.fixture(scope="module", params=["native", "scalar"])
def lib(request):
    """The quantized kernels as this CPU builds them (AVX2 path here), and their scalar fallback."""
    if unsupported_reason() is not None:
        pytest.skip(f"quantized kernels cannot run here: {unsupported_reason()}")
    lib = quant_kernels(scalar=request.param == "scalar")
    assert lib is not None  # a supported machine whose build failed: see the log for the compiler error
    return lib
