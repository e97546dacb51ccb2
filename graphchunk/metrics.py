"""Counters of the chunk cache, exported on vLLM's /metrics and by ``GraphChunkLLM.stats()``.

``CacheMetrics`` is the schema: each field is declared with ``_counter`` or ``_gauge``, which
give it its Prometheus kind and help text, and each gauge computed from fields is a
``_derived_gauge`` property (``stats()`` only: Prometheus users compute ratios in PromQL);
``SCHEMA`` (and the report and publisher below, which use it) are derived from the class.

Two ways out of the engine's processes, both fed from the same fields:

- **vLLM's KV-connector metrics path** (/metrics). ``StatsReport.take()`` turns the fields into
  what changed since the last take (counters' increments, gauges' new values); the connector
  returns it from ``get_kv_connector_stats`` (``engine/connector_stats.py``): the workers' fields
  from tensor-parallel rank 0 only (every rank counts the same steps), the pool's from the
  scheduler, which vLLM adds to its own scheduler stats and sends to the API process; there
  ``build_prom_metrics`` records them as ``vllm:graphchunk_*`` series labelled ``model_name`` and
  ``engine`` like vLLM's own, in vLLM's registry (so they survive ``--api-server-count`` above 1
  and follow ``--disable-log-stats``).
- **A small shared file of float64s** (``FIELDS`` order) named by GRAPHCHUNK_METRICS_FILE, which
  child processes inherit: ``GraphChunkLLM`` reads the pool's fields from it (its engine keeps no
  stats loggers), and the API process the pool's size (``plugin.published_pool``, before a
  request is queued). One file per engine, overwritten by whole snapshots.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

from graphchunk.log import logger


def _counter(help_text: str, default: float = 0):
    """A field that only grows over the worker's life: a Prometheus counter."""
    return field(default=default, metadata={"kind": "counter", "help": help_text})


def _gauge(help_text: str, default: float = 0):
    """A field set to the current state (it may go down): a Prometheus gauge."""
    return field(default=default, metadata={"kind": "gauge", "help": help_text})


class _DerivedGauge(property):
    """A read-only property computed from fields, exported as a gauge."""

    def __init__(self, fget, help_text: str):
        super().__init__(fget)
        self.help = help_text


def _derived_gauge(help_text: str):
    return lambda fget: _DerivedGauge(fget, help_text)


@dataclass
class CacheMetrics:
    lookups: int = _counter("Chunk-pool lookups")
    hits: int = _counter("Chunk-pool lookups that found the KV")
    misses: int = _counter("Chunk-pool lookups that had to compute the KV (neither in the pool nor in the tier)")
    evictions: int = _counter("Pool entries evicted")
    tokens_reused: int = _counter("Context tokens whose KV was copied from the pool instead of computed")
    tokens_computed: int = _counter("Prompt tokens computed (chunk misses and questions)")
    pool_blocks_used: int = _gauge("Pool blocks holding KV")
    pool_blocks_total: int = _gauge("Pool blocks in the budget")
    lookup_seconds: float = _counter("Time spent in pool lookups", 0.0)
    graph_replays: int = _counter("Cached-chunk prefill steps that ran a captured graph at exactly their token count")
    graph_padded: int = _counter("Cached-chunk prefill steps that ran a captured graph padded to more tokens")
    graph_eager: int = _counter("Cached-chunk prefill steps that vLLM ran without a graph "
                                "(e.g. more tokens than its capture sizes)")
    blend_lookups: int = _counter("Chunk-pool lookups of blend-mode requests (isolated: lookups - blend_lookups)")
    blend_hits: int = _counter("Chunk-pool hits of blend-mode requests")
    blend_misses: int = _counter("Chunk-pool misses of blend-mode requests")
    blend_tokens_reused: int = _counter("Context tokens of blend-mode requests whose KV was copied from the pool")
    blend_tokens_recomputed: int = _counter("Reused chunk tokens of blend-mode requests recomputed through every layer")
    blend_tokens_checked: int = _counter("Chunk tokens run through CacheBlend's check layers to rank them")
    blend_tokens_scored: int = _counter("Question tokens run through every layer to rank chunk tokens by the "
                                       "question's attention (recompute policy 'question')")
    blend_question_fallbacks: int = _counter("Steps of 'question'-policy requests ranked by CacheBlend's deviation: "
                                             "the step filled context without the whole question")
    blend_tier_hits: int = _counter("Tier hits of blend-mode requests")
    tier_hits: int = _counter("Chunk-pool lookups missing the pool and served from the tier (host memory or directory)")
    tier_loads: int = _counter("Entries (sys prompts and chunks) loaded from the tier (host memory or directory)")
    tier_rejected: int = _counter("Tier files not served: truncated, corrupt, unreadable or another engine's")
    tier_writes: int = _counter("Entries written to the persistent tier")
    tier_write_errors: int = _counter("Tier writes that failed")
    tier_evictions: int = _counter("Tier files removed by the tier's budget")
    tier_bytes_read: int = _counter("Bytes loaded from the tier")
    tier_bytes_written: int = _counter("Bytes written to the tier")
    tier_read_seconds: float = _counter("Time spent loading tier files", 0.0)
    tier_write_seconds: float = _counter("Time spent writing tier files", 0.0)
    tier_bytes: int = _gauge("Bytes of tier files in the store directory (as of this server's last count)")
    tier_host_hits: int = _counter("Tier loads served from host memory (chunks copied into the request, "
                                   "sys prompts into the pool)")
    tier_host_bytes: int = _gauge("Bytes of payloads in the host-memory tier")
    tier_host_drops: int = _counter("Entries host memory dropped (for room, least recently used first; "
                                    "or found missing)")
    documents_unchunked: int = _counter("Documents requests graphchunk could not chunk that ran as ordinary "
                                        "prompts (documents_fallback='ordinary')")
    pool_refs_held: int = _gauge("References held on pool entries by requests waiting for their misses and by "
                                 "miss jobs not yet run (0 when idle)")
    blend_requests_pending: int = _gauge("Blend-mode requests planned but not yet scheduled: waiting for their chunk "
                                         "misses to be computed or for a step's recompute budget")
    blend_full_prefills: int = _counter("Blend-mode requests run as vLLM's full prefill because their chunk misses and "
                                        "recompute would cost at least as much (blend_misses='prefill'), or because "
                                        "their context can never fit the chunk pool")
    blend_entries_captured: int = _counter("Blend pool entries filled from the full prefill that first carried their chunk "
                                           "(blend_entries='context') instead of computed alone")
    blend_recompute_deferrals: int = _counter("Times an all-hit blend-mode request was put off to a later step "
                                              "because the step's recompute budget was spent")
    loads_dropped: int = _counter("Asynchronous context loads dropped because their request left (cancelled or failed) "
                                  "while it waited for its misses; reported to vLLM, which then frees the request")
    entries_failed: int = _counter("Pool entries dropped from the index because a worker found them not holding what "
                                   "was planned (a job read the wrong input, or a copy failed its check): the requests "
                                   "copying them are planned again; the next plan computes them again")
    fills_retried: int = _counter("Times a request whose context read KV that failed its check went back to vLLM's "
                                  "queue to be planned again")
    requests_failed: int = _counter("Requests graphchunk failed: their context can never fit the chunk pool, or "
                                    "failed its check more times than graphchunk retries it")
    pool_blocks_leaked: int = _gauge("Pool blocks used but owned by no indexed entry (0 unless something leaked)")

    @_derived_gauge("Used fraction of the pool")
    def pool_utilization(self) -> float:
        return self.pool_blocks_used / self.pool_blocks_total if self.pool_blocks_total else 0.0

    @_derived_gauge("hits / lookups")
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
        return {**asdict(self), **{name: getattr(self, name) for name in DERIVED}}


DERIVED = tuple(name for name, attr in vars(CacheMetrics).items() if isinstance(attr, _DerivedGauge))
"""The gauges computed from fields (``_derived_gauge`` properties), in ``snapshot()``."""


def _schema() -> dict[str, tuple[str, str]]:
    schema = {}
    for f in fields(CacheMetrics):
        if "kind" not in f.metadata:
            raise TypeError(f"CacheMetrics.{f.name}: declare it with _counter() or _gauge()")
        schema[f.name] = (f.metadata["kind"], f.metadata["help"])
    return {**schema, **{name: ("gauge", getattr(CacheMetrics, name).help) for name in DERIVED}}


SCHEMA = _schema()
"""Every exported metric, as ``CacheMetrics`` declares it: name -> (kind, help text)."""
COUNTERS = tuple(name for name, (kind, _) in SCHEMA.items() if kind == "counter")
GAUGES = tuple(name for name, (kind, _) in SCHEMA.items() if kind == "gauge")
FIELDS = COUNTERS + GAUGES
"""Order of the values in the shared metrics file."""
POOL_FIELDS = ("evictions", "entries_failed", "fills_retried", "requests_failed", "pool_blocks_used",
               "pool_blocks_total", "pool_refs_held", "pool_blocks_leaked", "pool_utilization", "blend_requests_pending",
               "blend_recompute_deferrals", "blend_full_prefills")
"""The pool's own metrics and the admission of blend requests: kept where vLLM schedules (the one
pool index, ``engine/context_scheduler``) and published from there; every other field is the worker's."""
WORKER_FIELDS = tuple(name for name in FIELDS if name not in POOL_FIELDS)
PROMETHEUS_PREFIX = "vllm:graphchunk_"
"""Each exported field's name on /metrics, after vLLM's own (``vllm:graphchunk_hits_total``)."""
EXPORTED = tuple(name for name in FIELDS if name not in DERIVED)
"""The fields exported on /metrics: every one but the ratios."""


class StatsReport:
    """What changed in ``fields`` of ``metrics`` since the last ``take()``: counters'
    increments and gauges' new values (every gauge on the first take). Costs the fields' count."""

    def __init__(self, metrics: CacheMetrics, fields: tuple[str, ...]):
        self.metrics = metrics
        self.counters = tuple(name for name in fields if name in COUNTERS)
        self.gauges = tuple(name for name in fields if name in GAUGES and name not in DERIVED)
        self.last: dict[str, float | None] = {**dict.fromkeys(self.counters, 0), **dict.fromkeys(self.gauges)}

    def take(self) -> dict[str, dict[str, float]] | None:
        """``{"counters": {name: increment}, "gauges": {name: value}}`` of the fields that
        changed, or None when none did. A counter that went down (a bug: Prometheus refuses a
        negative increment, which would stop vLLM's output handler) is logged, not reported."""
        counters, gauges = {}, {}
        for names, changed, increment in ((self.counters, counters, True), (self.gauges, gauges, False)):
            for name in names:
                value, last = getattr(self.metrics, name), self.last[name]
                if value == last:
                    continue
                self.last[name] = value
                if not increment:
                    changed[name] = value
                elif value > last:
                    changed[name] = value - last
                else:
                    logger.error("graphchunk: counter %s went down (%s -> %s); the decrease is not reported", name,
                                 last, value)
        return {"counters": counters, "gauges": gauges} if counters or gauges else None


# --- across processes (see the module docstring) -------------------------------------------

METRICS_FILE_ENV = "GRAPHCHUNK_METRICS_FILE"


def new_metrics_file() -> str:
    """A fresh file name for one engine's metrics, exported to child processes."""
    import os
    import tempfile
    import uuid

    path = os.path.join(tempfile.gettempdir(), f"graphchunk-metrics-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin")
    os.environ[METRICS_FILE_ENV] = path
    return path


class MetricsPublisher:
    """Mirrors ``fields`` of a CacheMetrics snapshot into the shared file: the worker its own
    (``WORKER_FIELDS``), the scheduler's connector the pool's (``POOL_FIELDS``), each at its place."""

    def __init__(self, path: str, fields: tuple[str, ...] = FIELDS):
        import os

        import numpy as np

        exists = os.path.exists(path) and os.path.getsize(path) == 8 * len(FIELDS)
        self.values = np.memmap(path, dtype=np.float64, mode="r+" if exists else "w+", shape=(len(FIELDS),))
        self.fields = fields
        self.index = [FIELDS.index(name) for name in fields]

    def publish(self, metrics: CacheMetrics) -> None:
        """Writes the fields' current values: costs their count (no snapshot of the rest)."""
        self.values[self.index] = [getattr(metrics, name) for name in self.fields]


def engine_metrics_file(engine: int) -> str | None:
    """The file engine core ``engine`` (its data-parallel index, 0 without data parallelism)
    publishes to: the name its main process exported, suffixed for engines past the first."""
    import os

    base = os.environ.get(METRICS_FILE_ENV)
    return None if not base else base if engine == 0 else f"{base}.dp{engine}"


def read_published(path: str | None = None) -> dict[str, float] | None:
    """The last published snapshot, or None before the worker published one."""
    import os

    import numpy as np

    path = path or os.environ.get(METRICS_FILE_ENV)
    if not path or not os.path.exists(path) or os.path.getsize(path) != 8 * len(FIELDS):
        return None
    return dict(zip(FIELDS, np.fromfile(path, dtype=np.float64).tolist()))
