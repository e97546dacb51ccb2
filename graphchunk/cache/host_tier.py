"""The host-memory level below the device pool, in each worker: entries' KV payloads in process memory.

What it holds is decided where vLLM schedules (``host_index.HostIndex``): a job the scheduler
reserved room for saves its entry here once it has run (``put``, under the pool entry's epoch),
and the scheduler's drops free payloads (``drop``). A payload is the tokens an entry's copies read,
every layer's K and V ([layers, 2, tokens, heads, head_size], ``KVDevice.read_slots``), so a pool
miss it holds is copied straight into the request's slots (``context_run.py``): pinned on CUDA, so
that the copy is a DMA. Payloads are graphchunk's own copies of the pool's blocks, served without
checks but for their presence: one missing (a save that failed) fails the copies planned from it,
and the request is planned again.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from graphchunk.log import logger
from graphchunk.metrics import CacheMetrics


class HostTier:
    def __init__(self, budget_bytes: int, metrics: CacheMetrics | None = None, pin: bool = False,
                 all_ranks: Callable[[bool], bool] | None = None):
        """``all_ranks(found)``: whether every tensor-parallel rank found its payload (a collective:
        a sys prompt loaded from here, else computed by a forward all ranks join)."""
        self.budget, self.pin, self.all_ranks = budget_bytes, pin, all_ranks
        self.metrics = metrics or CacheMetrics()
        self._payloads: dict[int, torch.Tensor] = {}
        self._bytes = 0

    def get(self, epoch: int) -> torch.Tensor | None:
        return self._payloads.get(epoch)

    def get_on_all_ranks(self, epoch: int) -> torch.Tensor | None:
        """The payload, or None unless every tensor-parallel rank holds its own."""
        data = self._payloads.get(epoch)
        if self.all_ranks is not None and not self.all_ranks(data is not None):
            return None
        return data

    def put(self, epoch: int, data: torch.Tensor) -> bool:
        """Keeps ``data`` under ``epoch``; False (not kept, logged) past the budget, which the
        scheduler's index keeps to: only a disagreement between the two gets there."""
        size = data.numel() * data.element_size()
        if self._bytes + size > self.budget:
            logger.error("graphchunk: host memory holds %d of %d bytes and cannot take entry %d's %d; it is not kept",
                         self._bytes, self.budget, epoch, size)
            return False
        if self.pin and not data.is_pinned():
            data = data.pin_memory()
        self._payloads[epoch] = data
        self._bytes += size
        self.metrics.tier_host_bytes = self._bytes
        return True

    def drop(self, epochs: Iterable[int]) -> None:
        for epoch in epochs:
            data = self._payloads.pop(epoch, None)
            if data is not None:
                self._bytes -= data.numel() * data.element_size()
                self.metrics.tier_host_drops += 1
        self.metrics.tier_host_bytes = self._bytes
