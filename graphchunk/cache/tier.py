"""The directory below the device chunk pool (``store.ChunkStore``, ``store_path``), as the workers'
``ContextRunner`` sees it.

A pool miss asks it before it is computed (``load``: the entry's payload, which the runner writes
into the entry's pool blocks), and every entry computed into the pool is written through (``save``).
Host memory (``host_bytes``) is a level of its own, decided where vLLM schedules
(``host_index.py``, ``host_tier.py``): an entry loaded from here is kept there like one computed.

With tensor parallelism a rank serves its payload only when every rank found its own
(``all_ranks``), since a miss is computed by a forward all ranks join.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from graphchunk.cache.store import ChunkStore
from graphchunk.metrics import CacheMetrics


class Tier:
    def __init__(self, store: ChunkStore, metrics: CacheMetrics, all_ranks: Callable[[bool], bool] | None = None):
        """``all_ranks(found)``: whether every tensor-parallel rank found its payload (a collective)."""
        self.store, self.metrics, self.all_ranks = store, metrics, all_ranks

    def load(self, key: bytes, tokens: Sequence[int], mode: str, num_blocks: int) -> torch.Tensor | None:
        """The entry's payload [layers, blocks, *block], or None (no file, or not on every rank)."""
        data = self.store.load(key, tokens, mode, num_blocks)
        if self.all_ranks is not None and not self.all_ranks(data is not None):
            return None
        if data is not None:
            self.metrics.tier_loads += 1
        return data

    def save(self, key: bytes, tokens: Sequence[int], num_tokens: int, mode: str, data: torch.Tensor,
             context: str | None = None) -> None:
        """Writes an entry computed into the pool through to the directory. ``context``: the
        directory's (``ChunkStore.save``)."""
        self.store.save(key, tokens, num_tokens, mode, data, context=context)
