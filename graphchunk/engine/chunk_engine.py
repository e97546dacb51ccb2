"""``ChunkEngine``: graphchunk's state inside vLLM's model runner, one object built at start-up.

The chunk-aware runner (``model_runner.py``) owns one engine, built when vLLM allocates the KV
cache (``kv_binding.bind_engine``): the runner of the scheduler's context plans (misses, tier,
fills: ``cache/context_run.py``), the ``KVDevice`` over the runner's KV cache (``runner_kv.py``),
what the model allows of blend mode, the pool's geometry (told to the scheduler once, as
handshake metadata: ``connector.py``), the grid's bucket counts, the metrics and their publisher,
and the segmented requests the worker holds. vLLM's hooks call it in step order:

``step``              (around ``execute_model``) forgets finished requests (and drops their pending
                      asynchronous loads, reported loaded unfilled: vLLM frees the blocks of a
                      request that left while it waited only once its load is reported), takes
                      the step's work from graphchunk's connector metadata (``context_scheduler``:
                      the host payloads the scheduler dropped, freed first;
                      the new segmented requests as the scheduler read them, jobs, fills,
                      asynchronous loads), computes misses up to the step's budget
                      (``graphchunk.miss_budget``), fills the asynchronous loads whose jobs have
                      all run (reported loaded to vLLM through the connector, also when the fill
                      failed its check: the request is then planned again, ``fill_retry.py``),
                      plans the step
                      (``step_plan.py``) and holds the plan while vLLM runs the step; after its
                      forward, fills the step's captured blend entries from the requests vLLM
                      has just prefilled (``ContextRunner.capture``);
``fill_context``      (``_prepare_inputs``, after vLLM updated and zeroed its blocks) fills the
                      context of this step's all-hit requests from the chunk pool; a fill that fails
                      its check leaves the request's blocks in ``take_invalid`` and the request in
                      ``take_refill`` (the connector reports both: the request is planned again,
                      ``fill_retry.py``); one the scheduler refused leaves its blocks in
                      ``take_invalid`` (vLLM fails the request);
``rewrite_positions`` (after vLLM prepared the batch) gives isolated requests' question and
                      generated tokens their RoPE positions (DESIGN.md §2), in one add;
``count_step``        (``_determine_batch_execution_and_padding``) counts how vLLM ran a step with a
                      cached-chunk prefill: on a graph at its size, padded, or eager.

A step's host work follows the step's work (DESIGN.md §10): requests are read once, by the
scheduler; planning reads only the requests still in their prompt (``prompting``); the position
rewrite is a fixed set of tensor operations over the step's tokens, whatever the batch holds.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import numpy as np
import torch

from graphchunk.cache.context_run import ContextRunner
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.connector import work_of
from graphchunk.engine.context_scheduler import ContextLoad, PoolHandshake
from graphchunk.engine.request_args import UNCHUNKED_ARG, ChunkRequest
from graphchunk.engine.runner_kv import RunnerKV
from graphchunk.engine.step_plan import StepPlan, plan_step
from graphchunk.graphs.bucket_counts import BucketCounts
from graphchunk.metrics import CacheMetrics, MetricsPublisher, StatsReport


@dataclasses.dataclass
class ChunkEngine:
    config: GraphChunkConfig
    metrics: CacheMetrics
    runner: ContextRunner
    kv: RunnerKV
    pool: PoolHandshake
    """The pool's geometry and key space, and what the model allows of blend mode: the handshake the
    scheduler's connector decides by which requests run segmented (the worker holds those it names,
    ``StepWork.requests``)."""
    max_num_batched_tokens: int
    counts: BucketCounts | None = None
    """The grid's bucket counts (``graphchunk.templates``); None: no grid."""
    publisher: MetricsPublisher | None = None
    """Publishes the metrics after every step for ``GraphChunkLLM.published_stats()``; None: nobody reads them."""
    report: StatsReport | None = None
    """The worker's metrics for vLLM's stats (the connector's ``get_kv_connector_stats``); None on
    tensor-parallel ranks past the first, which count the same steps."""
    requests: dict[str, ChunkRequest] = dataclasses.field(default_factory=dict)
    """The segmented requests the worker holds, by id (from the step that first schedules them to
    the step that names them finished)."""
    prompting: dict[str, ChunkRequest] = dataclasses.field(default_factory=dict)
    """Those whose prompt vLLM has not computed to its end yet (``plan_step`` reads only these: a
    decoding request costs the plan nothing)."""
    shifted: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Isolated requests whose question sits at other positions than its logical indices, by id:
    (context length, position offset) (``rewrite_positions``)."""
    plan: StepPlan | None = None
    """The plan of the step vLLM is running (inside ``step``), else None."""
    loads: list[ContextLoad] = dataclasses.field(default_factory=list)
    """Asynchronous loads waiting for their jobs."""
    loaded: set[str] = dataclasses.field(default_factory=set)
    """Requests whose asynchronous load is filled, not yet reported to vLLM."""

    @contextlib.contextmanager
    def step(self, so) -> Iterator[StepPlan]:
        """Runs the step's graphchunk work due before vLLM prepares scheduler output ``so``, and
        plans the rest; vLLM runs the step inside."""
        for req_id in so.finished_req_ids:
            self._forget(req_id)
        if self.loads and so.finished_req_ids:
            self._drop_loads(so.finished_req_ids)
        work = work_of(so.kv_connector_metadata)
        self.runner.drop_host(work.host_drops)
        self._register(so, work.requests)
        self.runner.add_jobs(work.jobs)
        self.runner.count(work.counts)
        self.loads += work.loads
        budget = self.config.miss_budget
        if not so.total_num_scheduled_tokens:  # nothing else runs: the step may take as much as vLLM's
            budget = max(budget, self.max_num_batched_tokens)
        with torch.inference_mode():
            self.runner.run_jobs(self.kv, budget)
            self._complete_loads()
        choose = self.counts.choose if self.counts is not None else None
        self.plan = plan_step(so, work.fills, self.prompting, choose)
        self.metrics.tokens_computed += self.plan.tokens_computed
        for req_id in self.plan.prompted:
            del self.prompting[req_id]
        try:
            yield self.plan
        finally:
            self.plan = None
        if work.captures:  # vLLM's forward of the step has written the requests' KV
            with torch.inference_mode():
                self.runner.capture(work.captures, self.kv, self.kv.request_blocks)
        self.publish()

    def _register(self, so, segmented) -> None:
        """Holds the step's new segmented requests (read once, by the scheduler's connector:
        ``StepWork.requests``), and counts the new requests whose documents ran as ordinary prompts.
        A request vLLM resumes after preemption computes its question again: it is prompting again."""
        for new_req in so.scheduled_new_reqs:
            params = new_req.sampling_params
            if params is not None and params.extra_args and params.extra_args.get(UNCHUNKED_ARG):
                self.metrics.documents_unchunked += 1
        for req_id, request in segmented:
            self.requests[req_id] = self.prompting[req_id] = request
            layout = request.seg.layout
            if request.policy is None and layout.position_offset:
                self.shifted[req_id] = (layout.context_len, layout.position_offset)
        for req_id in so.scheduled_cached_reqs.resumed_req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self.prompting[req_id] = request

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.prompting.pop(req_id, None)
        self.shifted.pop(req_id, None)

    def _drop_loads(self, finished) -> None:
        """Drops the pending loads of requests that left (aborted, failed) before their jobs ran,
        before this step's jobs run (their entries may be evicted now), and reports them loaded:
        vLLM frees a request that left while waiting for its load only once its load is reported
        (``Scheduler.finish_requests``), else its blocks and the request stay allocated for good."""
        dropped = {load.req_id for load in self.loads if load.req_id in finished}
        self.loads = [load for load in self.loads if load.req_id not in dropped]
        self.loaded |= dropped
        self.metrics.loads_dropped += len(dropped)

    def _complete_loads(self) -> None:
        """Fills the asynchronous loads whose jobs have all run, and reports every one of them
        loaded, filled or not: a fill that failed its check has left the request in ``take_refill``
        (the same step's output), so the request is planned again (``fill_retry.py``): vLLM frees
        its blocks once the load is reported."""
        done = [load for load in self.loads if load.needs < self.runner.done_before]
        if not done:
            return
        self.loads = [load for load in self.loads if load.needs >= self.runner.done_before]
        self.runner.copy([(load.prompt(), load.units) for load in done], self.kv)  # (isolated only)
        self.loaded.update(load.req_id for load in done)

    def fill_context(self) -> None:
        """Fills the context of the step's all-hit requests (vLLM has updated its block tables)."""
        if self.plan is None or not self.plan.fills:
            return
        fills = [load for load in self.plan.fills if not self._refuse(load)]
        with torch.inference_mode():
            self.runner.fill([(load.prompt(), load.units) for load in fills], self.kv)

    def _refuse(self, load: ContextLoad) -> bool:
        """A load the scheduler refused: the request's blocks are reported invalid (vLLM fails it)."""
        if load.refused is None:
            return False
        self.runner.fail(load.block_ids, load.refused)
        return True

    def take_invalid(self) -> set[int]:
        """Request blocks a fill could not fill as planned (vLLM's ``invalid_block_ids``: it fails
        their requests and evicts the blocks from its prefix cache)."""
        return self.runner.take_invalid()

    @property
    def done_before(self) -> int:
        return self.runner.done_before

    def take_failed(self) -> set[int]:
        """Epochs of pool entries found bad since the last call (``ContextRunner.take_failed``)."""
        return self.runner.take_failed()

    def take_refill(self) -> set[str]:
        """Requests whose fill failed its check since the last call (``ContextRunner.take_refill``)."""
        return self.runner.take_refill()

    def take_loaded(self) -> set[str]:
        loaded, self.loaded = self.loaded, set()
        return loaded

    def handshake(self) -> PoolHandshake:
        return self.pool

    def rewrite_positions(self, batch, query_start, positions: torch.Tensor) -> None:
        """On vLLM's prepared batch: ``query_start`` its requests' token offsets, ``positions`` its
        persistent position buffer. One host-to-device copy and one add, however many requests
        (``position_shift``)."""
        if not self.shifted:
            return
        rows = batch.req_id_to_index
        found = [(row, context_len, offset) for req_id, (context_len, offset) in self.shifted.items()
                 if (row := rows.get(req_id)) is not None]
        if not found:
            return
        row, context_len, offset = np.array(found, np.int64).T
        shift = position_shift(np.asarray(query_start), np.asarray(batch.num_computed_tokens_cpu), row, context_len,
                               offset)
        if shift is not None:
            positions[:len(shift)] += torch.from_numpy(shift).to(positions.device, non_blocking=True)

    def count_step(self, num_tokens: int, padded_tokens: int, ran_graph: bool) -> None:
        """Counts a step with a cached-chunk prefill: vLLM ran ``num_tokens`` tokens as
        ``padded_tokens`` on a graph (``ran_graph``) or eagerly."""
        if self.plan is None or not self.plan.counted:
            return
        outcome = ("padded" if padded_tokens > num_tokens else "replayed") if ran_graph else "eager"
        self.counts.count(outcome, self.plan.bucket)

    def publish(self) -> None:
        """After each step, in a process that exports its metrics (a metrics file is named,
        ``metrics.METRICS_FILE_ENV``: the API server's, or a GraphChunkLLM's): publishes the
        worker's counters (the pool's own are published where vLLM schedules)."""
        if self.publisher is not None:
            self.publisher.publish(self.metrics)

    def stats(self) -> dict[str, float]:
        return self.metrics.snapshot()


def position_shift(query_start: np.ndarray, num_computed: np.ndarray, row: np.ndarray, context_len: np.ndarray,
                   offset: np.ndarray) -> np.ndarray | None:
    """What to add to a step's positions (from the step's first token to the last one shifted):
    ``offset`` on every token of batch row ``row`` at or past its request's ``context_len`` (an
    isolated request's question and generated tokens, DESIGN.md §2), 0 elsewhere; None when no
    token moves. Vectorized over the rows: the step's cost does not multiply with its requests."""
    begin, end = query_start[row], query_start[row + 1]
    first = begin + np.maximum(0, context_len - num_computed[row])
    moves = first < end
    if not moves.any():
        return None
    first, end, offset = first[moves], end[moves], offset[moves]
    edges = np.zeros(int(end.max()) + 1, np.int64)
    edges[first] += offset  # the rows' ranges are disjoint: within each of these, indices are distinct
    edges[end] -= offset
    return np.cumsum(edges[:-1])
