"""graphchunk's counters on vLLM's /metrics, through vLLM's KV-connector metrics path.

vLLM asks each step for a connector's stats on both sides (``get_kv_connector_stats``: the
workers' through their model-runner output, summed over ranks with ``aggregate``; the
scheduler's after it processed the step's output), adds them to its scheduler stats, and sends
those to the API process, where ``build_prom_metrics``' object records them into vLLM's own
Prometheus registry with vLLM's labels (``model_name``, ``engine``), and its stats logger sums
them over each logging interval (``reduce``) for the "KV Transfer metrics" log line.

``GraphChunkStats.data`` is a ``metrics.StatsReport`` take: ``{"counters": {name: increment},
"gauges": {name: value}}``; a step where nothing changed sends nothing (None). Only
tensor-parallel rank 0's worker reports (every rank plans and counts the same steps), so sums
over ranks count each step once.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from graphchunk.metrics import EXPORTED, PROMETHEUS_PREFIX, SCHEMA, StatsReport

SUMMARY = ("lookups", "hits", "tier_hits", "misses", "tokens_reused", "tokens_computed", "evictions",
           "entries_failed", "fills_retried", "requests_failed", "pool_blocks_used", "pool_blocks_total")
"""The fields of the periodic log line (``reduce``), those that changed in the interval."""


class GraphChunkStats(KVConnectorStats):
    def _part(self, kind: str) -> dict[str, float]:
        return self.data.get(kind) or {}

    def aggregate(self, other: KVConnectorStats) -> "GraphChunkStats":
        """Counters' increments summed, gauges' latest values (``other`` is the later report)."""
        counters = dict(self._part("counters"))
        for name, increment in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + increment
        return GraphChunkStats({"counters": counters, "gauges": {**self._part("gauges"), **other.data.get("gauges", {})}})

    def reset(self) -> None:
        self.data = {}

    def reduce(self) -> dict[str, int | float]:
        values = {**self._part("counters"), **self._part("gauges")}
        return {name: values[name] for name in SUMMARY if name in values}

    def is_empty(self) -> bool:
        return not self._part("counters") and not self._part("gauges")


def take_stats(report: StatsReport | None) -> GraphChunkStats | None:
    """What changed since the last report, or None (nothing changed, or nothing reports here)."""
    data = report.take() if report is not None else None
    return GraphChunkStats(data) if data else None


class GraphChunkPromMetrics(KVConnectorPromMetrics):
    """One ``vllm:graphchunk_<field>`` series per exported field (``metrics.EXPORTED``) and engine,
    a counter or gauge as ``CacheMetrics`` declares it (gauges keep the most recent value across
    API processes, as vLLM's own)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.series: dict[str, dict[int, Any]] = {}
        for name in EXPORTED:
            kind, help_text = SCHEMA[name]
            if kind == "counter":
                metric = self._counter_cls(name=PROMETHEUS_PREFIX + name, documentation=help_text, labelnames=labelnames)
            else:
                metric = self._gauge_cls(name=PROMETHEUS_PREFIX + name, documentation=help_text, labelnames=labelnames,
                                         multiprocess_mode="mostrecent")
            self.series[name] = {engine: metric.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, increment in (transfer_stats_data.get("counters") or {}).items():
            self.series[name][engine_idx].inc(increment)
        for name, value in (transfer_stats_data.get("gauges") or {}).items():
            self.series[name][engine_idx].set(value)

