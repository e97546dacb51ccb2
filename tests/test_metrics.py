"""The metrics schema (``CacheMetrics``' field declarations) and its export through vLLM's
KV-connector metrics path (and the pool's file), without an engine."""
from dataclasses import fields

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from graphchunk.metrics import (COUNTERS, DERIVED, EXPORTED, FIELDS, GAUGES, METRICS_FILE_ENV, POOL_FIELDS,
                                PROMETHEUS_PREFIX, SCHEMA, WORKER_FIELDS, CacheMetrics, MetricsPublisher, StatsReport,
                                engine_metrics_file, read_published)


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


def labelled(registry) -> dict:
    """``(Counter, Gauge, Histogram)`` classes registering into ``registry``, as vLLM's
    ``metric_types`` hands them to a connector's ``build_prom_metrics``."""
    from functools import partial

    from prometheus_client import Counter, Gauge, Histogram

    return {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}


def prom_metrics(registry, engines=(0,)):
    from types import SimpleNamespace

    from graphchunk.engine.connector import GraphChunkConnector

    return GraphChunkConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), labelled(registry),
                                                  ["model_name", "engine"],
                                                  {engine: ["m", str(engine)] for engine in engines})


def test_a_report_holds_what_changed_since_the_last():
    m = sample()
    report = StatsReport(m, POOL_FIELDS)
    first = report.take()
    assert first["gauges"] == {name: getattr(m, name) for name in POOL_FIELDS if name in GAUGES and name not in DERIVED}
    assert first["counters"] == {}  # none of the pool's counters moved
    assert report.take() is None
    m.evictions += 3
    m.pool_blocks_used = 6
    m.lookups += 1  # not one of the report's fields
    assert report.take() == {"counters": {"evictions": 3}, "gauges": {"pool_blocks_used": 6}}
    worker = StatsReport(m, WORKER_FIELDS)
    assert worker.take()["counters"] == {"lookups": 5, "hits": 3, "misses": 1, "lookup_seconds": 0.25}
    m.lookups += 2
    assert worker.take() == {"counters": {"lookups": 2}, "gauges": {}}


def test_a_counter_that_went_down_is_logged_and_never_reported_negative(caplog):
    """Prometheus refuses a negative increment, and in the API process that refusal stops vLLM's
    output handler (the server goes down): a decrease is logged and left out."""
    m = sample()
    report = StatsReport(m, WORKER_FIELDS)
    report.take()
    m.misses -= 1
    m.hits += 2
    with caplog.at_level("ERROR", logger="vllm.graphchunk"):
        assert report.take() == {"counters": {"hits": 2}, "gauges": {}}
    assert "counter misses went down" in caplog.text
    m.misses += 3
    assert report.take() == {"counters": {"misses": 3}, "gauges": {}}  # counted from the lower value


def test_reports_sum_over_steps_and_ranks_as_vllm_aggregates_them():
    from graphchunk.engine.connector import GraphChunkConnector
    from graphchunk.engine.connector_stats import GraphChunkStats

    a = GraphChunkStats({"counters": {"hits": 2, "lookups": 3}, "gauges": {"pool_blocks_used": 4}})
    b = GraphChunkStats({"counters": {"hits": 1, "evictions": 1}, "gauges": {"pool_blocks_used": 2}})
    both = a.aggregate(b)
    assert both.data == {"counters": {"hits": 3, "lookups": 3, "evictions": 1}, "gauges": {"pool_blocks_used": 2}}
    assert a.data["counters"] == {"hits": 2, "lookups": 3}  # aggregate makes a new object
    assert both.reduce() == {"lookups": 3, "hits": 3, "evictions": 1, "pool_blocks_used": 2}
    # What the API process's logger rebuilds from the payload vLLM sent (to_dict, msgpack-safe).
    rebuilt = GraphChunkConnector.build_kv_connector_stats(both.to_dict())
    assert rebuilt.data == both.data and not rebuilt.is_empty()
    assert GraphChunkConnector.build_kv_connector_stats(None).is_empty()
    both.reset()
    assert both.is_empty()


def test_prometheus_series_are_vllms_kind_names_and_labels():
    registry = CollectorRegistry()
    prom = prom_metrics(registry)
    prom.observe({"counters": {"lookups": 4, "lookup_seconds": 0.25}, "gauges": {"pool_blocks_used": 5}}, 0)
    prom.observe({"counters": {"lookups": 1}, "gauges": {}}, 0)
    families = {f.name: f for f in registry.collect()}
    assert families.keys() == {PROMETHEUS_PREFIX + name for name in EXPORTED}
    assert not {"hit_rate", "pool_utilization"} & set(EXPORTED)  # ratios: PromQL's
    for name in EXPORTED:
        kind, help_text = SCHEMA[name]
        assert (families[PROMETHEUS_PREFIX + name].type, families[PROMETHEUS_PREFIX + name].documentation) == (
            kind, help_text)
    text = generate_latest(registry).decode()
    assert 'vllm:graphchunk_lookups_total{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:graphchunk_lookup_seconds_total{engine="0",model_name="m"} 0.25' in text
    assert 'vllm:graphchunk_pool_blocks_used{engine="0",model_name="m"} 5.0' in text


def test_each_data_parallel_engine_has_its_own_series():
    """vLLM hands each engine core's stats with its index; each is recorded under its own labels."""
    registry = CollectorRegistry()
    prom = prom_metrics(registry, engines=(0, 1, 10))
    for engine, lookups in ((0, 4), (1, 7), (10, 2)):
        prom.observe({"counters": {"lookups": lookups}}, engine)
    [family] = [f for f in registry.collect() if f.name == "vllm:graphchunk_lookups"]
    assert [(s.labels["engine"], s.value) for s in family.samples if s.name.endswith("_total")] == [
        ("0", 4.0), ("1", 7.0), ("10", 2.0)]


def test_each_engine_publishes_its_pool_to_a_file_of_its_own(tmp_path, monkeypatch):
    """Data-parallel engine cores publish to files of their own (engine_metrics_file, by their
    data-parallel index): what the API process reads the pool's size from."""
    base = str(tmp_path / "metrics.bin")
    monkeypatch.setenv(METRICS_FILE_ENV, base)
    assert engine_metrics_file(0) == base and engine_metrics_file(1) != base
    for engine, blocks in ((0, 4), (1, 7)):
        MetricsPublisher(engine_metrics_file(engine), POOL_FIELDS).publish(CacheMetrics(pool_blocks_total=blocks))
    assert [read_published(engine_metrics_file(e))["pool_blocks_total"] for e in (0, 1)] == [4, 7]


def test_the_dashboard_queries_only_exported_series_by_their_kind():
    """deploy/grafana/graphchunk-dashboard.json (the live check that every series exists is in test_server):
    graphchunk's counters are read through rate() under their _total name, its gauges as they are."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "graphchunk-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    names = {m for expr in exprs for m in re.findall(rf"{re.escape(PROMETHEUS_PREFIX)}\w+", expr)}
    wanted = {PROMETHEUS_PREFIX + n + ("_total" if SCHEMA[n][0] == "counter" else "") for n in EXPORTED}
    assert names and names <= wanted, sorted(names - wanted)
    counters = {PROMETHEUS_PREFIX + n + "_total" for n in EXPORTED if SCHEMA[n][0] == "counter"}
    for expr in exprs:  # a counter is only ever rated
        for counter in set(re.findall(rf"{re.escape(PROMETHEUS_PREFIX)}\w+", expr)) & counters:
            assert re.search(rf"rate\({re.escape(counter)}\{{", expr), (counter, expr)
