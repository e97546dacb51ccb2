"""Counters of the chunk cache, exported by ``GraphChunkLLM.stats()`` and the server's /metrics."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class CacheMetrics:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    tokens_reused: int = 0
    tokens_computed: int = 0
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0
    lookup_seconds: float = 0.0

    @property
    def pool_utilization(self) -> float:
        return self.pool_blocks_used / self.pool_blocks_total if self.pool_blocks_total else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @contextmanager
    def timed_lookup(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.lookup_seconds += time.perf_counter() - start

    def snapshot(self) -> dict[str, float]:
        return {**asdict(self), "pool_utilization": self.pool_utilization, "hit_rate": self.hit_rate}
