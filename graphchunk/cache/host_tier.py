"""The host-memory level of the tier: entries' KV payloads in process memory, below the device pool.

Every entry computed into the pool is written through to it, and one the directory (``store_path``)
served is kept too, up to ``host_bytes`` (least recently used dropped first), so that a pool miss
on it is a memory copy instead of a forward (or a file read and checksum). It works alone, without
a directory (``tier.Tier``): the device pool is then the hot set and this level the warm one. On
CUDA the payloads are pinned, so that the copy back into the pool's device blocks can be a DMA; on
CPU the pool is host memory already, and this level pays off where the pool is small or the
directory slow (a shared network filesystem). Payloads are graphchunk's own copies, made from the
pool's blocks or from checked files, so they are served without checks.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from graphchunk.metrics import CacheMetrics


class HostTier:
    def __init__(self, budget_bytes: int, metrics: CacheMetrics | None = None, pin: bool = False):
        self.budget = budget_bytes
        self.metrics = metrics or CacheMetrics()
        self.pin = pin
        self._entries: OrderedDict[bytes, tuple[tuple[int, ...], str, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def get(self, key: bytes, tokens: Sequence[int], mode: str, num_blocks: int) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is None or found[:2] != (tuple(tokens), mode) or found[2].shape[1] != num_blocks:
            return None
        self._entries.move_to_end(key)
        self.metrics.tier_host_hits += 1
        return found[2]

    def put(self, key: bytes, tokens: Sequence[int], mode: str, data: torch.Tensor) -> None:
        size = data.numel() * data.element_size()
        if size > self.budget:
            return
        self._remove(key)
        while self._bytes + size > self.budget:
            self._remove(next(iter(self._entries)))
            self.metrics.tier_host_drops += 1
        if self.pin and not data.is_pinned():
            data = data.pin_memory()
        self._entries[key] = (tuple(tokens), mode, data)
        self._bytes += size
        self.metrics.tier_host_bytes = self._bytes

    def _remove(self, key: bytes) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self._bytes -= found[2].numel() * found[2].element_size()
            self.metrics.tier_host_bytes = self._bytes
