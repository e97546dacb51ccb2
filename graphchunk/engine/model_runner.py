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

At start-up ``initialize_kv_cache`` binds the chunk pool, tier and blend mode into vLLM's KV
cache (``runner_bind.py``). The runner is also the plans' ``KVDevice`` (``runner_device.py``).

Slot mapping follows the logical index and was computed by vLLM before the rewrite.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from graphchunk.blend.recompute import RecomputePolicy
from graphchunk.cache.chunk_cache import ChunkCache, ScheduledPrompt
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.frontend import BOUNDARIES_ARG, MODE_ARG, RATIO_ARG, RECOMPUTE_ARG, SALT_ARG, TOKENS_ARG
from graphchunk.engine.runner_bind import PoolBindingMixin
from graphchunk.engine.runner_device import KVDeviceMixin
from graphchunk.engine.runner_templates import StepGraph, TemplateHooksMixin, past_vllm_compiled_graph
from graphchunk.graphs.buckets import RequestShape, load_grid
from graphchunk.graphs.templates import GraphTemplates
from graphchunk.metrics import METRICS_FILE_ENV, CacheMetrics, MetricsPublisher
from graphchunk.segments import SegmentedPrompt, split_at


class ChunkRunnerMixin(PoolBindingMixin, KVDeviceMixin, TemplateHooksMixin):
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
                                           past_vllm_compiled_graph) if config.templates else None
        self.gc_step: StepGraph | None = None
        path = os.environ.get(METRICS_FILE_ENV)
        self.gc_publisher = MetricsPublisher(path) if path else None

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
