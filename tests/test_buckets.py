"""Bucket grids, bucket choice and the per-bucket counts, without an engine."""
from types import SimpleNamespace

import pytest

from graphchunk.config import ConfigError
from graphchunk.engine.worker import check_grid
from graphchunk.graphs.bucket_counts import OUTCOMES, BucketCounts
from graphchunk.graphs.buckets import AXES, Bucket, RequestShape, load_grid, parse_grid
from graphchunk.metrics import CacheMetrics

GRID = {"backend": "vllm", "grid": {"batch": [1, 2], "num_chunks": [2, 8], "max_chunk_len": [128, 384],
                                    "max_sys_len": [96], "question_tokens": [16, 32]}}


def shape(chunks, question, sys=10):
    return RequestShape(sys, tuple(chunks), question)


@pytest.mark.parametrize("name, backend, count", [("cpu", "vllm", 24), ("h100", "vllm", 144),
                                                  ("ascend-910b", "vllm", 24)])
def test_shipped_grids(name, backend, count):
    grid = load_grid(name)
    assert (grid.backend, len(grid.buckets), len(set(grid.buckets))) == (backend, count, count)


def test_grid_by_path_equals_grid_by_name():
    assert load_grid(str(load_grid("cpu").source)).buckets == load_grid("cpu").buckets


@pytest.mark.parametrize("edit, message", [
    (lambda g: g.update(backend="tensorrt"), "backend 'tensorrt' is not supported"),
    (lambda g: g.update(extra=1), "unknown key(s) ['extra']"),
    (lambda g: g["grid"].pop("batch"), "must list exactly"),
    (lambda g: g["grid"].update(batch=[]), "grid.batch must be a non-empty list"),
    (lambda g: g["grid"].update(question_tokens=[0, 16]), "grid.question_tokens"),
    (lambda g: g["grid"].update(num_chunks=[2.5]), "grid.num_chunks"),
    (lambda g: g["grid"].update(max_sys_len=[True]), "grid.max_sys_len"),
    (lambda g: g.update(backend="torchair"), "torchair graph mode"),
    (lambda g: g.update(checked=True), "key 'checked' was removed with graphchunk's own graph templates"),
])
def test_bad_grids_are_refused_naming_the_problem(edit, message):
    raw = {"backend": GRID["backend"], "grid": dict(GRID["grid"])}
    edit(raw)
    with pytest.raises(ConfigError, match="grid.toml") as info:
        parse_grid(raw, "grid.toml")
    assert message in str(info.value)


@pytest.mark.parametrize("backend", ["compile", "eager", "cuda_graph", "npu_graph"])
def test_removed_template_backends_say_vllms_graphs_replay_the_buckets(backend):
    with pytest.raises(ConfigError, match=f"grid.toml: backend '{backend}' is not supported: graphchunk's own "
                                          f"graph templates were removed and vLLM's graphs replay the buckets; "
                                          f"use backend 'vllm'"):
        parse_grid({**GRID, "backend": backend}, "grid.toml")


def test_backend_defaults_to_vllm():
    assert parse_grid({"grid": GRID["grid"]}, "x").backend == "vllm"


def test_unknown_grid_lists_shipped_grids(tmp_path):
    with pytest.raises(ConfigError, match=r"not found.*'ascend-910b', 'cpu', 'h100'"):
        load_grid("tpu")
    bad = tmp_path / "bad.toml"
    bad.write_text("backend = ")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_grid(str(bad))


def test_zero_sys_is_allowed():
    raw = {"backend": "vllm", "grid": {**GRID["grid"], "max_sys_len": [0]}}
    assert parse_grid(raw, "x").bucket_for([shape([5], 3, sys=0)]).max_sys_len == 0


# --- choosing a bucket --------------------------------------------------------------------------

GRID_BUCKETS = parse_grid(GRID, "test")


@pytest.mark.parametrize("requests, expected", [
    ([shape([1], 1)], Bucket(1, 2, 128, 96, 16)),                         # partial on every axis
    ([shape([128, 128], 16, sys=96)], Bucket(1, 2, 128, 96, 16)),         # exactly at every boundary
    ([shape([128, 128], 17)], Bucket(1, 2, 128, 96, 32)),                 # one question token over
    ([shape([129, 5], 16)], Bucket(1, 2, 384, 96, 16)),                   # one chunk token over
    ([shape([5, 5, 5], 16)], Bucket(1, 8, 128, 96, 16)),                  # one chunk over
    ([shape([5] * 8, 16)], Bucket(1, 8, 128, 96, 16)),
    ([shape([384] * 8, 32, sys=96)], Bucket(1, 8, 384, 96, 32)),
    ([shape([5], 3), shape([5], 16)], Bucket(2, 2, 128, 96, 16)),         # batch of two
    ([shape([5], 3), shape([200, 5, 5], 17)], Bucket(2, 8, 384, 96, 32)),  # the widest request decides
])
def test_smallest_bucket_holding_the_step(requests, expected):
    assert GRID_BUCKETS.bucket_for(requests) == expected


@pytest.mark.parametrize("requests", [
    [shape([5], 33)], [shape([385], 5)], [shape([5] * 9, 5)], [shape([5], 5, sys=97)],
    [shape([5], 5)] * 3,
])
def test_step_outside_every_bucket_has_none(requests):
    assert GRID_BUCKETS.bucket_for(requests) is None


def test_bucket_shape():
    bucket = Bucket(2, 8, 384, 96, 32)
    assert (bucket.num_tokens, bucket.max_context_len, bucket.name) == (64, 96 + 8 * 384, "b2-c8x384-s96-q32")


def test_runner_refuses_oversized_buckets():
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=48))
    with pytest.raises(ConfigError, match=r"\['b2-c2x128-s96-q32'.*max_num_batched_tokens=48"):
        check_grid(config, GRID_BUCKETS)
    config.scheduler_config.max_num_batched_tokens = 64
    check_grid(config, GRID_BUCKETS)


# --- counting how steps ran ---------------------------------------------------------------------

def test_outcomes_are_counted_per_bucket_and_in_the_manifest():
    metrics = CacheMetrics()
    counts = BucketCounts(GRID_BUCKETS, metrics)
    bucket = counts.choose([shape([5], 5)])
    for outcome in ("replayed", "padded", "padded", "eager"):
        counts.count(outcome, bucket)
    counts.count("eager", None)
    assert (metrics.graph_replays, metrics.graph_padded, metrics.graph_eager) == (1, 2, 2)
    manifest = counts.manifest({"cudagraph_mode": "FULL"})
    assert set(manifest) == {"grid", "backend", "vllm_graphs", "buckets", "outside_buckets"}
    assert (manifest["grid"], manifest["backend"]) == ("test", "vllm")
    assert manifest["vllm_graphs"] == {"cudagraph_mode": "FULL"}
    rows = {row["bucket"]: row for row in manifest["buckets"]}
    assert len(rows) == len(counts.grid.buckets)
    assert rows[bucket.name] == {"bucket": bucket.name, "replayed": 1, "padded": 2, "eager": 1}
    assert all(row == {"bucket": name, **dict.fromkeys(OUTCOMES, 0)} for name, row in rows.items()
               if name != bucket.name)
    assert manifest["outside_buckets"] == {"replayed": 0, "padded": 0, "eager": 1}


def test_choose_takes_the_smallest_bucket_and_none_for_mixed_steps():
    counts = BucketCounts(GRID_BUCKETS, CacheMetrics())
    assert counts.choose([shape([5], 5)]) == Bucket(1, 2, 128, 96, 16)
    assert counts.choose([shape([5], 33)]) is None
    assert counts.choose(None) is None


def test_axes_are_the_bucket_fields():
    assert AXES == tuple(Bucket.__dataclass_fields__)
