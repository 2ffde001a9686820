"""The KV cache's CPU buffers: zeros on first touch, writable, alive as long as the tensor, on
huge pages where the kernel gives them (the buffer's contents never depend on it)."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from agentrt.engine.config import ModelConfig
from agentrt.engine.kv.kv_cache import HUGE_PAGE, KVCache, cache_buffer


@pytest.mark.parametrize("huge_pages", [True, False])
def test_cache_buffer_is_zero_and_writable(huge_pages):
    t = cache_buffer((3000, 3, 64), torch.bfloat16, "cpu", huge_pages)
    assert t.shape == (3000, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1234] = 1.5
    assert t[1234].eq(1.5).all() and t.sum().item() == pytest.approx(1.5 * 3 * 64)


def test_cache_buffer_outlives_its_creator_scope():
    views = [cache_buffer((100, 2, 16), torch.bfloat16, "cpu")[10:20] for _ in range(3)]
    gc.collect()
    for v in views:
        v.fill_(2.0)
        assert v.eq(2.0).all()


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping holding addr (/proc/self/smaps), or None where there is none."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    lines = smaps.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
            for entry in lines[i + 1 : i + 40]:
                if entry.startswith("VmFlags:"):
                    return entry.split()[1:]
    return None


def _resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of t's pages that are mapped, from the present bit of /proc/self/pagemap (one 64-bit
    entry per 4 KB page; adjacent mappings may merge, so smaps' Rss would not be t's alone)."""
    pagemap = Path("/proc/self/pagemap")
    if not pagemap.exists():
        return None
    page = 4096
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with pagemap.open("rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    present = sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))
    return present * page


@pytest.mark.parametrize("populate_option", ["kernel", "unsupported"])
def test_prefaulted_buffer_is_resident_zero_and_writable(populate_option, monkeypatch):
    if populate_option == "unsupported":  # a kernel without MADV_POPULATE_WRITE: pages are written instead
        monkeypatch.setattr("agentrt.engine.kv.kv_cache.MADV_POPULATE_WRITE", 12345)
    shape = (3 * HUGE_PAGE // 384, 3, 64)  # 6 MB of bf16
    lazy = cache_buffer(shape, torch.bfloat16, "cpu")
    t = cache_buffer(shape, torch.bfloat16, "cpu", prefault=True)
    nbytes = t.numel() * t.element_size()
    if _resident_bytes(t) is None:
        pytest.skip("no /proc/self/pagemap")
    assert _resident_bytes(t) >= nbytes  # every page mapped before any KV write
    assert _resident_bytes(lazy) < nbytes // 2  # the default maps on first touch
    assert not t.any()
    t[77] = 2.5
    assert t.sum().item() == pytest.approx(2.5 * 3 * 64)


@pytest.mark.parametrize("huge_pages", [True, False])
def test_cache_buffer_asks_for_huge_pages_only_when_told(huge_pages):
    """The mapping carries the kernel's MADV_HUGEPAGE mark ("hg") exactly when asked; whether a
    fault then gets a 2 MB page depends on free memory, so that is not asserted."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    t = cache_buffer((2 * HUGE_PAGE,), torch.bfloat16, "cpu", huge_pages)
    flags = _vm_flags(t.data_ptr())
    if flags is None:
        pytest.skip("no /proc/self/smaps")
    assert ("hg" in flags) == huge_pages


def test_kv_cache_layout_per_layer():
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    kv = KVCache(cfg, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    assert len(kv.k) == len(kv.v) == 3
    assert all(t.shape == (20, 2, 8) and not t.any() for t in (*kv.k, *kv.v))
    assert len({t.data_ptr() for t in (*kv.k, *kv.v)}) == 6


def test_a_shared_partly_filled_block_is_copied_before_it_is_written():
    """Copy-on-write end to end: a sequence forked mid-block grows into the shared block; the
    engine's copy (BlockManager.pop_copies -> KVCache.copy_blocks) keeps the shared positions for
    the fork, and the original's K/V stay as they were when the fork writes its own token."""
    from agentrt.engine.kv.block_manager import BlockManager

    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    bm, kv = BlockManager(8, 4), KVCache(cfg, num_blocks=8, block_size=4, dtype=torch.float32)
    bm.grow(0, 6)  # positions 0..5: block 0 full, block 1 half
    slots = torch.tensor(bm.slots(0, 0, 6))
    src_k = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 1, 4)
    for layer in range(2):
        kv.write(layer, slots, src_k + layer, -src_k)
    bm.fork(0, 1, 6)
    assert bm.tables[1] == bm.tables[0]
    bm.grow(1, 7)  # the fork writes position 6 into the shared half block
    copies = bm.pop_copies()
    assert len(copies) == 1 and copies[0][0] == bm.tables[0][1] and bm.tables[1][1] == copies[0][1]
    assert bm.pop_copies() == []
    kv.copy_blocks(copies)
    new = torch.full((1, 1, 4), 99.0)
    for layer in range(2):
        kv.write(layer, torch.tensor(bm.slots(1, 6, 7)), new, new)
    for layer in range(2):
        assert torch.equal(kv.k[layer][torch.tensor(bm.slots(1, 0, 6))], src_k + layer)  # shared positions kept
        assert torch.equal(kv.k[layer][torch.tensor(bm.slots(0, 0, 6))], src_k + layer)  # the original untouched
        assert torch.equal(kv.v[layer][torch.tensor(bm.slots(1, 6, 7))], new)
    bm.grow(0, 7)  # the original writing on its (now unshared) block owes no copy
    assert bm.pop_copies() == []
