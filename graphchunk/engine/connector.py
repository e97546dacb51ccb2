"""``GraphChunkConnector``: graphchunk's context reuse as vLLM sees it, through its KV-connector interface.

vLLM's scheduler asks a KV connector how many of a request's tokens, beyond its own prefix-cache
hit, come from elsewhere (``get_num_new_matched_tokens``); it then allocates their blocks, counts
them as computed, and budgets (``max_num_batched_tokens``) and schedules only the rest. For a
segmented request, graphchunk supplies its whole context (sys prompt and chunks, DESIGN.md §2):
the step that schedules it computes only its question, however long the context, and vLLM's
prefix-cache and connector metrics count the context as an external hit. A request whose chunks
all hit the pool loads synchronously (filled before the forward of the step that schedules it);
one with misses loads asynchronously: vLLM keeps it waiting, not scheduled, while the workers
compute its misses a budget per step (``graphchunk.miss_budget``), and the workers report it
loaded once they have filled its context.

Scheduler side: ``context_scheduler.ContextScheduler`` (the one pool index), sent to the workers
as each step's metadata. The pool's geometry, its key space and what the model allows of blend
mode come from the workers once, as handshake metadata, before the first request.

Worker side: the chunk-aware runner's engine (``chunk_engine.py``) runs the metadata; this class
reports what it finished (``get_finished``, ``build_connector_worker_meta``). The engine's work
runs from the runner's own hooks (``model_runner.py``), not from ``start_load_kv``: misses and
blend's recompute are pseudo-sequence forwards, whose attention metadata the backends build in the
same persistent buffers as the step's own, so they run before vLLM prepares the step (jobs, and
asynchronous loads' fills, as ``execute_model`` begins; this step's fills once vLLM has updated,
and zeroed, its blocks), where no connector method is called; and isolated mode's question
positions (``ChunkEngine.rewrite_positions``) have no connector equivalent at all.

vLLM finds the class through ``kv_transfer_config`` (``KV_CONNECTOR``, ``KV_CONNECTOR_MODULE``):
graphchunk's start-up sets it when the user named no connector (``connector_config``); it may stand
inside vLLM's ``MultiConnector`` beside other connectors, first (MultiConnector takes the first
child's handshake metadata).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.engine import fill_retry
from graphchunk.engine.connector_stats import GraphChunkPromMetrics, GraphChunkStats, take_stats
from graphchunk.engine.context_scheduler import ContextScheduler, PoolHandshake, StepWork

KV_CONNECTOR = "GraphChunkConnector"
KV_CONNECTOR_MODULE = "graphchunk.engine.connector"


@dataclasses.dataclass
class GraphChunkMetadata(KVConnectorMetadata):
    work: StepWork = dataclasses.field(default_factory=StepWork)


@dataclasses.dataclass
class GraphChunkHandshake(KVConnectorHandshakeMetadata):
    pool: PoolHandshake


@dataclasses.dataclass
class GraphChunkWorkerMeta(KVConnectorWorkerMetadata):
    done_before: int
    """The worker's first unfinished job."""
    failed: frozenset[int] = frozenset()
    """Epochs of pool entries the worker found not holding what was planned (they leave the index)."""
    refill: frozenset[str] = frozenset()
    """Requests whose context fill failed its check (they are planned again: ``fill_retry.py``)."""

    def aggregate(self, other: "GraphChunkWorkerMeta") -> "GraphChunkWorkerMeta":
        return GraphChunkWorkerMeta(min(self.done_before, other.done_before), self.failed | other.failed,
                                    self.refill | other.refill)


class _Worker:
    """What a worker process's engine (``ChunkEngine``) offers its connector."""

    engine = None


WORKER = _Worker()
"""This process's worker engine, once built (``kv_binding.bind_engine``)."""


class GraphChunkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = GraphChunkConfig.from_additional_config(vllm_config.additional_config)
        self._engine = vllm_config.parallel_config.data_parallel_index
        """This engine core's data-parallel index (each has its own pool; its metrics are its own)."""
        self._scheduler: ContextScheduler | None = None
        self._prefix_cache = None
        """vLLM's scheduler's KV-cache manager (``bind_kv_cache_manager``): invalid blocks lose their hashes."""

    # --- scheduler side -----------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        pools = {rank: m.pool for rank, m in metadata.items() if isinstance(m, GraphChunkHandshake)}
        if len(set(pools.values())) != 1:
            raise ConfigError(f"graphchunk: the workers report {len(set(pools.values()))} different chunk pools "
                              f"(ranks {sorted(pools)}); every rank must hold the same one")
        self._scheduler = ContextScheduler(self._config, next(iter(pools.values())), self._engine)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.sampling_params
        return self._context().matched(request.request_id, request.prompt_token_ids,
                                       (params.extra_args or {}) if params else {}, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        (block_ids,) = blocks.get_block_ids()
        self._context().allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> GraphChunkMetadata:
        return GraphChunkMetadata(self._context().metadata(scheduler_output))

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._prefix_cache = kv_cache_manager

    @property
    def requires_kv_delivery(self) -> bool:
        """True: a request vLLM preempts between a step and that step's output (asynchronous
        scheduling) recomputes its in-flight token instead of delivering it, which vLLM does for a
        connector that must deliver KV. A token is delivered only from a step whose output reported
        its context filled as planned: the step that read a failed fill may be the one in flight
        (``fill_retry.py``). Costs a preempted request one token, recomputed with the rest of it."""
        return True

    def before_output(self, scheduler, connector_output) -> None:
        """Before vLLM's scheduler processes a step's output (graphchunk's plugin wraps
        ``Scheduler.update_from_output``): every request that read a fill that failed its check goes
        back to vLLM's queue, to be planned again (``fill_retry.py``). Costs nothing on a step that
        reports no failed fill."""
        meta = worker_meta_of(connector_output)
        refill = meta.refill if meta is not None else ()
        invalid = connector_output.invalid_block_ids
        if not refill and not invalid:
            return
        context = self._context()
        for request in fill_retry.readers(scheduler, refill, invalid):
            if context.refill(request.request_id):
                fill_retry.requeue(scheduler, request)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, GraphChunkWorkerMeta):
            self._context().reported(meta.done_before, meta.failed)
        for req_id in connector_output.finished_recving or ():
            self._context().loaded(req_id)
        self._evict_invalid(connector_output.invalid_block_ids)

    def _evict_invalid(self, block_ids) -> None:
        """**Nothing a fill did not fill is served from vLLM's prefix cache.** vLLM hashes a
        synchronous load's blocks when it allocates them, before any worker has checked the fill;
        its ``_handle_invalid_blocks`` evicts them only for requests still running or waiting for
        their load when the workers' report arrives, which under asynchronous scheduling is a step
        later: a request preempted (or aborted) in between keeps the hashes, and it, or any
        request of the same salt and context, would take a prefix hit on blocks never filled. So
        every block the workers report invalid loses its hash here, whatever state its request is
        in (a block vLLM has since handed to another request loses a valid hash: a cache miss)."""
        if block_ids and self._prefix_cache is not None:
            self._prefix_cache.evict_blocks(set(block_ids))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._context().finished(request.request_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine stepping while the workers hold miss jobs not yet reported run (those
        of a request that left while waiting for them, or of a full prefill's entries): an idle
        engine runs no step, so they would keep their pool entries referenced until the next request
        (``vllm:graphchunk_pool_refs_held`` above 0 with nothing running). Each such step runs jobs at
        ``max_num_batched_tokens`` (nothing else runs)."""
        return self._scheduler is not None and self._scheduler.planner.has_jobs

    def take_events(self):
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def get_kv_connector_stats(self) -> GraphChunkStats | None:
        """What changed in graphchunk's metrics since the last call (``connector_stats.py``): the
        pool's, on the scheduler's side; the worker's, on rank 0's worker."""
        if self._scheduler is not None:
            return take_stats(self._scheduler.report)
        engine = WORKER.engine
        return take_stats(engine.report) if engine is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GraphChunkStats:
        return GraphChunkStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> GraphChunkPromMetrics:
        return GraphChunkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        self._context().reset()
        return True

    def _context(self) -> ContextScheduler:
        if self._scheduler is None:
            raise RuntimeError("graphchunk's connector has no chunk pool: the workers' handshake metadata never "
                               "came (in MultiConnector, graphchunk's connector must come first)")
        return self._scheduler

    # --- worker side: the engine runs the metadata from the runner's hooks (module docstring) ---

    def get_handshake_metadata(self) -> GraphChunkHandshake | None:
        engine = WORKER.engine
        return GraphChunkHandshake(engine.handshake()) if engine is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        engine = WORKER.engine
        return None, (engine.take_loaded() or None) if engine is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        engine = WORKER.engine
        return engine.take_invalid() if engine is not None else set()

    def build_connector_worker_meta(self) -> GraphChunkWorkerMeta | None:
        engine = WORKER.engine
        if engine is None:
            return None
        return GraphChunkWorkerMeta(engine.done_before, frozenset(engine.take_failed()),
                                    frozenset(engine.take_refill()))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return


def worker_meta_of(connector_output) -> GraphChunkWorkerMeta | None:
    """graphchunk's workers' report in a step's connector output: its own, or its part of
    ``MultiConnector``'s (graphchunk's connector comes first there)."""
    meta = connector_output.kv_connector_worker_meta
    if isinstance(meta, GraphChunkWorkerMeta):
        return meta
    parts = getattr(meta, "metadata", None)
    return parts[0] if parts and isinstance(parts[0], GraphChunkWorkerMeta) else None


def graphchunk_connector(connector) -> "GraphChunkConnector | None":
    """graphchunk's connector among a scheduler's: itself, or ``MultiConnector``'s first child."""
    if isinstance(connector, GraphChunkConnector):
        return connector
    children = getattr(connector, "sub_connectors", None)
    return children[0] if children and isinstance(children[0], GraphChunkConnector) else None


def work_of(kv_connector_metadata) -> StepWork:
    """graphchunk's work in a step's connector metadata: its own, or its part of ``MultiConnector``'s."""
    if isinstance(kv_connector_metadata, GraphChunkMetadata):
        return kv_connector_metadata.work
    for part in getattr(kv_connector_metadata, "metadata", ()):
        if isinstance(part, GraphChunkMetadata):
            return part.work
    return StepWork()


def connector_config(kv_transfer_config):
    """The ``kv_transfer_config`` a graphchunk engine runs with: graphchunk's connector alone when
    the user named none; the user's, when it names graphchunk's (alone, or inside MultiConnector)
    and keeps vLLM's default ``kv_load_failure_policy: fail``; refused otherwise, naming the setting."""
    from vllm.config import KVTransferConfig

    if kv_transfer_config is None:
        return KVTransferConfig(kv_connector=KV_CONNECTOR, kv_connector_module_path=KV_CONNECTOR_MODULE,
                                kv_role="kv_consumer")
    if kv_transfer_config.has_connector(KV_CONNECTOR):
        if kv_transfer_config.kv_load_failure_policy != "fail":
            raise ConfigError(
                f"--kv-transfer-config sets kv_load_failure_policy={kv_transfer_config.kv_load_failure_policy!r}: "
                f"graphchunk plans a request whose context fill fails its check again itself, and fails a request "
                f"whose context it cannot load through vLLM's KV-load-failure path; vLLM's recompute would compute "
                f"that context as an ordinary causal prompt instead (not the request's isolated or blend semantics); "
                f"leave it at 'fail', vLLM's default")
        return kv_transfer_config
    raise ConfigError(
        f"--kv-transfer-config names {kv_transfer_config.kv_connector!r} without graphchunk's connector: a "
        f"graphchunk engine loads its chunks' KV through it; put both in vLLM's MultiConnector, graphchunk's "
        f'first: {{"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
        f'{{"connectors": [{{"kv_connector": "{KV_CONNECTOR}", "kv_role": "kv_consumer"}}, ...]}}}}')


def register() -> None:
    """Makes ``GraphChunkConnector`` a name vLLM's connector factory knows (in every process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(KV_CONNECTOR, KV_CONNECTOR_MODULE, KV_CONNECTOR)
    except ValueError:  # registered already (the plugin loads once per process; this keeps it idempotent)
        pass
