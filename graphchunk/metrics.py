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
    graph_captures: int = 0
    graph_replays: int = 0
    graph_padded: int = 0
    graph_eager: int = 0
    blend_lookups: int = 0
    blend_hits: int = 0
    blend_misses: int = 0
    blend_tokens_reused: int = 0
    blend_tokens_recomputed: int = 0
    blend_tokens_checked: int = 0
    blend_tier_hits: int = 0
    tier_hits: int = 0
    tier_loads: int = 0
    tier_rejected: int = 0
    tier_writes: int = 0
    tier_write_errors: int = 0
    tier_evictions: int = 0
    tier_bytes_read: int = 0
    tier_bytes_written: int = 0
    tier_read_seconds: float = 0.0
    tier_write_seconds: float = 0.0
    tier_bytes: int = 0
    tier_host_hits: int = 0
    tier_host_bytes: int = 0
    pool_refs_held: int = 0
    pool_blocks_leaked: int = 0

    @property
    def pool_utilization(self) -> float:
        return self.pool_blocks_used / self.pool_blocks_total if self.pool_blocks_total else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def count(self, name: str, n: int, mode: str) -> None:
        """Adds ``n`` to counter ``name`` (all modes) and, for blend requests, to ``blend_<name>``."""
        setattr(self, name, getattr(self, name) + n)
        if mode == "blend":
            setattr(self, f"blend_{name}", getattr(self, f"blend_{name}") + n)

    @contextmanager
    def timed_lookup(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.lookup_seconds += time.perf_counter() - start

    def snapshot(self) -> dict[str, float]:
        return {**asdict(self), "pool_utilization": self.pool_utilization, "hit_rate": self.hit_rate}


# --- across processes -------------------------------------------------------------------------
# The worker runs in a process of its own (spawned by vLLM's engine core); the process serving
# /metrics or calling GraphChunkLLM.stats() reads what the worker publishes into a small shared
# file of float64s named by GRAPHCHUNK_METRICS_FILE, which child processes inherit.

METRICS_FILE_ENV = "GRAPHCHUNK_METRICS_FILE"
COUNTERS = ("lookups", "hits", "misses", "evictions", "tokens_reused", "tokens_computed", "lookup_seconds",
            "graph_captures", "graph_replays", "graph_padded", "graph_eager",
            "blend_lookups", "blend_hits", "blend_misses", "blend_tokens_reused", "blend_tokens_recomputed",
            "blend_tokens_checked", "blend_tier_hits",
            "tier_hits", "tier_loads", "tier_rejected", "tier_writes", "tier_write_errors", "tier_evictions",
            "tier_bytes_read", "tier_bytes_written", "tier_read_seconds", "tier_write_seconds", "tier_host_hits")
GAUGES = ("pool_blocks_used", "pool_blocks_total", "pool_utilization", "hit_rate", "tier_bytes", "tier_host_bytes",
          "pool_refs_held", "pool_blocks_leaked")
FIELDS = COUNTERS + GAUGES
HELP = {
    "lookups": "Chunk-pool lookups", "hits": "Chunk-pool lookups that found the KV",
    "misses": "Chunk-pool lookups that had to compute the KV (neither in the pool nor in the tier)",
    "evictions": "Pool entries evicted",
    "tokens_reused": "Context tokens whose KV was copied from the pool instead of computed",
    "tokens_computed": "Prompt tokens computed (chunk misses and questions)",
    "lookup_seconds": "Time spent in pool lookups", "pool_blocks_used": "Pool blocks holding KV",
    "pool_blocks_total": "Pool blocks in the budget", "pool_utilization": "Used fraction of the pool",
    "hit_rate": "hits / lookups",
    "graph_captures": "Graph templates captured (one per bucket)",
    "graph_replays": "Cached-chunk prefill steps that ran a captured graph at exactly their token count",
    "graph_padded": "Cached-chunk prefill steps that ran a captured graph padded to more tokens",
    "graph_eager": "Cached-chunk prefill steps that ran without a captured graph (no bucket, mixed step, replay miss)",
    "blend_lookups": "Chunk-pool lookups of blend-mode requests (isolated: lookups - blend_lookups)",
    "blend_hits": "Chunk-pool hits of blend-mode requests", "blend_misses": "Chunk-pool misses of blend-mode requests",
    "blend_tokens_reused": "Context tokens of blend-mode requests whose KV was copied from the pool",
    "blend_tokens_recomputed": "Reused chunk tokens of blend-mode requests recomputed through every layer",
    "blend_tokens_checked": "Chunk tokens run through CacheBlend's check layers to rank them",
    "blend_tier_hits": "Tier hits of blend-mode requests",
    "tier_hits": "Chunk-pool lookups missing the pool and served from the persistent tier",
    "tier_loads": "Entries (sys prompts and chunks) loaded from the persistent tier",
    "tier_rejected": "Tier files not served: truncated, corrupt, unreadable or another engine's",
    "tier_writes": "Entries written to the persistent tier", "tier_write_errors": "Tier writes that failed",
    "tier_evictions": "Tier files removed by the tier's budget", "tier_bytes_read": "Bytes loaded from the tier",
    "tier_bytes_written": "Bytes written to the tier", "tier_read_seconds": "Time spent loading tier files",
    "tier_write_seconds": "Time spent writing tier files",
    "tier_bytes": "Bytes of tier files in the store directory (as of this server's last count)",
    "tier_host_hits": "Tier loads served from the host-memory tier (no file read)",
    "tier_host_bytes": "Bytes of payloads in the host-memory tier",
    "pool_refs_held": "References held on pool entries (0 between steps)",
    "pool_blocks_leaked": "Pool blocks used but owned by no indexed entry (0 between steps)",
}


def new_metrics_file() -> str:
    """A fresh file name for one engine's metrics, exported to child processes."""
    import os
    import tempfile
    import uuid

    path = os.path.join(tempfile.gettempdir(), f"graphchunk-metrics-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin")
    os.environ[METRICS_FILE_ENV] = path
    return path


class MetricsPublisher:
    """Worker side: mirrors a CacheMetrics snapshot into the shared file."""

    def __init__(self, path: str):
        import numpy as np

        self.values = np.memmap(path, dtype=np.float64, mode="w+", shape=(len(FIELDS),))

    def publish(self, metrics: CacheMetrics) -> None:
        snapshot = metrics.snapshot()
        self.values[:] = [snapshot[name] for name in FIELDS]


def read_published(path: str | None = None) -> dict[str, float] | None:
    """The last published snapshot, or None before the worker published one."""
    import os

    import numpy as np

    path = path or os.environ.get(METRICS_FILE_ENV)
    if not path or not os.path.exists(path) or os.path.getsize(path) != 8 * len(FIELDS):
        return None
    return dict(zip(FIELDS, np.fromfile(path, dtype=np.float64).tolist()))


class PrometheusCollector:
    """Exports the published snapshot as ``graphchunk_*`` metrics on vLLM's /metrics."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = read_published()
        if values is None:
            return
        for name in COUNTERS:
            yield CounterMetricFamily(f"graphchunk_{name}", HELP[name], value=values[name])
        for name in GAUGES:
            yield GaugeMetricFamily(f"graphchunk_{name}", HELP[name], value=values[name])
