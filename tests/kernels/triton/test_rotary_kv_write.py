"""The Triton rotary + KV write (run by Triton's interpreter where there is no GPU) against the
pure-torch reference. Tolerance: none in fp32 and fp16, the kernel repeats the reference's
roundings op by op, so q, k and both caches must be bit-identical. (bf16 is not tested here: the
interpreter converts fp32 to bf16 by truncation, not round-to-nearest as the GPU does.)"""
from __future__ import annotations

import pytest
import torch

from agentrt.kernels.triton.rotary_kv_write import rotary_kv_write, rotary_kv_write_reference


@pytest.mark.parametrize("nq,nkv,d,dtype", [
    (9, 3, 64, torch.float32),
    (9, 3, 64, torch.float16),
    (32, 8, 128, torch.float16),
    (32, 8, 128, torch.float32),
])
def test_rotary_kv_write_is_bit_identical_to_reference(nq, nkv, d, dtype):
    """Odd token count, positions in any order, scattered slots, strided qkv rows (a view into a
    wider buffer, as the fused qkv projection's output can be) and zeros, for the sign of -0 * sin."""
    g = torch.Generator().manual_seed(nq + d)
    T, num_slots = 13, 96
    cos, sin = torch.randn(200, d // 2, generator=g), torch.randn(200, d // 2, generator=g)
    positions = torch.randint(0, 200, (T,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:T]
    width = (nq + 2 * nkv) * d
    wide = torch.randn(T, width + 24, generator=g).to(dtype)
    qkv = wide[:, :width]
    qkv[:, ::7] = 0.0
    caches = [torch.randn(num_slots, nkv, d, generator=g).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    ref_qkv = qkv.clone()
    rotary_kv_write_reference(ref_qkv, positions, cos, sin, slots, caches[0], caches[1], nq)
    rotary_kv_write(qkv, positions, cos, sin, slots, caches[2], caches[3], nq)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_rotary_kv_write_leaves_other_slots_and_the_padding_columns_alone():
    g = torch.Generator().manual_seed(2)
    nq, nkv, d = 9, 3, 64
    cos, sin = torch.randn(40, d // 2, generator=g), torch.randn(40, d // 2, generator=g)
    wide = torch.randn(2, (nq + 2 * nkv) * d + 8, generator=g)
    tail = wide[:, -8:].clone()
    k_cache, v_cache = torch.zeros(32, nkv, d), torch.zeros(32, nkv, d)
    slots = torch.tensor([17, 3])
    rotary_kv_write(wide[:, :-8], torch.tensor([39, 0]), cos, sin, slots, k_cache, v_cache, nq)
    assert torch.equal(wide[:, -8:], tail)
    others = torch.ones(32, dtype=torch.bool)
    others[slots] = False
    assert not k_cache[others].any() and not v_cache[others].any()
    assert torch.equal(v_cache[3], wide[1, (nq + nkv) * d:-8].view(nkv, d))  # v is copied, not rotated
    assert torch.equal(k_cache[17], wide[0, nq * d:(nq + nkv) * d].view(nkv, d))  # the rotated k


def test_a_negative_slot_is_rotated_and_never_written():
    """Padding rows of a replayed step carry slot -1: their q and k are rotated like any row's (the
    rows are dropped later), no cache row changes, and the other rows' writes are the reference's."""
    g = torch.Generator().manual_seed(3)
    nq, nkv, d = 9, 3, 64
    cos, sin = torch.randn(40, d // 2, generator=g), torch.randn(40, d // 2, generator=g)
    qkv = torch.randn(4, (nq + 2 * nkv) * d, generator=g)
    slots, positions = torch.tensor([5, -1, 2, -1]), torch.tensor([7, 0, 3, 0])
    caches = [torch.randn(8, nkv, d, generator=g) for _ in range(2)]
    before = [c.clone() for c in caches]
    ref = [c.clone() for c in caches]
    ref_qkv = qkv.clone()
    rotary_kv_write_reference(ref_qkv, positions, cos, sin, slots, ref[0], ref[1], nq)
    rotary_kv_write(qkv, positions, cos, sin, slots, caches[0], caches[1], nq)
    assert torch.equal(qkv, ref_qkv) and torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    untouched = torch.tensor([i not in (5, 2) for i in range(8)])
    assert torch.equal(caches[0][untouched], before[0][untouched]) and torch.equal(caches[1][untouched], before[1][untouched])
    assert not torch.equal(caches[0][5], before[0][5]) and not torch.equal(caches[1][2], before[1][2])


def test_bad_inputs_name_what_is_wrong():
    nq, nkv, d = 4, 2, 64
    qkv = torch.zeros(3, (nq + 2 * nkv) * d)
    cos = sin = torch.zeros(10, d // 2)
    positions, slots = torch.arange(3), torch.arange(3)
    cache = torch.zeros(8, nkv, d)
    with pytest.raises(ValueError, match="not \\(nq=5"):
        rotary_kv_write(qkv, positions, cos, sin, slots, cache, cache.clone(), 5)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_kv_write(qkv, positions, cos[:, :8], sin[:, :8], slots, cache, cache.clone(), nq)
    with pytest.raises(ValueError, match="share a dtype"):
        rotary_kv_write(qkv.half(), positions, cos, sin, slots, cache, cache.clone(), nq)
    with pytest.raises(ValueError, match="positions and slots"):
        rotary_kv_write(qkv, positions[:2], cos, sin, slots, cache, cache.clone(), nq)
