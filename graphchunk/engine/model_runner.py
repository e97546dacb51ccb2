"""The chunk-aware model runner: vLLM's own runner plus a chunk pool and a step hook.

Mixed into the platform's runner class (``chunk_runner_class``); per step:

``execute_model``  reads segmentations of new requests, and for every segmented request whose
                   scheduled range overlaps its context moves the start of the range the runner
                   computes itself to the question (``ScheduledPrompt.compute_start``);
``_prepare_inputs`` (after vLLM updated its block tables) fills the context slots from the
                   chunk pool — computing misses first — then lets vLLM prepare the shrunken
                   batch and rewrites RoPE positions of question and generated tokens (§2);
``_determine_batch_execution_and_padding`` / ``_model_forward``
                   run a step whose requests compute only their question over cached context on
                   its bucket's graph (graphchunk's template, or vLLM's own graph at that size)
                   and count how each cached-chunk prefill ran (``runner_templates.py``).

The runner is also the plans' ``KVDevice`` (``runner_device.py``).

Slot mapping follows the logical index and was computed by vLLM before the rewrite.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch
import xxhash

from graphchunk.blend.recompute import RecomputePolicy
from graphchunk.blend.rope import KeyRotation
from graphchunk.cache.chunk_cache import ChunkCache, ScheduledPrompt
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.kv_slots import KVCopier, KVSlotMap
from graphchunk.cache.pool import ChunkPool
from graphchunk.cache.store import ChunkStore, StoreIdentity, weights_digest
from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.engine.frontend import BOUNDARIES_ARG, MODE_ARG, RATIO_ARG, RECOMPUTE_ARG, SALT_ARG, TOKENS_ARG
from graphchunk.engine.runner_device import KVDeviceMixin, decoder_stack
from graphchunk.engine.runner_templates import StepGraph, TemplateHooksMixin
from graphchunk.graphs.buckets import RequestShape, load_grid
from graphchunk.graphs.templates import GraphTemplates
from graphchunk.metrics import METRICS_FILE_ENV, CacheMetrics, MetricsPublisher
from graphchunk.segments import SegmentedPrompt, split_at

logger = logging.getLogger("graphchunk")



class ChunkRunnerMixin(KVDeviceMixin, TemplateHooksMixin):
    """Methods added to a vLLM v1 GPUModelRunner subclass; ``graphchunk_setup`` initialises them."""

    def graphchunk_setup(self, config: GraphChunkConfig) -> None:
        self.gc_config = config
        self.gc_metrics = CacheMetrics()
        self.gc_prompts: dict[str, tuple[SegmentedPrompt, str | None, RecomputePolicy | None]] = {}
        """Segmented requests: segmentation, KV salt, and blend mode's policy (None: isolated)."""
        self.gc_pending: list[tuple[str, ScheduledPrompt]] = []
        self.gc_dummy: set[str] = set()
        self.gc_cache: ChunkCache | None = None
        self.gc_templates = GraphTemplates(load_grid(config.templates), self.gc_metrics, self._forward_context_reads,
                                           _past_vllm_compiled_graph) if config.templates else None
        self.gc_step: StepGraph | None = None
        path = os.environ.get(METRICS_FILE_ENV)
        self.gc_publisher = MetricsPublisher(path) if path else None

    # --- KV cache with pool blocks ---------------------------------------------------------------

    def pool_num_blocks(self) -> int:
        return -(-self.gc_config.pool_tokens // self.cache_config.block_size)

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, kv_cache_allocation_context=None):
        if is_profiling:
            return super().initialize_kv_cache(kv_cache_config, is_profiling, kv_cache_allocation_context)
        num_blocks = kv_cache_config.num_blocks
        grown = _with_extra_blocks(self.vllm_config, kv_cache_config, self.pool_num_blocks())
        super().initialize_kv_cache(grown, is_profiling, kv_cache_allocation_context)
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
        slot_map = self._probe_kv_layout(self.gc_layers[0], groups[0].kv_cache_spec)
        num_blocks = self.kv_cache_config.num_blocks
        self.gc_copier = KVCopier([layer.kv_cache for layer in self.gc_layers], slot_map, num_blocks,
                                  list(self.gc_layers[0].kv_cache.shape).index(num_blocks))
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

    def _probe_kv_layout(self, layer, spec) -> KVSlotMap:
        kv = layer.kv_cache
        block_dim = list(kv.shape).index(self.kv_cache_config.num_blocks)

        def make_cache(num_blocks):
            shape = list(kv.shape)
            shape[block_dim] = num_blocks
            return torch.zeros(shape, dtype=kv.dtype, device=kv.device)

        def write_kv(key, value, cache, slot_mapping):
            layer.impl.do_kv_cache_update(layer, key, value, cache, slot_mapping)

        return KVSlotMap.probe(write_kv, make_cache, spec.block_size, spec.num_kv_heads, spec.head_size,
                               kv.dtype, kv.device)

    # --- step ------------------------------------------------------------------------------------

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        so = scheduler_output
        self.gc_step = None
        for req_id in so.finished_req_ids:
            self.gc_prompts.pop(req_id, None)
        for new_req in so.scheduled_new_reqs:
            self._register(new_req)
        if self.gc_prompts and self.gc_cache is not None:
            so = self._plan_step(so)
        output = super().execute_model(so, intermediate_tensors)
        self._publish()
        return output

    def _publish(self) -> None:
        """After each step, for /metrics: the pool's audit walks its entries, so only when read."""
        if self.gc_publisher is not None:
            self._audit_pool()
            self.gc_publisher.publish(self.gc_metrics)

    def _audit_pool(self) -> None:
        if self.gc_cache is not None:
            self.gc_cache.pool.audit()

    def _register(self, new_req) -> None:
        args = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
        boundaries = args.get(BOUNDARIES_ARG)
        if boundaries is None:
            return
        seg = split_at(new_req.prompt_token_ids, boundaries, max_chunks=self.gc_config.max_chunks,
                       max_chunk_len=self.gc_config.max_chunk_len)
        if not seg.layout.num_chunks:
            return
        policy = None
        if args.get(MODE_ARG, self.gc_config.mode) == "blend":
            policy = self._blend_policy(args)
            if policy is None:  # an ordinary prompt: vLLM computes the full prefill
                return
        self.gc_prompts[new_req.req_id] = (seg, args.get(SALT_ARG), policy)

    def _blend_policy(self, args: dict) -> RecomputePolicy | None:
        """The recompute policy the frontend resolved; None when this model cannot blend."""
        config = self.gc_config
        policy = RecomputePolicy(args.get(RECOMPUTE_ARG, config.recompute), args.get(RATIO_ARG, config.recompute_ratio),
                                 args.get(TOKENS_ARG, config.recompute_tokens))
        if self.gc_rotation is None or (policy.needs_check and self.gc_check_refusal):
            return None
        return policy

    def _plan_step(self, so):
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        shrink, self.gc_pending, self.gc_dummy = {}, [], set()
        questions = []  # requests computing only question tokens over their context this step
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            if req_id not in self.gc_prompts:
                continue
            seg, salt, policy = self.gc_prompts[req_id]
            lay = seg.layout
            start, end = computed[req_id], computed[req_id] + num_tokens
            prompt = ScheduledPrompt(seg, salt, start, end, (), policy)
            own_start = prompt.compute_start()
            self.gc_metrics.tokens_computed += max(0, min(end, lay.num_tokens) - max(own_start, start))
            if start < lay.context_len:  # also when own_start == start: one context token scheduled
                self.gc_pending.append((req_id, prompt))
                shrink[req_id] = own_start
                if own_start < lay.context_len:
                    self.gc_dummy.add(req_id)
            if lay.context_len <= own_start < lay.num_tokens:
                questions.append(RequestShape(lay.sys_len, lay.chunk_lens, end - own_start))
        if questions and self.gc_templates is not None and self.gc_templates.enabled:
            only_questions = len(questions) == len(so.num_scheduled_tokens)
            self.gc_step = StepGraph(self.gc_templates.choose(questions if only_questions else None))
        return _shrunk(so, computed, shrink) if shrink else so

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if self.gc_pending:
            prompts = [dataclasses.replace(prompt, block_ids=self.requests[req_id].block_ids[0])
                       for req_id, prompt in self.gc_pending]
            self.gc_pending = []
            with torch.inference_mode():
                self.gc_cache.materialize(prompts, self)
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.gc_prompts:
            self._rewrite_positions()
        return result

    def _rewrite_positions(self) -> None:
        batch = self.input_batch
        query_start = self.query_start_loc.np
        slot_mapping = batch.block_table[0].slot_mapping
        for req_id, index in batch.req_id_to_index.items():
            if req_id not in self.gc_prompts:
                continue
            seg, _, policy = self.gc_prompts[req_id]
            layout = seg.layout
            begin, end = int(query_start[index]), int(query_start[index + 1])
            if req_id in self.gc_dummy:  # its KV was copied in; keep the recomputed token from overwriting it
                slot_mapping.cpu[begin:end] = -1
                slot_mapping.gpu[begin:end] = -1
                continue
            if policy is not None:  # blend: ordinary positions
                continue
            first = begin + max(0, layout.context_len - int(batch.num_computed_tokens_cpu[index]))
            self.positions[first:end] += layout.position_offset

    def graphchunk_reset_pool(self) -> int:
        """Drops every cached pool entry (between steps none is in use); the tier keeps its files."""
        return self.gc_cache.pool.clear() if self.gc_cache is not None else 0

    def graphchunk_stats(self) -> dict[str, float]:
        self._audit_pool()
        return self.gc_metrics.snapshot()


@contextlib.contextmanager
def _past_vllm_compiled_graph():
    """vLLM's compiled models run their plain forward while the forward context says so."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    saved, context.skip_compiled = context.skip_compiled, True
    try:
        yield
    finally:
        context.skip_compiled = saved


def chunk_runner_class(base: type) -> type:
    return type(f"GraphChunk{base.__name__}", (ChunkRunnerMixin, base), {})


def _shrunk(so, computed: dict[str, int], new_starts: dict[str, int]):
    """A copy of the scheduler output whose requests in ``new_starts`` compute from there on
    (``computed``: each scheduled request's original start)."""
    num_tokens = dict(so.num_scheduled_tokens)
    removed = 0
    new_reqs = []
    for req in so.scheduled_new_reqs:
        if req.req_id in new_starts:
            req = dataclasses.replace(req, num_computed_tokens=new_starts[req.req_id])
        new_reqs.append(req)
    cached = so.scheduled_cached_reqs
    cached_computed = [new_starts.get(r, n) for r, n in zip(cached.req_ids, cached.num_computed_tokens)]
    for req_id, start in new_starts.items():
        num_tokens[req_id] -= start - computed[req_id]
        removed += start - computed[req_id]
    return dataclasses.replace(
        so, scheduled_new_reqs=new_reqs, num_scheduled_tokens=num_tokens,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens - removed,
        scheduled_cached_reqs=dataclasses.replace(cached, num_computed_tokens=cached_computed))


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
