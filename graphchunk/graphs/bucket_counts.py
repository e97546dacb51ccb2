"""How each cached-chunk prefill ran on vLLM's graphs, counted per bucket of the grid.

Contract. graphchunk captures and replays nothing: vLLM's own graphs run every step (on CUDA and
Ascend the grid's token counts join vLLM's capture sizes, ``engine/graph_config.py``; on CPU vLLM's
one compiled dynamic-shape graph serves every size). Per step with a cached-chunk prefill in it,
the runner asks ``choose`` for the smallest bucket holding it (None when no bucket does, or when
the step also computes other work) and ``count``s once what vLLM ran: ``replayed`` (a graph at
exactly its token count, metric ``graph_replays``), ``padded`` (a graph padded to more tokens,
``graph_padded``) or ``eager`` (no graph, ``graph_eager``). ``manifest`` reports the counts per
bucket and, under ``outside_buckets``, for steps no bucket holds, next to what vLLM's graph
machinery ran with.

graphchunk's own static-shape templates were removed: on CPU they ran slower than vLLM's own
compiled graph (p50 0.440 s vs 0.423 s, 1.04x; padded 1.11x; ``perf/results/templates.json``),
and inside vLLM on CUDA/Ascend vLLM's graphs already replay the buckets.
"""
from __future__ import annotations

from graphchunk.graphs.buckets import Bucket, BucketGrid, RequestShape
from graphchunk.metrics import CacheMetrics

COUNTERS = {"replayed": "graph_replays", "padded": "graph_padded", "eager": "graph_eager"}
"""Each outcome of a step with a cached-chunk prefill, and the metric counting it."""
OUTCOMES = tuple(COUNTERS)


class BucketCounts:
    def __init__(self, grid: BucketGrid, metrics: CacheMetrics):
        self.grid = grid
        self.metrics = metrics
        self.outcomes: dict[str, dict[str, int]] = {}
        """Per bucket name ('' for steps no bucket holds): counts of each outcome."""

    def choose(self, requests: list[RequestShape] | None) -> Bucket | None:
        """The bucket holding a step with a cached-chunk prefill, or None. ``requests`` is None when
        the step also computes other work (context tokens, other requests)."""
        return self.grid.bucket_for(requests) if requests else None

    def count(self, outcome: str, bucket: Bucket | None) -> None:
        """Counts one step with a cached-chunk prefill (``OUTCOMES``)."""
        counter = COUNTERS[outcome]
        setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)
        row = self.outcomes.setdefault(bucket.name if bucket else "", dict.fromkeys(OUTCOMES, 0))
        row[outcome] += 1

    def manifest(self, vllm_graphs: dict | None) -> dict:
        """The grid, what vLLM's graph machinery ran with (``vllm_graphs``) and how steps ran."""
        zero = dict.fromkeys(OUTCOMES, 0)
        return {"grid": self.grid.source, "backend": self.grid.backend, "vllm_graphs": vllm_graphs,
                "buckets": [{"bucket": b.name, **self.outcomes.get(b.name, zero)} for b in self.grid.buckets],
                "outside_buckets": self.outcomes.get("", zero)}
