"""The chunk-aware model runner: vLLM's own runner whose hooks hand graphchunk's work to its engine.

``chunk_runner_class(base)`` subclasses the platform's runner (GPUModelRunner, CPUModelRunner,
NPUModelRunner). Its state is one ``ChunkEngine`` (``chunk_engine.py``), built when vLLM allocates
the KV cache (``initialize_kv_cache``, grown by the pool's blocks: ``kv_binding.py``); each
override below is a few lines calling it, in vLLM's order within a step:

``execute_model``   plans the step and runs vLLM's step inside;
``_prepare_inputs`` fills the planned context (graphchunk's connector's loads, ``connector.py``)
                    from the chunk pool once vLLM's block tables hold the step, then rewrites
                    positions in the batch vLLM prepared;
``_determine_batch_execution_and_padding``
                    counts how vLLM runs a step with a cached-chunk prefill (its graph, padded, eager).
"""
from __future__ import annotations

import inspect

from graphchunk.config import GraphChunkConfig
from graphchunk.engine.chunk_engine import ChunkEngine
from graphchunk.engine.kv_binding import bind_engine, grown_kv_cache_config


class ChunkModelRunner:
    """Hooks over a vLLM v1 model runner class (``chunk_runner_class``); ``graphchunk_setup`` first."""

    graphchunk_config: GraphChunkConfig
    chunk_engine: ChunkEngine | None

    def graphchunk_setup(self, config: GraphChunkConfig) -> None:
        self.graphchunk_config = config
        self.chunk_engine = None

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, kv_cache_allocation_context=None):
        base = super().initialize_kv_cache
        optional = {"is_profiling": is_profiling, "kv_cache_allocation_context": kv_cache_allocation_context}
        if is_profiling:
            return call_with_accepted(base, kv_cache_config, optional)
        pool_blocks = self.graphchunk_config.pool_blocks(self.cache_config.block_size)
        grown = grown_kv_cache_config(self.vllm_config, kv_cache_config, pool_blocks)
        call_with_accepted(base, grown, optional)
        # The worker's count of the blocks its cache tensors hold: backends size per-step structures
        # by it (FlexAttention's block mask spans num_gpu_blocks * block_size keys, and must span
        # the whole tensor it attends over). The scheduler's count is its own kv_cache_config's.
        self.cache_config.num_gpu_blocks = grown.num_blocks
        self.chunk_engine = bind_engine(self, self.graphchunk_config, kv_cache_config.num_blocks)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        if self.chunk_engine is None:
            return super().execute_model(scheduler_output, intermediate_tensors)
        with self.chunk_engine.step(scheduler_output):
            return super().execute_model(scheduler_output, intermediate_tensors)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        engine = self.chunk_engine
        if engine is not None:
            engine.fill_context()
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if engine is not None:
            engine.rewrite_positions(self.input_batch, self.query_start_loc.np, self.positions)
        return result

    def _determine_batch_execution_and_padding(self, num_tokens, *args, **kwargs):
        result = super()._determine_batch_execution_and_padding(num_tokens, *args, **kwargs)
        if self.chunk_engine is not None:
            mode, batch_desc = result[:2]
            self.chunk_engine.count_step(num_tokens, batch_desc.num_tokens, self._vllm_runs_graph(mode))
        return result

    def _vllm_runs_graph(self, mode) -> bool:
        """vLLM replays a captured graph (CUDA/ACL), or runs its one compiled dynamic-shape graph (CPU)."""
        from vllm.config import CompilationMode, CUDAGraphMode

        if mode != CUDAGraphMode.NONE:
            return True
        return self.device.type == "cpu" and self.compilation_config.mode != CompilationMode.NONE


def call_with_accepted(method, first, optional: dict):
    """``method(first, **optional)`` passing only the ``optional`` keywords its signature takes:
    vLLM's runners take ``(kv_cache_config, is_profiling, kv_cache_allocation_context)``,
    vllm-ascend's ``NPUModelRunner`` ``(kv_cache_config)`` alone. A value other than its default
    (False / None) that ``method`` cannot take is a TypeError, never dropped."""
    params = inspect.signature(method).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    passed = {k: v for k, v in optional.items() if takes_any or k in params}
    dropped = [k for k, v in optional.items() if k not in passed and v not in (None, False)]
    if dropped:
        raise TypeError(f"{method.__qualname__} takes no {', '.join(dropped)}")
    return method(first, **passed)


def chunk_runner_class(base: type) -> type:
    return type(f"GraphChunk{base.__name__}", (ChunkModelRunner, base), {})
