"""Binding graphchunk into vLLM's KV cache at start-up: builds the runner's ``ChunkEngine``.

``grown_kv_cache_config`` grows vLLM's KV cache by the pool's blocks, past the scheduler's
``num_blocks``, so vLLM never hands them to a request. Once vLLM allocated it, ``bind_engine``
probes the attention backend's block layout (``kv_layout``: a layer's one cache tensor is probed on
a scratch; vllm-ascend's ``(k_cache, v_cache)`` pair is mapped from its strides, since its
attention keeps the first caches its write op is handed), and builds the pool, the levels below it
(``host_bytes``' host memory, ``store_path``'s directory), blend's key rotation and the engine
holding them. Anything the loaded model or
layout cannot support is refused here, at start-up.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import xxhash

from graphchunk.cache.context_run import ContextRunner
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.kv_slots import KVCopier, KVSlotMap
from graphchunk.cache.store import ChunkStore, StoreIdentity, read_store_key, weights_digest
from graphchunk.cache.tier import Tier
from graphchunk.compat import vllm_name
from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.engine.blend_support import BlendSupport
from graphchunk.engine.chunk_engine import ChunkEngine
from graphchunk.engine.connector import WORKER
from graphchunk.engine.context_scheduler import PoolHandshake
from graphchunk.engine.runner_kv import WARM_UP_QUESTION, RunnerKV
from graphchunk.graphs.bucket_counts import BucketCounts
from graphchunk.graphs.buckets import load_grid
from graphchunk.log import logger
from graphchunk.metrics import WORKER_FIELDS, CacheMetrics, MetricsPublisher, StatsReport, engine_metrics_file


def grown_kv_cache_config(vllm_config, kv_cache_config, extra: int):
    """The same KV cache config with ``extra`` blocks per layer past the scheduler's ``num_blocks``."""
    get_kv_cache_config_from_groups = vllm_name("get_kv_cache_config_from_groups")

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


def bind_engine(runner, config: GraphChunkConfig, first_pool_block: int) -> ChunkEngine:
    """The engine over ``runner``'s allocated KV cache, whose blocks from ``first_pool_block`` on are the pool's."""
    groups = runner.kv_cache_config.kv_cache_groups
    if len(groups) != 1 or any(g.kernel_block_size for g in runner.attn_groups[0]):
        raise ConfigError("graphchunk supports models whose layers share one full-attention KV cache group")
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.models.utils import extract_layer_index

    # In model order, so that the copier's layer i (CacheBlend's check layer) is decoder layer i.
    layer_names = sorted(groups[0].layer_names, key=extract_layer_index)
    forward_context = runner.compilation_config.static_forward_context
    layers = [forward_context[name] for name in layer_names]
    num_blocks = runner.kv_cache_config.num_blocks
    block_dim, slot_map = kv_layout(layers[0], groups[0].kv_cache_spec, num_blocks)
    copier = KVCopier([layer.kv_cache for layer in layers], slot_map, num_blocks, block_dim,
                      writers=[backend_write(layer) for layer in layers])
    metrics = CacheMetrics()
    block_size = runner.cache_config.block_size
    pool_blocks = config.pool_blocks(block_size)
    store = _store(runner, config, layers, copier, slot_map, metrics) if config.store_path else None
    tier = Tier(store, metrics, all_ranks=_tp_all_ranks()) if store else None
    host, host_tokens = _host(runner, config, layers, slot_map, metrics)
    model = runner.model_config
    # With a directory, keys name the weights (shared with other servers), else the model's path.
    space = KeySpace(model=store.identity.weights_digest if store else f"{model.model}@{model.revision or ''}",
                     dtype=str(model.dtype), parallel_layout=_parallel_layout(runner.parallel_config),
                     blend_prefix=blend_prefix_tokens(model, config.blend_prefix))
    max_tokens = runner.scheduler_config.max_num_batched_tokens
    context_runner = ContextRunner(block_size, max_tokens, metrics, check_layer=config.check_layer, tier=tier,
                                   host=host)
    blend = BlendSupport.of(runner.model, model.max_model_len, config)
    handshake = PoolHandshake(first_pool_block, pool_blocks, block_size, space, blend.refusal, blend.check_refusal,
                              host_tokens)
    counts = BucketCounts(load_grid(config.templates), metrics) if config.templates else None
    path = engine_metrics_file(runner.parallel_config.data_parallel_index)
    logger.info("graphchunk: chunk pool of %d blocks (%d tokens) at block ids [%d, %d)", pool_blocks,
                pool_blocks * block_size, first_pool_block, first_pool_block + pool_blocks)
    engine = ChunkEngine(config, metrics, context_runner, RunnerKV(runner, copier, blend, layers), handshake,
                         max_tokens, counts, MetricsPublisher(path, WORKER_FIELDS) if path else None,
                         StatsReport(metrics, WORKER_FIELDS) if get_tensor_model_parallel_rank() == 0 else None)
    warm = min(256, model.max_model_len, max_tokens)  # one forward
    if blend.refusal is None and pool_blocks * block_size >= warm > WARM_UP_QUESTION:
        start = time.perf_counter()
        engine.kv.warm_up(list(range(first_pool_block, first_pool_block + -(-warm // block_size))), warm)
        logger.info("graphchunk: vLLM's plain forward (blend's shallow scoring and check passes) warmed up in %.0f ms",
                    1000 * (time.perf_counter() - start))
    WORKER.engine = engine
    return engine


def backend_write(layer):
    """``layer``'s KV-write op, ``write(key, value, cache, slot_mapping)``: its backend's
    ``do_kv_cache_update``, what vLLM's attention calls to write a step's K/V."""
    def write_kv(key, value, cache, slot_mapping):
        layer.impl.do_kv_cache_update(layer, key, value, cache, slot_mapping)
    return write_kv


def kv_layout(layer, spec, num_blocks: int) -> tuple[int, KVSlotMap]:
    """(block dimension, slot map) of ``layer``'s real cache: one tensor (vLLM's backends) is
    probed, a ``(k_cache, v_cache)`` pair (vllm-ascend's) is mapped from its strides."""
    cache = layer.kv_cache
    if isinstance(cache, torch.Tensor):
        block_dim = list(cache.shape).index(num_blocks)
        return block_dim, probe_kv_layout(layer, spec, block_dim, num_blocks)
    return 0, split_kv_layout(layer, spec, num_blocks)


def split_kv_layout(layer, spec, num_blocks: int) -> KVSlotMap:
    """vllm-ascend's layout: ``layer.kv_cache`` is ``(k_cache, v_cache)``, each ``[blocks, block_size,
    heads, head_size]`` (``NPUModelRunner._reshape_kv_cache_tensors``). Its attention
    (``AscendAttentionBackendImpl.do_kv_cache_update``) keeps the first caches its write op is handed
    as the layer's for good, so no scratch is ever handed to it: the map comes from the pair's strides
    (``KVSlotMap.of_split``) and is checked through that op on the real pair's last pool slot (the
    caches it keeps are then the layer's own); the slot is restored."""
    cache = layer.kv_cache
    if len(cache) != 2:
        raise ConfigError(f"graphchunk needs each attention layer's KV cache as one tensor or a (K, V) pair; this "
                          f"one is {len(cache)} tensor(s) (vllm-ascend's sparse-attention caches)")
    try:
        slot_map = KVSlotMap.of_split(*cache)
    except ValueError as exc:  # MLA's nope and rope caches differ in head size
        raise ConfigError(f"graphchunk does not support this KV cache: {exc}") from None
    expected = [num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size]
    if list(cache[0].shape) != expected:
        raise ConfigError(f"graphchunk expected K and V caches of [blocks, block_size, heads, head_size] = {expected}, "
                          f"got {list(cache[0].shape)}")
    slot_map.verify(backend_write(layer), cache, num_blocks * spec.block_size - 1)
    return slot_map


def probe_kv_layout(layer, spec, block_dim: int, num_blocks: int) -> KVSlotMap:
    """The backend's placement of a slot's K/V in the real cache: probed through its own write op
    on a scratch with the real cache's strides (vLLM's resolved ``KVCacheLayout``), then checked
    on the real cache's last pool slot (past the scheduler's ``num_blocks``), unused at start-up."""
    write_kv = backend_write(layer)
    slot_map = KVSlotMap.probe(write_kv, layer.kv_cache, block_dim, spec.block_size, spec.num_kv_heads,
                               spec.head_size)
    slot_map.verify(write_kv, layer.kv_cache, num_blocks * spec.block_size - 1)
    return slot_map


def _host(runner, config: GraphChunkConfig, layers, slot_map: KVSlotMap,
          metrics: CacheMetrics) -> tuple[HostTier | None, int]:
    """Host memory below the pool (``host_bytes``, pinned on CUDA) and the tokens of KV it holds
    (what the scheduler's index budgets: every layer's K and V of a token, this rank's heads)."""
    if not config.host_bytes:
        return None, 0
    cache = layers[0].kv_cache if isinstance(layers[0].kv_cache, torch.Tensor) else layers[0].kv_cache[0]
    tokens = config.host_bytes // (len(layers) * 2 * int(slot_map.coords[0, 0].numel()) * cache.element_size())
    host = HostTier(config.host_bytes, metrics, pin=runner.device.type == "cuda", all_ranks=_tp_all_ranks())
    logger.info("graphchunk: host-memory chunk tier of %.1f GiB (%d tokens of KV)%s", host.budget / 2**30, tokens,
                " (pinned)" if host.pin else "")
    return host, tokens


def _store(runner, config: GraphChunkConfig, layers, copier: KVCopier, slot_map: KVSlotMap,
           metrics: CacheMetrics) -> ChunkStore:
    from vllm.distributed import get_tensor_model_parallel_rank

    model, layer = runner.model_config, layers[0]
    in_block = xxhash.xxh3_64_hexdigest(slot_map.coords.numpy().tobytes())
    identity = StoreIdentity(
        model_path=model.model, weights_digest=weights_digest(model.model, model.revision),
        kv_dtype=str((layer.kv_cache if isinstance(layer.kv_cache, torch.Tensor) else layer.kv_cache[0]).dtype),
        block_size=runner.cache_config.block_size,
        kv_layout=f"{type(layer.impl).__name__} block {copier.block_shape} in-block {in_block}",
        parallel=f"{_parallel_layout(runner.parallel_config)} rank {get_tensor_model_parallel_rank()}")
    key = read_store_key(config.store_key_file) if config.store_key_file else None
    store = ChunkStore(config.store_path, config.store_bytes, identity, len(layers), copier.block_shape, metrics,
                       mac_key=key)
    logger.info("graphchunk: persistent chunk tier at %s (%.1f of %.1f GiB used)", store.root,
                metrics.tier_bytes / 2**30, store.budget / 2**30)
    return store


def _tp_all_ranks():
    """With tensor parallelism, ``found -> every rank found`` over the TP group's CPU group."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() == 1:
        return None
    return lambda found: bool(tp_min(int(found)))


def tp_min(value: int) -> int:
    """The smallest of every tensor-parallel rank's ``value`` (a MIN all-reduce over the TP group's
    CPU group; ``value`` itself without tensor parallelism)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return int(flag.item())


def _parallel_layout(parallel_config) -> str:
    return f"tp{parallel_config.tensor_parallel_size}-pp{parallel_config.pipeline_parallel_size}"


def blend_prefix_tokens(model, text: str) -> tuple[int, ...]:
    """``text`` (``GraphChunkConfig.blend_prefix``) as the model's tokenizer encodes it, without
    special tokens (the tokenizer vLLM serves the model with: its name, revision and remote-code
    setting); () for no text."""
    if not text:
        return ()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model.tokenizer, revision=model.tokenizer_revision,
                                                           trust_remote_code=model.trust_remote_code)
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ConfigError(f"graphchunk.blend_prefix={text!r} encodes to no tokens")
    logger.info("graphchunk: blend chunks are computed after a fixed prefix of %d tokens (%r)", len(ids), text)
    return ids
