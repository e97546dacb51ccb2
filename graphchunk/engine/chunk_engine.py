"""``ChunkEngine``: graphchunk's state inside vLLM's model runner, one object built at start-up.

The chunk-aware runner (``model_runner.py``) owns one engine, built when vLLM allocates the KV
cache (``kv_binding.bind_engine``): the chunk cache (pool, tier, plans), the ``KVDevice`` over
the runner's KV cache (``runner_kv.py``), what the model allows of blend mode, the grid's bucket
counts, the metrics and their publisher, and the segmented requests the worker holds. vLLM's
hooks call it in step order:

``step``              (around ``execute_model``) forgets finished requests, reads new ones, plans
                      the step (``step_plan.py``) and holds the plan while vLLM runs it;
``fill_context``      (``_prepare_inputs``, after vLLM updated its block tables) fills the
                      planned context ranges from the chunk pool, computing misses first;
``rewrite_positions`` (after vLLM prepared the shrunk batch) gives isolated requests' question and
                      generated tokens their RoPE positions (DESIGN.md §2), and keeps dummy tokens
                      from writing KV;
``count_step``        (``_determine_batch_execution_and_padding``) counts how vLLM ran a step with a
                      cached-chunk prefill: on a graph at its size, padded, or eager.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch

from graphchunk.cache.chunk_cache import ChunkCache
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.blend_support import BlendSupport
from graphchunk.engine.frontend import UNCHUNKED_ARG, ChunkRequest, chunk_request
from graphchunk.engine.runner_kv import RunnerKV
from graphchunk.engine.step_plan import StepPlan, plan_step
from graphchunk.graphs.bucket_counts import BucketCounts
from graphchunk.metrics import CacheMetrics, MetricsPublisher


@dataclasses.dataclass
class ChunkEngine:
    config: GraphChunkConfig
    metrics: CacheMetrics
    cache: ChunkCache
    kv: RunnerKV
    blend: BlendSupport
    counts: BucketCounts | None = None
    """The grid's bucket counts (``graphchunk.templates``); None: no grid."""
    publisher: MetricsPublisher | None = None
    """Publishes the metrics after every step for the API process's /metrics; None: nobody reads them."""
    requests: dict[str, ChunkRequest] = dataclasses.field(default_factory=dict)
    plan: StepPlan | None = None
    """The plan of the step vLLM is running (inside ``step``), else None."""

    @contextlib.contextmanager
    def step(self, so) -> Iterator[StepPlan]:
        """Plans the step of scheduler output ``so``; vLLM runs the plan's scheduler output inside."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new_req in so.scheduled_new_reqs:
            self._register(new_req)
        choose = self.counts.choose if self.counts is not None else None
        self.plan = plan_step(so, self.requests, choose) if self.requests else StepPlan(so)
        self.metrics.tokens_computed += self.plan.tokens_computed
        try:
            yield self.plan
        finally:
            self.plan = None
        self.publish()

    def _register(self, new_req) -> None:
        args = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
        if args.get(UNCHUNKED_ARG):
            self.metrics.documents_unchunked += 1
        request = chunk_request(new_req.prompt_token_ids, args, self.config)
        if request is None or (request.policy is not None and not self.blend.runs(request.policy)):
            return  # an ordinary prompt: vLLM computes the full prefill (blend's target, too)
        self.requests[new_req.req_id] = request

    def fill_context(self, block_ids_of: Callable[[str], list[int]]) -> None:
        """Fills the plan's context ranges (``block_ids_of``: a request's KV blocks in vLLM's cache)."""
        if self.plan is None or not self.plan.fills:
            return
        prompts = [dataclasses.replace(prompt, block_ids=block_ids_of(req_id)) for req_id, prompt in self.plan.fills]
        with torch.inference_mode():
            self.cache.materialize(prompts, self.kv)

    def rewrite_positions(self, batch, query_start, positions: torch.Tensor) -> None:
        """On vLLM's prepared batch: ``query_start`` its requests' token offsets, ``positions`` its
        persistent position buffer."""
        if not self.requests:
            return
        dummies = self.plan.dummies if self.plan is not None else frozenset()
        slot_mapping = batch.block_table[0].slot_mapping
        for req_id, index in batch.req_id_to_index.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            begin, end = int(query_start[index]), int(query_start[index + 1])
            if req_id in dummies:  # its KV was copied in; keep the recomputed token from overwriting it
                slot_mapping.cpu[begin:end] = -1
                slot_mapping.gpu[begin:end] = -1
                continue
            if request.policy is not None:  # blend: ordinary positions
                continue
            layout = request.seg.layout
            first = begin + max(0, layout.context_len - int(batch.num_computed_tokens_cpu[index]))
            positions[first:end] += layout.position_offset

    def count_step(self, num_tokens: int, padded_tokens: int, ran_graph: bool) -> None:
        """Counts a step with a cached-chunk prefill: vLLM ran ``num_tokens`` tokens as
        ``padded_tokens`` on a graph (``ran_graph``) or eagerly."""
        if self.plan is None or not self.plan.counted:
            return
        outcome = ("padded" if padded_tokens > num_tokens else "replayed") if ran_graph else "eager"
        self.counts.count(outcome, self.plan.bucket)

    def publish(self) -> None:
        """After each step, in a process that exports its metrics (a metrics file is named,
        ``metrics.METRICS_FILE_ENV``: the API server's, or a GraphChunkLLM's): audits the pool, a
        walk over its entries every step, and publishes the counters."""
        if self.publisher is not None:
            self.cache.pool.audit()
            self.publisher.publish(self.metrics)

    def stats(self) -> dict[str, float]:
        self.cache.pool.audit()
        return self.metrics.snapshot()

    def reset_pool(self) -> int:
        """Drops every cached pool entry (between steps none is in use); the tier keeps its files."""
        return self.cache.pool.clear()
