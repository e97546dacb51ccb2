"""How a bucket grid drives vLLM's own graph machinery, set where the engine's config is built.

Every grid (``graph_templates/h100.toml``, ``ascend-910b.toml``, ``cpu.toml``) has backend
``vllm``: graphchunk captures nothing itself. The grid's token counts (``batch * question_tokens``) become capture sizes of
vLLM's graphs, so a question-only step that a bucket holds lands on a captured graph; vLLM's
``CudagraphDispatcher`` pads it to the next capture size, and decode keeps vLLM's own graphs.

* CUDA: the counts join ``compilation_config.cudagraph_capture_sizes`` (after vLLM computed its
  defaults) up to vLLM's largest capture size, ``max_cudagraph_capture_size``, which the grid never
  raises: ``min(2 * max_num_seqs, 512)`` tokens by default (1024 on SM100; at most
  ``max_num_batched_tokens``), or what the user set (``-cc '{"max_cudagraph_capture_size": N}'``
  or explicit ``cudagraph_capture_sizes``). vLLM pads every step to its next capture size, so
  raising the ceiling for a few large grid sizes would pad every ordinary step above the old
  ceiling to the next grid size (a 513-token prefill to 1024); a grid size above the ceiling is
  left out (logged), and its steps run as vLLM runs any step that large, without a CUDA graph.
  ``cudagraph_mode`` is FULL unless the user chose a mode. vLLM narrows FULL by itself where the
  attention backend cannot run mixed prefill batches in a full graph
  (``CompilationConfig.resolve_cudagraph_mode_and_sizes``: FlashAttention 3 and Triton attention
  can; FlashAttention 2 and FlashInfer cannot, and get FULL_AND_PIECEWISE: question steps replay
  piecewise graphs with attention run eagerly between them).
* Ascend (vllm-ascend): the same capture sizes drive its ACL graphs; the mode stays vllm-ascend's
  default (FULL_AND_PIECEWISE). Its FULL mode drops the piecewise split, so where the attention
  backend lacks mixed-batch support it would leave question steps with no graph at all.
* CPU: vLLM compiles one dynamic-shape graph (``DYNAMO_TRACE_ONCE``) serving every token count:
  there is nothing to add.

With ``--enforce-eager`` (or ``cudagraph_mode`` NONE) vLLM runs no graphs and nothing is added.
Written here rather than as graphchunk's own graphs because vLLM's already hold the attention
metadata in persistent buffers and update it per replay; graphchunk adds only the sizes.
"""
from __future__ import annotations

import copy

from graphchunk.graphs.buckets import BucketGrid
from graphchunk.log import logger


def platform_kind() -> str:
    """'cuda', 'npu' or 'cpu': whose graph machinery the engine runs on."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return "cuda"
    if getattr(current_platform, "device_type", None) == "npu":
        return "npu"
    return "cpu"


def request_graph_mode(engine_args, grid: BucketGrid, platform: str) -> None:
    """Before the config is built: FULL CUDA graphs on CUDA unless the user chose a mode (or eager)."""
    if platform != "cuda" or engine_args.enforce_eager:
        return
    compilation = engine_args.compilation_config
    if isinstance(compilation, dict):
        if compilation.get("cudagraph_mode") is None:
            engine_args.compilation_config = {**compilation, "cudagraph_mode": "FULL"}
        return
    if compilation.cudagraph_mode is None:
        from vllm.config import CUDAGraphMode

        compilation = copy.copy(compilation)  # the caller's object stays as given
        compilation.cudagraph_mode = CUDAGraphMode.FULL
        engine_args.compilation_config = compilation


def add_capture_sizes(vllm_config, grid: BucketGrid, platform: str) -> list[int]:
    """After the config is built: the grid's token counts among vLLM's graph capture sizes, up to
    vLLM's largest one (``max_cudagraph_capture_size``, left as vLLM resolved it). Returns the
    sizes added (none on CPU, with eager execution, or when all were there)."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    if platform == "cpu" or vllm_config.model_config.enforce_eager or compilation.cudagraph_mode == CUDAGraphMode.NONE:
        return []
    sizes = set(compilation.cudagraph_capture_sizes or [])
    ceiling = compilation.max_cudagraph_capture_size or 0
    wanted = set(grid.token_counts) - sizes
    added = sorted(n for n in wanted if n <= ceiling)
    above = sorted(n for n in wanted if n > ceiling)
    if added:
        compilation.cudagraph_capture_sizes = sorted(sizes | set(added))
        logger.info("graphchunk: grid token counts %s added to vLLM's cudagraph_capture_sizes (%s)",
                    added, grid.source)
    if above:
        logger.info("graphchunk: grid token counts %s are above vLLM's max_cudagraph_capture_size=%d and are "
                    "not captured (%s); raise it with -cc '{\"max_cudagraph_capture_size\": N}' to capture them",
                    above, ceiling, grid.source)
    return added


def vllm_graphs(vllm_config) -> dict:
    """What vLLM's own graph machinery runs with (for the templates manifest)."""
    compilation = vllm_config.compilation_config
    return {"compilation_mode": getattr(compilation.mode, "name", str(compilation.mode)),
            "cudagraph_mode": getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode)),
            "cudagraph_capture_sizes": list(compilation.cudagraph_capture_sizes or [])}
