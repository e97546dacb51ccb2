"""The levels below the device chunk pool, as the workers' ``ContextRunner`` sees them.

A pool miss asks the tier before it is computed (``load``: the entry's payload, which the runner
writes into the entry's pool blocks), and every entry computed into the pool is written through
(``save``). Two levels, either or both: host memory (``host_tier.HostTier``, ``host_bytes``) and
the directory (``store.ChunkStore``, ``store_path``). A load asks host memory first, then the
directory, and keeps what the directory served in host memory; a save goes to both. With host
memory alone nothing leaves the process: no file, no disk identity (keys name the model's path).

With tensor parallelism a rank serves its payload only when every rank found its own
(``all_ranks``), since a miss is computed by a forward all ranks join.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.store import ChunkStore
from graphchunk.metrics import CacheMetrics


class Tier:
    def __init__(self, host: HostTier | None, store: ChunkStore | None, metrics: CacheMetrics,
                 all_ranks: Callable[[bool], bool] | None = None):
        """``all_ranks(found)``: whether every tensor-parallel rank found its payload (a collective)."""
        if host is None and store is None:
            raise ValueError("a tier needs host memory, a directory or both")
        self.host, self.store, self.metrics, self.all_ranks = host, store, metrics, all_ranks

    def load(self, key: bytes, tokens: Sequence[int], mode: str, num_blocks: int) -> torch.Tensor | None:
        """The entry's payload [layers, blocks, *block], or None (in no level, or not on every rank)."""
        data = self.host.get(key, tokens, mode, num_blocks) if self.host else None
        if data is None and self.store is not None:
            data = self.store.load(key, tokens, mode, num_blocks)
            if data is not None and self.host:
                self.host.put(key, tokens, mode, data)
        if self.all_ranks is not None and not self.all_ranks(data is not None):
            return None
        if data is not None:
            self.metrics.tier_loads += 1
        return data

    def save(self, key: bytes, tokens: Sequence[int], num_tokens: int, mode: str, data: torch.Tensor,
             context: str | None = None) -> None:
        """Writes an entry computed into the pool through to every level (a host copy of ``data``,
        pinned on CUDA; a file). ``context``: the directory's (``ChunkStore.save``)."""
        if self.host:
            self.host.put(key, tokens, mode, data)
        if self.store is not None:
            self.store.save(key, tokens, num_tokens, mode, data, context=context)
