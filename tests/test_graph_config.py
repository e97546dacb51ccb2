"""A grid of backend ``vllm`` drives vLLM's own graph machinery (``engine/graph_config.py``): the
config path a CUDA (or Ascend) engine takes, exercised on CPU with real vLLM config objects."""
from types import SimpleNamespace

import pytest

from graphchunk.graphs.buckets import load_grid, parse_grid

VLLM_GRID = {"backend": "vllm", "grid": {"batch": [1, 4], "num_chunks": [8], "max_chunk_len": [512],
                                         "max_sys_len": [64], "question_tokens": [24, 300]}}
CUDA_DEFAULT_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
"""vLLM 0.32's default cudagraph_capture_sizes on CUDA (max_num_seqs 256, no spec decode)."""


def engine_args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from graphchunk.reference import models

    return EngineArgs(model=str(models.tiny_checkpoint("llama3")), worker_cls="graphchunk.Runner", **kwargs)


@pytest.mark.parametrize("platform, enforce_eager, backend, expected", [
    ("cuda", False, "vllm", "FULL"),     # vLLM narrows it itself where attention cannot run mixed batches
    ("cuda", True, "vllm", None),        # no graphs at all
    ("npu", False, "vllm", None),        # vllm-ascend's default mode stays
    ("cpu", False, "vllm", None),        # one dynamic-shape compiled graph, no CUDA graphs
])
def test_full_graphs_are_requested_on_cuda_only(platform, enforce_eager, backend, expected):
    from graphchunk.engine.graph_config import request_graph_mode

    args = engine_args(enforce_eager=enforce_eager)
    given = args.compilation_config
    request_graph_mode(args, parse_grid({**VLLM_GRID, "backend": backend}, "grid.toml"), platform)
    mode = args.compilation_config.cudagraph_mode
    assert (mode.name if mode is not None else None) == expected
    assert given.cudagraph_mode is None  # the caller's config object is not changed


def test_a_mode_the_user_chose_is_kept():
    from vllm.config import CompilationConfig, CUDAGraphMode

    from graphchunk.engine.graph_config import request_graph_mode

    grid = parse_grid(VLLM_GRID, "grid.toml")
    args = engine_args(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.PIECEWISE))
    request_graph_mode(args, grid, "cuda")
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    as_dict = engine_args()
    as_dict.compilation_config = {"mode": 3}
    request_graph_mode(as_dict, grid, "cuda")
    assert as_dict.compilation_config == {"mode": 3, "cudagraph_mode": "FULL"}


def vllm_config(mode="FULL", sizes=CUDA_DEFAULT_SIZES, enforce_eager=False):
    from vllm.config import CompilationConfig, CUDAGraphMode

    compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode], cudagraph_capture_sizes=list(sizes))
    compilation.max_cudagraph_capture_size = max(sizes) if sizes else 0
    return SimpleNamespace(compilation_config=compilation, model_config=SimpleNamespace(enforce_eager=enforce_eager))


def test_grid_token_counts_join_vllms_capture_sizes_below_its_ceiling():
    """Only up to vLLM's largest capture size: raising it to 1200 would pad every ordinary step of
    513-1200 tokens to 1200 (vLLM pads every step to its next capture size)."""
    from graphchunk.engine.graph_config import add_capture_sizes, vllm_graphs

    grid = parse_grid(VLLM_GRID, "grid.toml")  # token counts 24, 96, 300, 1200
    config = vllm_config()
    assert add_capture_sizes(config, grid, "cuda") == [300]  # 24 and 96 are vLLM defaults already
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert sizes == sorted(set(CUDA_DEFAULT_SIZES) | {300})
    assert config.compilation_config.max_cudagraph_capture_size == 512  # 1200 is left out
    reported = vllm_graphs(config)
    assert (reported["cudagraph_mode"], reported["cudagraph_capture_sizes"]) == ("FULL", sizes)
    assert add_capture_sizes(config, grid, "cuda") == []  # idempotent
    ascend = vllm_config("FULL_AND_PIECEWISE")
    assert add_capture_sizes(ascend, grid, "npu") == [300]


def test_a_ceiling_the_user_raised_takes_the_grids_larger_sizes():
    """-cc '{"max_cudagraph_capture_size": 2048}': vLLM's own 16-token stride up to 2048, and the
    grid's 900 joins it (300 too; both off vLLM's stride); the ceiling stays the user's."""
    from graphchunk.engine.graph_config import add_capture_sizes

    grid = parse_grid({**VLLM_GRID, "grid": {**VLLM_GRID["grid"], "batch": [1, 3]}}, "grid.toml")  # 24 72 300 900
    raised = CUDA_DEFAULT_SIZES + list(range(528, 2049, 16))
    config = vllm_config(sizes=raised)
    assert add_capture_sizes(config, grid, "cuda") == [300, 900]
    assert config.compilation_config.max_cudagraph_capture_size == 2048
    assert config.compilation_config.cudagraph_capture_sizes == sorted(set(raised) | {300, 900})


@pytest.mark.parametrize("platform, mode, enforce_eager", [("cpu", "FULL", False), ("cuda", "NONE", False),
                                                            ("cuda", "FULL", True)])
def test_nothing_is_added_where_vllm_runs_no_graphs(platform, mode, enforce_eager):
    from graphchunk.engine.graph_config import add_capture_sizes

    config = vllm_config(mode, enforce_eager=enforce_eager)
    assert add_capture_sizes(config, parse_grid(VLLM_GRID, "grid.toml"), platform) == []
    assert config.compilation_config.cudagraph_capture_sizes == CUDA_DEFAULT_SIZES


def test_the_shipped_accelerator_grids_fit_vllms_default_ceiling():
    """h100 and ascend-910b name vLLM's graphs; every count is within vLLM's default largest
    capture size (512), so every bucket is captured and vLLM's ceiling stays where it was."""
    from graphchunk.engine.graph_config import add_capture_sizes

    for name in ("h100", "ascend-910b"):
        grid = load_grid(name)
        assert max(grid.token_counts) <= max(CUDA_DEFAULT_SIZES), name
        config = vllm_config()
        added = add_capture_sizes(config, grid, "cuda")
        assert set(grid.token_counts) <= set(config.compilation_config.cudagraph_capture_sizes)
        assert added == [n for n in grid.token_counts if n not in CUDA_DEFAULT_SIZES]
        assert config.compilation_config.max_cudagraph_capture_size == max(CUDA_DEFAULT_SIZES)


def test_the_cuda_start_up_path_on_cpu(monkeypatch, tmp_path):
    """The plugin's wrapper of EngineArgs.create_engine_config with the platform taken for CUDA:
    the grid is read before the config is built, FULL graphs are requested, and check_config
    accepts the built config (the CPU platform itself then keeps vLLM's CPU compilation)."""
    import graphchunk.engine.graph_config as graph_config
    from graphchunk.engine.plugin import register

    register()
    monkeypatch.setattr(graph_config, "platform_kind", lambda: "cuda")
    grid = tmp_path / "cuda.toml"
    grid.write_text('backend = "vllm"\n[grid]\nbatch = [1]\nnum_chunks = [4]\nmax_chunk_len = [64]\n'
                    'max_sys_len = [32]\nquestion_tokens = [24]\n')
    args = engine_args(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 28,
                       additional_config={"graphchunk": {"templates": str(grid), "pool_tokens": 4096}})
    config = args.create_engine_config()
    assert args.compilation_config.cudagraph_mode.name == "FULL"
    assert config.parallel_config.worker_cls == "graphchunk.Runner"


def test_the_shipped_cpu_grid_is_the_kind_the_session_engine_runs():
    """The CPU default grid (``graph_templates/cpu.toml``) is backend ``vllm``, as the session
    engine's grid is: how an engine started without --enforce-eager runs and counts such a grid's
    steps on vLLM's compiled graph is tests/test_templates.py's (every bucket, steps outside them,
    against the oracle) and tests/test_warmup.py's (a compiled tiny engine started on a grid by
    graphchunk-warmup). A third compiled engine here cost CI ~2 min and checked nothing more."""
    from conftest import GC_LLM_TEMPLATES

    shipped, session = load_grid("cpu"), load_grid(str(GC_LLM_TEMPLATES))
    assert shipped.backend == session.backend == "vllm"
    assert shipped.buckets and shipped.source.endswith("graph_templates/cpu.toml")
