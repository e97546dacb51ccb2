"""Token-granular access to a paged KV cache whose in-block layout belongs to the backend.

Backends pack a block their own way (vLLM's CPU backend stores K transposed in ISA-dependent
tiles), so graphchunk never assumes a layout: it writes probe values through the backend's own
KV-write op into a two-block scratch cache and reads back where each (slot offset, K/V, head,
dim) landed. Copies are then flat gathers/scatters over each layer's storage.
"""
from __future__ import annotations

import numpy as np
import torch


class KVSlotMap:
    """Storage offsets of every element of a slot, for one layer's KV tensor."""

    def __init__(self, base: torch.Tensor, block_stride: int, block_size: int):
        self.base = base  # [block_size, elements per token] offsets in block 0
        self.block_stride = block_stride
        self.block_size = block_size

    @classmethod
    def probe(cls, write_kv, make_cache, block_size: int, num_heads: int, head_size: int,
              dtype: torch.dtype, device) -> "KVSlotMap":
        """``write_kv(key, value, cache, slot_mapping)`` is the backend's write op;
        ``make_cache(num_blocks)`` an empty cache of the real per-layer shape."""
        cache = make_cache(2)
        coords = torch.full((2, block_size, 2, num_heads, head_size), -1, dtype=torch.long)
        ramp = torch.arange(1, head_size + 1, device=device).to(dtype)  # exact in any float dtype
        for block in range(2):
            for offset in range(block_size):
                slot = torch.tensor([block * block_size + offset], device=device)
                for head in range(num_heads):
                    key = torch.zeros(1, num_heads, head_size, dtype=dtype, device=device)
                    key[0, head] = ramp
                    cache.zero_()
                    write_kv(key, -key, cache, slot)
                    flat = _storage_view(cache).float().cpu()
                    for kind, sign in ((0, 1.0), (1, -1.0)):
                        where = torch.nonzero(flat * sign > 0).flatten()
                        coords[block, offset, kind, head, (flat[where] * sign).long() - 1] = where
        if (coords < 0).any():
            raise RuntimeError("KV layout probe: the backend's write op did not place every element")
        stride = coords[1] - coords[0]
        if not (stride == stride.flatten()[0]).all():
            raise RuntimeError("KV layout probe: blocks are not evenly strided in storage")
        return cls(coords[0].reshape(block_size, -1), int(stride.flatten()[0]), block_size)

    def offsets(self, slots: np.ndarray) -> torch.Tensor:
        """Flat storage offsets [n * elements] of the given slots, in a fixed element order."""
        slots = torch.from_numpy(np.asarray(slots, np.int64))
        blocks, within = slots // self.block_size, slots % self.block_size
        return (self.base[within] + blocks[:, None] * self.block_stride).flatten()


def _storage_view(cache: torch.Tensor) -> torch.Tensor:
    """1-D view from the tensor's first element over the storage it spans."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))
    return cache.as_strided((span,), (1,))


def copy_slots(caches: list[torch.Tensor], slot_map: KVSlotMap, src: np.ndarray, dst: np.ndarray) -> None:
    """KV of slots ``src`` into slots ``dst`` in every layer (positions unchanged: no rotation)."""
    src_off = slot_map.offsets(src).to(caches[0].device)
    dst_off = slot_map.offsets(dst).to(caches[0].device)
    for cache in caches:
        flat = _storage_view(cache)
        flat[dst_off] = flat[src_off]


def copy_blocks(caches: list[torch.Tensor], slot_map: KVSlotMap, src: list[int], dst: list[int]) -> None:
    bs = slot_map.block_size
    slots = lambda blocks: (np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs)).flatten()  # noqa: E731
    copy_slots(caches, slot_map, slots(src), slots(dst))
