"""Bucket grids, bucket choice and the template backends, without an engine."""
import sys
from types import SimpleNamespace

import pytest
import torch

from graphchunk.config import ConfigError
from graphchunk.engine.worker import check_grid
from graphchunk.graphs.buckets import AXES, Bucket, RequestShape, load_grid, parse_grid
from graphchunk.graphs.graph_backends import ReplayMiss, make_backend
from graphchunk.graphs.templates import GraphTemplates, TemplateCaptureError
from graphchunk.metrics import CacheMetrics

GRID = {"backend": "compile", "grid": {"batch": [1, 2], "num_chunks": [2, 8], "max_chunk_len": [128, 384],
                                       "max_sys_len": [96], "question_tokens": [16, 32]}}


CPU_BACKEND = "vllm"


def shape(chunks, question, sys=10):
    return RequestShape(sys, tuple(chunks), question)


@pytest.mark.parametrize("name, backend, count", [("cpu", CPU_BACKEND, 24), ("h100", "vllm", 144),
                                                  ("ascend-910b", "vllm", 24)])
def test_shipped_grids(name, backend, count):
    grid = load_grid(name)
    assert (grid.backend, len(grid.buckets), len(set(grid.buckets))) == (backend, count, count)


def test_grid_by_path_equals_grid_by_name():
    assert load_grid(str(load_grid("cpu").source)).buckets == load_grid("cpu").buckets


@pytest.mark.parametrize("edit, message", [
    (lambda g: g.update(backend="tensorrt"), "backend must be one of"),
    (lambda g: g.update(extra=1), "unknown key(s) ['extra']"),
    (lambda g: g["grid"].pop("batch"), "must list exactly"),
    (lambda g: g["grid"].update(batch=[]), "grid.batch must be a non-empty list"),
    (lambda g: g["grid"].update(question_tokens=[0, 16]), "grid.question_tokens"),
    (lambda g: g["grid"].update(num_chunks=[2.5]), "grid.num_chunks"),
    (lambda g: g["grid"].update(max_sys_len=[True]), "grid.max_sys_len"),
    (lambda g: g.update(backend="torchair"), "torchair graph mode"),
    (lambda g: g.update(checked="yes"), "checked must be true or false"),
    (lambda g: g.update(backend="vllm", checked=True), "true only with backend 'compile' or 'eager'"),
])
def test_bad_grids_are_refused_naming_the_problem(edit, message):
    raw = {"backend": GRID["backend"], "grid": dict(GRID["grid"])}
    edit(raw)
    with pytest.raises(ConfigError, match="grid.toml") as info:
        parse_grid(raw, "grid.toml")
    assert message in str(info.value)


def test_unknown_grid_lists_shipped_grids(tmp_path):
    with pytest.raises(ConfigError, match=r"not found.*'ascend-910b', 'cpu', 'h100'"):
        load_grid("tpu")
    bad = tmp_path / "bad.toml"
    bad.write_text("backend = ")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_grid(str(bad))


def test_zero_sys_is_allowed():
    raw = {"backend": "eager", "grid": {**GRID["grid"], "max_sys_len": [0]}}
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


def test_runner_refuses_device_graph_backends_and_oversized_buckets(monkeypatch):
    import graphchunk.engine.worker as worker

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=48),
                             model_config=SimpleNamespace(enforce_eager=False))
    standalone = parse_grid({**GRID, "backend": "cuda_graph"}, "standalone.toml")
    with pytest.raises(ConfigError, match="uses backend 'cuda_graph'; inside vLLM use 'vllm'"):
        check_grid(config, standalone)
    with pytest.raises(ConfigError, match=r"\['b2-c2x128-s96-q32'.*max_num_batched_tokens=48"):
        check_grid(config, GRID_BUCKETS)
    config.scheduler_config.max_num_batched_tokens = 64
    check_grid(config, GRID_BUCKETS)  # with vLLM's compilation on (no --enforce-eager), on CPU
    monkeypatch.setattr(worker, "platform_kind", lambda: "cuda")
    with pytest.raises(ConfigError, match="would nest inside vLLM's graphs; use backend 'vllm'"):
        check_grid(config, GRID_BUCKETS)
    check_grid(config, parse_grid({**GRID, "backend": "vllm"}, "cuda.toml"))
    config.model_config.enforce_eager = True
    check_grid(config, GRID_BUCKETS)


@pytest.mark.parametrize("platform", ["cuda", "npu"])
def test_eager_templates_are_refused_under_vllms_graphs(monkeypatch, platform):
    """Backend 'eager' pads a template step to its bucket's token count in vLLM's batch descriptor
    (runner_templates); under vLLM's CUDA/ACL graphs that descriptor was never captured."""
    import graphchunk.engine.worker as worker

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
                             model_config=SimpleNamespace(enforce_eager=False))
    eager = parse_grid({**GRID, "backend": "eager"}, "eager.toml")
    check_grid(config, eager)  # CPU: vLLM's one compiled graph takes any token count
    monkeypatch.setattr(worker, "platform_kind", lambda: platform)
    with pytest.raises(ConfigError, match=f"uses backend 'eager'.*never captured; use backend 'vllm' there.*"
                                          f"--enforce-eager"):
        check_grid(config, eager)
    config.model_config.enforce_eager = True  # no graphs in vLLM: the descriptor dispatches nothing
    check_grid(config, eager)


# --- backends -----------------------------------------------------------------------------------

WEIGHT = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def toy_forward(x, scale):
    return torch.tanh(x @ WEIGHT) * scale + x.sum(0)


def toy_inputs(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(n, 8, generator=gen), scale=torch.rand(n, 1, generator=gen))


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_replay_computes_new_inputs_like_eager(backend):
    impl = make_backend(backend, max_templates=4)
    template = impl.capture(toy_forward, toy_inputs(4, 0))
    for seed in (1, 2):
        inputs = toy_inputs(4, seed)
        torch.testing.assert_close(template.replay(**inputs), toy_forward(**inputs), rtol=1e-5, atol=1e-6)


def test_compiled_replay_never_recompiles():
    template = make_backend("compile", max_templates=4).capture(toy_forward, toy_inputs(4, 0))
    with pytest.raises(ReplayMiss, match="Detected recompile"):
        template.replay(**toy_inputs(5, 1))


def test_replay_miss_runs_eager_and_says_so():
    templates = GraphTemplates(parse_grid({**GRID, "backend": "compile"}, "test"), CacheMetrics())
    bucket = Bucket(1, 2, 128, 96, 16)
    templates.templates[bucket] = templates.backend.capture(toy_forward, toy_inputs(16, 0))
    inputs = toy_inputs(16, 1)
    output, replayed = templates.replay(bucket, toy_forward, **inputs)
    torch.testing.assert_close(output, toy_forward(**inputs))
    assert replayed
    odd = toy_inputs(7, 2)  # not the captured shape: nothing runs in the template, eager does
    output, replayed = templates.replay(bucket, toy_forward, **odd)
    assert torch.equal(output, toy_forward(**odd)) and not replayed


def test_outcomes_are_counted_per_bucket_and_in_the_manifest():
    metrics = CacheMetrics()
    templates = GraphTemplates(parse_grid({**GRID, "backend": "vllm"}, "test"), metrics)
    assert not templates.captures and templates.backend is None
    bucket = templates.choose([shape([5], 5)])
    for outcome in ("replayed", "padded", "padded", "eager"):
        templates.count(outcome, bucket)
    templates.count("eager", None)
    assert (metrics.graph_replays, metrics.graph_padded, metrics.graph_eager) == (1, 2, 2)
    manifest = templates.manifest({"cudagraph_mode": "FULL"})
    assert manifest["captured_by"] == "vllm" and manifest["vllm_graphs"] == {"cudagraph_mode": "FULL"}
    rows = {row["bucket"]: row for row in manifest["buckets"]}
    assert len(rows) == len(templates.grid.buckets)
    assert {k: rows[bucket.name][k] for k in ("replayed", "padded", "eager")} == {"replayed": 1, "padded": 2,
                                                                                   "eager": 1}
    assert manifest["outside_buckets"] == {"replayed": 0, "padded": 0, "eager": 1}


def test_capture_failure_names_the_bucket():
    from contextlib import nullcontext

    templates = GraphTemplates(parse_grid({**GRID, "backend": "eager"}, "test"), CacheMetrics())

    def forward(x, scale):
        if x.shape[0] == 64:
            raise RuntimeError("out of graph memory")
        return toy_forward(x, scale)

    with pytest.raises(TemplateCaptureError, match=r"b2-c2x128-s96-q32 \(eager, 64 tokens\).*out of graph memory"):
        templates.capture_all(forward, lambda b: toy_inputs(b.num_tokens, 0), lambda b: nullcontext(),
                              torch.device("cpu"), progress=False)
    assert templates.metrics.graph_captures == 12  # the 12 buckets of 16 and 32 tokens came first


def test_choose_takes_the_smallest_bucket_and_none_for_mixed_steps():
    templates = GraphTemplates(parse_grid({**GRID, "backend": "eager"}, "test"), CacheMetrics())
    assert templates.choose([shape([5], 5)]) == Bucket(1, 2, 128, 96, 16)
    assert templates.choose(None) is None


def test_checked_grids_wrap_the_backend():
    from graphchunk.graphs.graph_safety import CheckedBackend

    templates = GraphTemplates(parse_grid({**GRID, "checked": True}, "test"), CacheMetrics())
    assert isinstance(templates.backend, CheckedBackend) and templates.backend.inner.name == "compile"


def test_device_graph_backends_say_what_they_need(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="'cuda_graph' needs a CUDA device"):
        make_backend("cuda_graph", 1)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=r"torch-npu \(pip install 'graphchunk\[ascend\]'\)"):
        make_backend("npu_graph", 1)


def test_axes_are_the_bucket_fields():
    assert AXES == tuple(Bucket.__dataclass_fields__)
