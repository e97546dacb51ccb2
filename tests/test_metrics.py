"""The metrics schema (``CacheMetrics``' field declarations) and its cross-process export, without an engine."""
from dataclasses import fields

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from graphchunk.metrics import (COUNTERS, DERIVED, FIELDS, GAUGES, METRICS_FILE_ENV, SCHEMA, CacheMetrics,
                                MetricsPublisher, PrometheusCollector, engine_metrics_file, read_published)


def sample() -> CacheMetrics:
    return CacheMetrics(lookups=4, hits=3, misses=1, pool_blocks_used=5, pool_blocks_total=20, lookup_seconds=0.25,
                        tier_bytes=1 << 20)


def test_the_schema_is_the_dataclass():
    names = [f.name for f in fields(CacheMetrics)] + list(DERIVED)
    assert list(SCHEMA) == names
    assert set(FIELDS) == set(names) == set(sample().snapshot()) and len(FIELDS) == len(names)
    assert set(COUNTERS).isdisjoint(GAUGES)
    assert {"pool_utilization", "hit_rate", "pool_blocks_used", "tier_bytes", "pool_refs_held"} <= set(GAUGES)
    assert {"lookups", "hits", "misses", "lookup_seconds", "tier_bytes_written"} <= set(COUNTERS)
    assert all(help_text for _, help_text in SCHEMA.values())


def test_derived_gauges_are_read_only_and_in_the_snapshot():
    m = sample()
    assert m.snapshot()["hit_rate"] == 0.75 and m.snapshot()["pool_utilization"] == 0.25
    assert CacheMetrics().hit_rate == 0.0 and CacheMetrics().pool_utilization == 0.0
    with pytest.raises(AttributeError):
        m.hit_rate = 1.0


def test_published_snapshot_reads_back(tmp_path):
    path = str(tmp_path / "metrics.bin")
    assert read_published(path) is None
    m = sample()
    MetricsPublisher(path).publish(m)
    assert read_published(path) == pytest.approx(m.snapshot())
    (tmp_path / "short.bin").write_bytes(b"\0" * 8)
    assert read_published(str(tmp_path / "short.bin")) is None


def test_collector_exports_every_metric_with_its_kind_and_help(tmp_path, monkeypatch):
    path = str(tmp_path / "metrics.bin")
    monkeypatch.setenv(METRICS_FILE_ENV, path)
    registry = CollectorRegistry()
    registry.register(PrometheusCollector())
    assert list(registry.collect()) == []  # nothing published yet
    m = sample()
    MetricsPublisher(path).publish(m)
    families = {f.name: f for f in registry.collect()}
    assert families.keys() == {f"graphchunk_{name}" for name in FIELDS}
    for name, (kind, help_text) in SCHEMA.items():
        family = families[f"graphchunk_{name}"]
        assert (family.type, family.documentation) == (kind, help_text)
    text = generate_latest(registry).decode()
    assert 'graphchunk_lookups_total{engine="0"} 4.0' in text and 'graphchunk_lookup_seconds_total{engine="0"} 0.25' in text
    assert "# TYPE graphchunk_pool_blocks_used gauge" in text and 'graphchunk_hit_rate{engine="0"} 0.75' in text


def test_each_data_parallel_engine_publishes_its_own_series(tmp_path, monkeypatch):
    """Data-parallel engine cores publish to files of their own (engine_metrics_file, by their
    data-parallel index); /metrics has one series per engine, labelled as vLLM labels its own."""
    base = str(tmp_path / "metrics.bin")
    monkeypatch.setenv(METRICS_FILE_ENV, base)
    assert engine_metrics_file(0) == base and engine_metrics_file(1) != base
    registry = CollectorRegistry()
    registry.register(PrometheusCollector())
    for engine, lookups in ((0, 4), (1, 7), (10, 2)):
        m = CacheMetrics()
        m.lookups = lookups
        MetricsPublisher(engine_metrics_file(engine)).publish(m)
    [family] = [f for f in registry.collect() if f.name == "graphchunk_lookups"]
    assert [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ({"engine": "0"}, 4.0), ({"engine": "1"}, 7.0), ({"engine": "10"}, 2.0)]
