"""llama.cpp's activation rounding as agentrt/bench/ggml_rounding.py emulates it, against NumPy
re-statements of ggml's quantizers (quantize_row_q8_K_ref; the x86 quantize_row_q8_0) on hand-made
vectors: the block scale, halves rounded to even, the round trip within half a
step; rows that are no whole number of blocks refused; a linear's row blocks each rounded for
their own weight type, equal to the integer dot products ggml sums."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrt.bench import ggml_rounding as gr


def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml-quants.c's nearest_int: the float add of 1.5 * 2^23 rounds to the nearest, ties to even."""
    val = (f.astype(np.float32) + np.float32(12582912.0)).astype(np.float32)
    return (val.view(np.int32) & 0x007FFFFF) - 0x00400000


def q8_k_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref: (quants [nb, 256], d [nb])."""
    qs, ds = [], []
    for blk in x.astype(np.float32).reshape(-1, 256):
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax == 0:
            qs.append(np.zeros(256, np.int32)), ds.append(np.float32(0))
            continue
        iscale = np.float32(-127.0) / mx
        qs.append(np.minimum(127, nearest_int(iscale * blk)))
        ds.append(np.float32(1.0) / iscale)
    return np.stack(qs), np.asarray(ds, np.float32)


def q8_0_x86(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml-cpu's AVX quantize_row_q8_0: (quants [nb, 32], d [nb] as stored, fp16)."""
    blk = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blk).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(blk * inv).astype(np.int32), (amax[:, 0] / np.float32(127.0)).astype(np.float16)


def hand_made_k() -> np.ndarray:
    rng = np.random.default_rng(3)
    x = rng.normal(size=512).astype(np.float32)
    x[10], x[200] = 8.0, -8.0  # block 0: its largest magnitude twice, of either sign (q and d flip together)
    x[256:] = np.arange(256, dtype=np.float32) / 2 - 64.0  # block 1: halves
    x[256 + 5] = -127.0  # its max is negative, iscale = 1: each half rounds to even
    return x


def test_q8_k_matches_ggml_reference_and_round_trips_within_half_a_step():
    x = hand_made_k()
    q, d = q8_k_ref(x)
    got = gr.round_q8_k(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, (q * d[:, None]).reshape(-1).astype(np.float32))
    assert d[0] < 0 < d[1]  # d carries the sign of -max: block 0's max is +8, block 1's -127
    assert list(q[1, [129, 131, 133, 135]]) == [0, 2, 2, 4]  # 0.5, 1.5, 2.5, 3.5: ties to even, not away
    step = np.repeat(np.abs(d), 256)
    assert np.all(np.abs(got - x) <= step / 2 * (1 + 1e-6))


def test_q8_k_blocks_are_256_values_with_one_scale():
    x = hand_made_k()
    x[300] = 1000.0  # an outlier in block 1 coarsens block 1 only
    got, ref = gr.round_q8_k(torch.from_numpy(x)).numpy(), gr.round_q8_k(torch.from_numpy(hand_made_k())).numpy()
    assert np.array_equal(got[:256], ref[:256]) and not np.array_equal(got[256:300], ref[256:300])


def test_q8_0_matches_x86_quantizer():
    x = hand_made_k()
    q, d = q8_0_x86(x)
    got = gr.round_q8_0(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, (q * d.astype(np.float32)[:, None]).reshape(-1))
    zero = gr.round_q8_0(torch.zeros(64))
    assert torch.equal(zero, torch.zeros(64))


@pytest.mark.parametrize(("fn", "n", "size"), [(gr.round_q8_k, 300, 256), (gr.round_q8_0, 40, 32)])
def test_rows_of_no_whole_number_of_blocks_are_refused(fn, n, size):
    with pytest.raises(ValueError, match=f"blocks of {size} values; a row of {n}"):
        fn(torch.randn(3, n))


def test_unknown_weight_type_is_refused():
    with pytest.raises(ValueError, match="TQ1_0 has no activation rounding"):
        gr.activation_type("TQ1_0")


class _Linear:
    def __init__(self, w: torch.Tensor):
        self.weight, self.bias = w, None
        self.out_features, self.in_features = w.shape


def test_rounding_linear_rounds_each_row_block_for_its_weight_type():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 512, generator=g), torch.randn(5, 512, generator=g) * 3
    lin = gr.RoundingLinear(_Linear(w), [(16, "Q4_K"), (8, "Q5_0")])
    y = lin(x)
    # ggml's sum for the Q4_K rows: per 256-value block, d * (W[:, block] @ integer quants)
    q, d = q8_k_ref(x.numpy())
    q, d = torch.from_numpy(q).double().reshape(5, 2, 256), torch.from_numpy(d).double().reshape(5, 2)
    wb = w[:16].double().reshape(16, 2, 256)
    ggml = torch.einsum("tb,nbk,tbk->tn", d, wb, q)
    assert torch.allclose(y[:, :16].double(), ggml, rtol=1e-5, atol=1e-4)
    assert torch.allclose(y[:, 16:], gr.round_q8_0(x) @ w[16:].T, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(y[:, :16], gr.round_q8_0(x) @ w[:16].T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="do not add up to the linear's 24 rows"):
        gr.RoundingLinear(_Linear(w), [(16, "Q4_K")])
