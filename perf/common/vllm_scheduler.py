"""vLLM's own ``Scheduler`` built in-process, as the engine core builds it, without an engine: a
real ``VllmConfig`` of a local checkpoint (no weights load), one full-attention KV cache group of
``num_blocks`` blocks (tensors never allocated), prefix caching on and vLLM's block hasher.

Used where a test or a bench drives vLLM's scheduling and block accounting with its own workers:
``tests/schedule_harness.py``, ``perf/host/bench_host_scale.py``, ``perf/host/bench_in_place.py``.
"""
from __future__ import annotations


def vllm_scheduler(model_path, *, num_blocks: int, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                   max_model_len: int, kv_transfer_config=None, additional_config: dict | None = None,
                   asynchronous: bool = False, log_stats: bool = True):
    """(scheduler, its ``VllmConfig``, vLLM's request block hasher). ``asynchronous``: vLLM's
    ``AsyncScheduler`` with asynchronous scheduling on, as on a GPU (vLLM's CPU platform turns it
    off when the config is built)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(model_path), dtype="float32", max_model_len=max_model_len)
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                         max_model_len=max_model_len, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        kv_transfer_config=kv_transfer_config, additional_config=additional_config or {})
    config.cache_config.num_gpu_blocks = num_blocks
    config.scheduler_config.async_scheduling = asynchronous
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    scheduler = (AsyncScheduler if asynchronous else Scheduler)(
        config, kv_cache_config, StructuredOutputManager(config), block_size=block_size, log_stats=log_stats)
    return scheduler, config, get_request_block_hasher(block_size, hash_fn)
