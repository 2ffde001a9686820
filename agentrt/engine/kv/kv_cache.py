"""The paged KV cache's tensors: one K and one V buffer per layer, [num_blocks * block_size,
kv_heads, head_dim]. One buffer per layer rather than one for all: under torch.compile a shared
buffer written through views made inductor copy the whole cache every layer (a 17.6 ms step became 39 ms).
Which sequence owns which block is the BlockManager's business; this class only stores."""
from __future__ import annotations

import logging
import math
import mmap

import numpy as np
import torch

from agentrt.engine.config import ModelConfig

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python 3.11 lacks the name


def cache_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, huge_pages: bool = True,
                 prefault: bool = False) -> torch.Tensor:
    """On CPU, an anonymous mapping: zero pages mapped on first touch, so a cache costs neither
    start-up time nor resident memory until used (torch.zeros writes every byte: ~0.5 s for the
    default 32k-token cache; touching it all ~1.1 s). Every first touch is then a page fault that
    zeroes the page, and KV writes land on fresh pages until the allocator has cycled through the
    cache (it hands out the least recently freed block). Transparent huge pages are asked for
    (madvise): one fault per 2 MB instead of per 4 KB, though the zeroing stays. `agentrt bench
    attention` measured a 1000-token prefill step's rotary + KV write over 30 layers at 11.3-15.7
    ms on 4 KB pages, 10.6-14.9 on huge pages, 7.7-10.3 on touched ones (six runs). Where huge
    pages are off the mapping stays on small pages (logged at debug level). The quantized
    weights' buffer (models/quant_layers.gather_weights) is such a mapping too, for the huge pages.

    prefault: map and zero every page now (madvise MADV_POPULATE_WRITE, else a write of zeros),
    so the first steps do not pay for it: 0.6-1.2 s for the default cache at engine start here,
    against a fresh engine's first step of 11 short prompts in 0.27-0.39 s without it and
    0.17-0.21 s with it (later steps fault too, as the allocator reaches fresh blocks)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private, so huge pages apply (shared memory has its own switch)
        buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: an anonymous mapping takes no flags
        buf = mmap.mmap(-1, max(nbytes, 1))
    if huge_pages and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # a kernel without transparent huge pages: small pages, same contents
            log.debug("KV cache on small pages: madvise(MADV_HUGEPAGE) failed: %s", e)
    # numpy keeps the mapping alive for as long as the tensor (its base) lives
    tensor = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=nbytes)).view(dtype).view(shape)
    if prefault:
        try:
            buf.madvise(MADV_POPULATE_WRITE)
        except (OSError, AttributeError) as e:  # an older kernel or another OS: touch every page ourselves
            log.debug("KV cache prefaulted by writing zeros: madvise(MADV_POPULATE_WRITE) failed: %s", e)
            tensor.view(-1).view(torch.uint8).zero_()
    return tensor


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
        prefault: bool = False,
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [cache_buffer(shape, dtype, device, prefault=prefault) for _ in range(cfg.num_hidden_layers)]
        self.v = [cache_buffer(shape, dtype, device, prefault=prefault) for _ in range(cfg.num_hidden_layers)]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots [T]; k, v [T, nkv, d], rounded to the cache's dtype where it differs
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (copy-on-write of a shared, partly filled block)."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs]).to(self.k[0].device)
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs]).to(self.k[0].device)
        for buf in (*self.k, *self.v):
            buf.index_copy_(0, dst, buf[src])
