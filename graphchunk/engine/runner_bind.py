"""Binding the chunk pool into vLLM's KV cache at start-up: a role of the chunk-aware model runner.

``initialize_kv_cache`` grows vLLM's KV cache by the pool's blocks (past the scheduler's
``num_blocks``, so vLLM never hands them to a request), probes the attention backend's block
layout, and binds the pool, the persistent tier (``store_path``) and blend mode's key rotation to
the runner (``ChunkRunnerMixin`` in ``model_runner.py`` mixes this in). Anything the loaded model
or layout cannot support is refused here, at start-up.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import xxhash

from graphchunk.blend.rope import KeyRotation
from graphchunk.cache.chunk_cache import ChunkCache
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.kv_slots import KVCopier, KVSlotMap
from graphchunk.cache.pool import ChunkPool
from graphchunk.cache.store import ChunkStore, StoreIdentity, weights_digest
from graphchunk.config import ConfigError
from graphchunk.engine.runner_device import decoder_stack

logger = logging.getLogger("graphchunk")


class PoolBindingMixin:
    """Methods of ``ChunkRunnerMixin``; ``gc_config`` and ``gc_metrics`` are set up there."""

    def pool_num_blocks(self) -> int:
        return self.gc_config.pool_blocks(self.cache_config.block_size)

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, kv_cache_allocation_context=None):
        if is_profiling:
            return super().initialize_kv_cache(kv_cache_config, is_profiling, kv_cache_allocation_context)
        num_blocks = kv_cache_config.num_blocks
        grown = _with_extra_blocks(self.vllm_config, kv_cache_config, self.pool_num_blocks())
        super().initialize_kv_cache(grown, is_profiling, kv_cache_allocation_context)
        # The worker's count of the blocks its cache tensors hold: backends size per-step structures
        # by it (FlexAttention's block mask spans num_gpu_blocks * block_size keys, and must span
        # the whole tensor it attends over). The scheduler's count is its own kv_cache_config's.
        self.cache_config.num_gpu_blocks = grown.num_blocks
        self._graphchunk_bind(num_blocks)

    def _graphchunk_bind(self, first_pool_block: int) -> None:
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or any(g.kernel_block_size for g in self.attn_groups[0]):
            raise ConfigError("graphchunk supports models whose layers share one full-attention KV cache group")
        from vllm.model_executor.models.utils import extract_layer_index

        # In model order, so that gc_copier's layer i (CacheBlend's check layer) is decoder layer i.
        layer_names = sorted(groups[0].layer_names, key=extract_layer_index)
        forward_context = self.compilation_config.static_forward_context
        self.gc_layers = [forward_context[name] for name in layer_names]
        num_blocks = self.kv_cache_config.num_blocks
        block_dim = list(self.gc_layers[0].kv_cache.shape).index(num_blocks)
        slot_map = self._probe_kv_layout(self.gc_layers[0], groups[0].kv_cache_spec, block_dim)
        self.gc_copier = KVCopier([layer.kv_cache for layer in self.gc_layers], slot_map, num_blocks, block_dim)
        pool = ChunkPool(self.pool_num_blocks(), self.cache_config.block_size, first_pool_block, self.gc_metrics,
                         policy=self.gc_config.eviction)
        model = self.model_config
        tier = self._bind_tier(slot_map) if self.gc_config.store_path else None
        # With a tier, keys name the weights (shared with other servers), else the model's path.
        space = KeySpace(model=tier.identity.weights_digest if tier else f"{model.model}@{model.revision or ''}",
                         dtype=str(model.dtype), parallel_layout=_parallel_layout(self.parallel_config))
        self.gc_cache = ChunkCache(pool, space, self.scheduler_config.max_num_batched_tokens,
                                   check_layer=self.gc_config.check_layer, tier=tier)
        self._bind_blend()
        logger.info("graphchunk: chunk pool of %d blocks (%d tokens) at block ids [%d, %d)", pool.num_blocks,
                    pool.num_blocks * pool.block_size, first_pool_block, first_pool_block + pool.num_blocks)

    def _bind_tier(self, slot_map: KVSlotMap) -> ChunkStore:
        from vllm.distributed import get_tensor_model_parallel_rank

        model, layer = self.model_config, self.gc_layers[0]
        in_block = xxhash.xxh3_64_hexdigest(slot_map.coords.numpy().tobytes())
        identity = StoreIdentity(
            model_path=model.model, weights_digest=weights_digest(model.model, model.revision),
            kv_dtype=str(layer.kv_cache.dtype), block_size=self.cache_config.block_size,
            kv_layout=f"{type(layer.impl).__name__} block {self.gc_copier.block_shape} in-block {in_block}",
            parallel=f"{_parallel_layout(self.parallel_config)} rank {get_tensor_model_parallel_rank()}")
        host = HostTier(self.gc_config.host_bytes, self.gc_metrics, pin=self.device.type == "cuda") \
            if self.gc_config.host_bytes else None
        tier = ChunkStore(self.gc_config.store_path, self.gc_config.store_bytes, identity, len(self.gc_layers),
                          self.gc_copier.block_shape, self.gc_metrics, all_ranks=_tp_all_ranks(), host=host)
        logger.info("graphchunk: persistent chunk tier at %s (%.1f of %.1f GiB used)", tier.root,
                    self.gc_metrics.tier_bytes / 2**30, tier.budget / 2**30)
        return tier

    def _bind_blend(self) -> None:
        """Blend mode needs keys it can move (``blend/rope.py``); CacheBlend also a decoder whose layer
        range can be narrowed. Without them blend is refused at start-up when it is the default
        mode; the API process refuses blend requests from the model's config (``hf_rope_refusal``),
        and a blend request that still arrives here runs as a full prefill — exactly blend's target."""
        self.gc_rotation = self.gc_blend_refusal = self.gc_check_refusal = None
        try:
            self.gc_rotation = KeyRotation.from_model(self.model)
            if self.gc_rotation.max_delta + 1 < self.model_config.max_model_len:
                raise ConfigError(f"the rotary cache holds {self.gc_rotation.max_delta + 1} positions, fewer than "
                                  f"max_model_len={self.model_config.max_model_len}")
        except ConfigError as exc:
            self.gc_rotation, self.gc_blend_refusal = None, str(exc)
            if self.gc_config.mode == "blend":
                raise
            logger.warning("graphchunk: blend mode unavailable for this model (full prefill instead): %s", exc)
        try:
            decoder = decoder_stack(self.model)
            num_layers = decoder.end_layer - decoder.start_layer
            if self.gc_config.check_layer >= num_layers:
                raise ConfigError(f"graphchunk.check_layer={self.gc_config.check_layer} must be below the "
                                  f"model's {num_layers} layers")
        except ConfigError as exc:
            self.gc_check_refusal = str(exc)
            if self.gc_config.mode == "blend" and self.gc_config.policy.needs_check:
                raise
            logger.warning("graphchunk: CacheBlend unavailable (full prefill instead): %s", exc)

    def _probe_kv_layout(self, layer, spec, block_dim: int) -> KVSlotMap:
        """The backend's placement of a slot's K/V in the real cache: probed through its own write
        op on a scratch with the real cache's strides (vLLM's resolved ``KVCacheLayout``), then
        checked on the real cache's last pool slot, unused at start-up."""
        def write_kv(key, value, cache, slot_mapping):
            layer.impl.do_kv_cache_update(layer, key, value, cache, slot_mapping)

        slot_map = KVSlotMap.probe(write_kv, layer.kv_cache, block_dim, spec.block_size, spec.num_kv_heads,
                                   spec.head_size)
        slot_map.verify(write_kv, layer.kv_cache, self.kv_cache_config.num_blocks * spec.block_size - 1)
        return slot_map


def _with_extra_blocks(vllm_config, kv_cache_config, extra: int):
    """The same KV cache config with ``extra`` blocks per layer past the scheduler's ``num_blocks``."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    cache_config = vllm_config.cache_config
    saved = cache_config.num_gpu_blocks_override
    cache_config.num_gpu_blocks_override = kv_cache_config.num_blocks + extra
    try:
        grown = get_kv_cache_config_from_groups(vllm_config, kv_cache_config.kv_cache_groups, 0)
    finally:
        cache_config.num_gpu_blocks_override = saved
    return dataclasses.replace(grown, kv_cache_layout=kv_cache_config.kv_cache_layout,
                               hash_block_size=kv_cache_config.hash_block_size,
                               cache_hit_alignment_tokens=kv_cache_config.cache_hit_alignment_tokens)


def _tp_all_ranks():
    """With tensor parallelism, ``found -> every rank found`` over the TP group's CPU group."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() == 1:
        return None
    group = get_tp_group().cpu_group

    def all_ranks(found: bool) -> bool:
        flag = torch.tensor([int(found)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())
    return all_ranks


def _parallel_layout(parallel_config) -> str:
    return f"tp{parallel_config.tensor_parallel_size}-pp{parallel_config.pipeline_parallel_size}"
