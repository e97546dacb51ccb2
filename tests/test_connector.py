"""graphchunk's KV connector under vLLM's own scheduler (no model; the workers' side of the protocol
played by the test): what vLLM schedules for segmented requests, the work the connector sends the
workers, the pool references it holds, and the connector's configuration."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from graphchunk.cache.keys import KeySpace
from graphchunk.config import ConfigError
from graphchunk.engine.connector import (KV_CONNECTOR, GraphChunkHandshake, GraphChunkMetadata, GraphChunkWorkerMeta,
                                         connector_config, graphchunk_connector, work_of, worker_meta_of)
from graphchunk.engine.context_scheduler import PoolHandshake, StepWork
from graphchunk.engine.kv_events import event_blocks
from graphchunk.engine.frontend import kv_salt
from graphchunk.engine.request_args import BOUNDARIES_ARG, SALT_ARG
from graphchunk.metrics import METRICS_FILE_ENV

BLOCK = 32
BUDGET = 64


@pytest.fixture(scope="module")
def make_scheduler(smollm2_path):
    """vLLM's Scheduler as its engine core builds it, with graphchunk's connector (isolated mode,
    prefix caching on, a budget of 64 tokens per step) over a KV cache of 100 blocks."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from graphchunk.engine import plugin

    plugin.register()
    model = ModelConfig(model=str(smollm2_path), dtype="float32", max_model_len=2048)
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8, max_model_len=2048,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        kv_transfer_config=connector_config(None), additional_config={"graphchunk": {"mode": "isolated"}})
    config.cache_config.num_gpu_blocks = 100
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)

    def make(pool_blocks: int = 64):
        scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK)
        pool = PoolHandshake(100, pool_blocks, BLOCK, KeySpace("m", "f32"), None, None)
        with mock.patch.dict(os.environ):  # not into the metrics file of an engine this process holds
            os.environ.pop(METRICS_FILE_ENV, None)
            scheduler.connector.set_xfer_handshake_metadata({0: GraphChunkHandshake(pool)})
        return scheduler, hasher

    return make


def request(req_id: str, token_ids: list[int], boundaries: list[int] | None, hasher, max_tokens: int = 4):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, extra_args={BOUNDARIES_ARG: boundaries} if boundaries else {})
    return Request(req_id, token_ids, params, None, block_hasher=hasher)


def worker_output(so, done_before: int, loaded=()):
    """What the workers return for step ``so``: a token per scheduled request, their first
    unfinished job, and the requests whose asynchronous load they filled."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7] for _ in req_ids],
                             kv_connector_output=KVConnectorOutput(finished_recving=set(loaded) or None,
                                                                   kv_connector_worker_meta=GraphChunkWorkerMeta(done_before)))


def step(scheduler, done_before: int, loaded=()):
    so = scheduler.schedule()
    scheduler.update_from_output(so, worker_output(so, done_before, loaded))
    return so, work_of(so.kv_connector_metadata)


def reconfigure(context, **changes) -> None:
    """The scheduler's settings changed in place, its admission's with them."""
    context.config = context.admission.config = dataclasses.replace(context.config, **changes)


SYS, C1, C2 = list(range(1000, 1040)), list(range(2000, 2110)), list(range(3000, 3130))
Q = list(range(4000, 4020))


def test_misses_load_asynchronously_and_then_only_the_question_is_scheduled(make_scheduler):
    """A 280-token context (over the 64-token budget) of three misses: vLLM keeps the request waiting
    while the workers run its three jobs; once they report it loaded it is scheduled with its
    20-token question alone, its context counted as computed."""
    scheduler, hasher = make_scheduler()
    scheduler.add_request(request("r", SYS + C1 + C2 + Q, [40, 150, 280], hasher))
    so, work = step(scheduler, done_before=0)
    assert so.num_scheduled_tokens == {} and not work.fills
    assert [len(j.token_ids) for j in work.jobs] == [40, 150, 170]  # sys; sys + chunk (isolated) twice
    (load,) = work.loads
    assert (load.req_id, load.start, load.end, load.needs) == ("r", 0, 280, 2)
    assert [(u.lo, u.hi, u.kind) for u in load.units] == [(0, 40, "sys"), (40, 150, "chunk"), (150, 280, "chunk")]
    held = scheduler.connector._context().pool.metrics
    so, work = step(scheduler, done_before=3, loaded={"r"})  # the workers ran the jobs and filled r
    so, work = step(scheduler, done_before=3)
    assert so.num_scheduled_tokens == {"r": 20} and so.scheduled_new_reqs[0].num_computed_tokens == 280
    assert not work.fills and not work.jobs
    assert held.pool_refs_held == 0  # the plan was released once loaded; the jobs once run


def test_an_all_hit_context_beyond_the_budget_is_filled_in_the_step_that_schedules_its_question(make_scheduler):
    scheduler, hasher = make_scheduler()
    scheduler.add_request(request("a", SYS + C1 + C2 + Q, [40, 150, 280], hasher))
    step(scheduler, done_before=0)
    step(scheduler, done_before=3, loaded={"a"})
    # the same chunks in the other order, another question: every chunk a pool hit
    scheduler.add_request(request("b", SYS + C2 + C1 + list(range(5000, 5012)), [40, 170, 280], hasher))
    so, work = step(scheduler, done_before=3)
    assert so.num_scheduled_tokens["b"] == 12 and so.has_sync_kv_loads
    new = {r.req_id: r for r in so.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == 40 + 130 + 110  # the sys blocks from vLLM's prefix cache (32), the rest loaded
    (fill,) = work.fills
    assert (fill.req_id, fill.start, fill.end, fill.needs) == ("b", 32, 280, -1) and not work.jobs
    assert list(fill.block_ids) == list(new["b"].block_ids[0])


def test_a_request_waiting_for_another_ones_job_needs_it(make_scheduler):
    scheduler, hasher = make_scheduler()
    scheduler.add_request(request("a", SYS + C1 + Q, [40, 150], hasher))
    _, first = step(scheduler, done_before=0)
    scheduler.add_request(request("b", SYS + C1 + list(range(6000, 6010)), [40, 150], hasher))
    _, second = step(scheduler, done_before=0)
    (load,) = second.loads
    assert not second.jobs and load.needs == first.loads[0].needs  # computed once, waited for twice


def test_a_full_pool_defers_a_request_an_abort_releases_its_plan_and_one_that_never_fits_is_refused(make_scheduler):
    """A request waits while other requests' entries hold the pool, and runs once they are gone; a
    request whose context cannot fit even the empty pool is refused at once (its fill carries the
    reason: the workers fail it through vLLM's KV-load-failure path), without waiting for the pool
    to empty, reserving its room or evicting anything."""
    from vllm.v1.request import RequestStatus

    scheduler, hasher = make_scheduler(pool_blocks=8)
    pool = scheduler.connector._context().pool
    scheduler.add_request(request("b", SYS + C1 + Q, [40, 150], hasher))  # fits: 2 + 5 blocks
    so, work = step(scheduler, done_before=0)
    assert [load.req_id for load in work.loads] == ["b"]
    scheduler.add_request(request("c", SYS + C2 + Q, [40, 170], hasher))  # fits alone: 2 + 5 blocks
    so, work = step(scheduler, done_before=0)
    assert so.num_scheduled_tokens == {} and not work.loads and not work.jobs  # waits: b holds the pool
    assert pool.metrics.pool_refs_held > 0
    scheduler.add_request(request("a", SYS + C1 + C2 + Q, [40, 150, 280], hasher))  # needs 2 + 5 + 5 blocks
    evictions = pool.metrics.evictions
    so, work = step(scheduler, done_before=0)
    (fill,) = work.fills  # refused at once, though b still holds the pool
    assert fill.req_id == "a" and "cannot fit the chunk pool even when empty" in fill.refused and not fill.units
    assert so.num_scheduled_tokens == {"a": 20} and pool.metrics.evictions == evictions
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    step(scheduler, done_before=2)  # the workers report b's jobs run (after this step's schedule)
    so, work = step(scheduler, done_before=2)  # nothing holds the pool now: c is planned
    assert [load.req_id for load in work.loads] == ["c"]
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    step(scheduler, done_before=4)
    step(scheduler, done_before=4)
    assert pool.metrics.pool_refs_held == 0
    pool.check_invariants()


def test_a_blend_request_that_never_fits_runs_as_vllms_full_prefill(make_scheduler):
    """A question-policy blend request whose context cannot fit even the empty pool is not refused:
    vLLM computes its full prefill (blend's target), counted in ``blend_full_prefills``."""
    scheduler, hasher = make_scheduler(pool_blocks=8)
    blend = request("a", SYS + C1 + C2 + Q, [40, 150, 280], hasher)  # 2 + 4 + 5 blocks
    blend.sampling_params.extra_args.update({"graphchunk_mode": "blend", "graphchunk_recompute": "question"})
    scheduler.add_request(blend)
    so, work = step(scheduler, done_before=0)
    assert so.num_scheduled_tokens == {"a": BUDGET} and not work.fills and not work.jobs
    assert scheduler.connector._context().metrics.blend_full_prefills == 1


def test_a_fill_holds_its_entries_until_the_step_is_sent_whatever_vllm_plans_after_it(make_scheduler):
    """One schedule() plans an all-hit request, then a request whose misses need room: the second
    must not evict what the first copies in this very step (the workers run a step's jobs before its
    fills). Found as wrong tokens for the all-hit prompt of one request body."""
    scheduler, hasher = make_scheduler(pool_blocks=16)
    scheduler.add_request(request("a", SYS + C1 + C2 + Q, [40, 150, 280], hasher))  # 2 + 4 + 5 of 16 blocks
    step(scheduler, done_before=0)
    step(scheduler, done_before=3, loaded={"a"})
    while scheduler.has_unfinished_requests():
        step(scheduler, done_before=3)
    c3, c4 = list(range(7000, 7110)), list(range(8000, 8130))
    scheduler.add_request(request("a-reversed", SYS + C2 + C1 + Q, [40, 170, 280], hasher))
    scheduler.add_request(request("b", SYS + c3 + c4 + Q, [40, 150, 280], hasher))  # 9 new blocks, 5 free
    so, work = step(scheduler, done_before=3)
    (fill,) = work.fills
    read = {block for unit in fill.units for block in unit.entry_blocks}
    written = {block for job in work.jobs for block in job.entry_blocks}
    assert fill.req_id == "a-reversed" and not read & written
    assert "b" not in so.num_scheduled_tokens  # it waits for room: the fill's entries were in use
    so, work = step(scheduler, done_before=3)  # released once the step was sent: b's misses evict now
    assert [load.req_id for load in work.loads] == ["b"] and len(work.jobs) == 2
    assert {block for job in work.jobs for block in job.entry_blocks} & read


def test_ordinary_requests_load_nothing(make_scheduler):
    scheduler, hasher = make_scheduler()
    scheduler.add_request(request("plain", list(range(2000, 2100)), None, hasher))
    so, work = step(scheduler, done_before=0)
    assert so.num_scheduled_tokens == {"plain": BUDGET} and work == StepWork()
    assert not so.has_sync_kv_loads


def test_work_is_found_alone_or_inside_multiconnector_metadata():
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorMetadata

    work = StepWork(counts=(("lookups", 1, "isolated"),))
    ours = GraphChunkMetadata(work)
    assert work_of(ours) is work
    assert work_of(MultiKVConnectorMetadata(metadata=(object(), ours))) is work
    assert work_of(None) == StepWork()


def test_the_workers_report_and_the_connector_are_found_alone_or_inside_multiconnector(make_scheduler):
    """What the scheduler's wrapper reads before vLLM processes a step's output (``fill_retry.py``):
    graphchunk's part of MultiConnector's worker report (first, as graphchunk's connector is), and
    graphchunk's connector as MultiConnector's first child; nothing for other connectors."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    meta = GraphChunkWorkerMeta(3, frozenset({5}), frozenset({"r"}))
    assert worker_meta_of(KVConnectorOutput(kv_connector_worker_meta=meta)) is meta
    multi = MultiKVConnectorWorkerMetadata(metadata=(meta, None))
    assert worker_meta_of(KVConnectorOutput(kv_connector_worker_meta=multi)) is meta
    assert worker_meta_of(KVConnectorOutput()) is None
    assert meta.aggregate(GraphChunkWorkerMeta(2, frozenset(), frozenset({"s"}))) == \
        GraphChunkWorkerMeta(2, frozenset({5}), frozenset({"r", "s"}))
    scheduler, _ = make_scheduler()
    ours = scheduler.connector
    assert graphchunk_connector(ours) is ours and ours.requires_kv_delivery
    assert graphchunk_connector(SimpleNamespace(sub_connectors=[ours, object()])) is ours
    assert graphchunk_connector(SimpleNamespace(sub_connectors=[object(), ours])) is None
    assert graphchunk_connector(None) is None


def test_connector_config_adds_graphchunks_connector_or_refuses_one_without_it():
    from vllm.config import KVTransferConfig

    added = connector_config(None)
    assert added.kv_connector == KV_CONNECTOR and added.kv_role == "kv_consumer"
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
        "connectors": [{"kv_connector": KV_CONNECTOR, "kv_role": "kv_consumer"},
                       {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]})
    assert connector_config(multi) is multi
    with pytest.raises(ConfigError, match="--kv-transfer-config names 'ExampleConnector' without graphchunk"):
        connector_config(KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))
    # graphchunk fails a request it refuses through vLLM's KV-load-failure path: 'recompute' would
    # compute its context as an ordinary causal prompt instead
    with pytest.raises(ConfigError, match="kv_load_failure_policy='recompute'"):
        connector_config(KVTransferConfig(kv_connector=KV_CONNECTOR, kv_role="kv_consumer",
                                          kv_load_failure_policy="recompute"))


def test_pool_entries_stored_and_removed_are_published_as_kv_events(make_scheduler):
    """vLLM publishes what the connector's ``take_events`` returns on its KV-event stream
    (``--kv-events-config``): an entry once its job has run (BlockStored: its content key, its
    tokens), and once dropped (BlockRemoved), medium 'graphchunk'."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    scheduler, hasher = make_scheduler()
    published = []
    scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    scheduler.add_request(request("r", SYS + C1 + C2 + Q, [40, 150, 280], hasher))
    _, work = step(scheduler, done_before=0)
    assert not [e for e in published if isinstance(e, BlockStored) and e.medium == "graphchunk"]
    step(scheduler, done_before=3, loaded={"r"})
    stored = [e for e in published if isinstance(e, BlockStored) and e.medium == "graphchunk"]
    assert [e.token_ids for e in stored] == [SYS, SYS + C1, SYS + C2]
    block_size = BLOCK
    # Each entry a chain of vLLM-sized blocks from its first token, the first hashed by its content key.
    assert all(e.block_size == block_size and e.parent_block_hash is None for e in stored)
    assert [e.block_hashes for e in stored] == [event_blocks(job.key, e.token_ids, block_size)
                                                for job, e in zip(work.jobs, stored)]
    assert [len(e.block_hashes) for e in stored] == [-(-len(e.token_ids) // block_size) for e in stored]
    assert [e.block_hashes[0] for e in stored] == [job.key for job in work.jobs]
    step(scheduler, done_before=3)  # r runs its question, finishes later; its entries stay cached
    while scheduler.requests:
        step(scheduler, done_before=3)
    assert scheduler.reset_prefix_cache(reset_connector=True)
    step(scheduler, done_before=3)
    removed = [e for e in published if isinstance(e, BlockRemoved) and e.medium == "graphchunk"]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(h for e in stored for h in e.block_hashes)


def test_a_blend_request_with_misses_waits_unallocated_then_loads_in_the_step_that_schedules_it(make_scheduler):
    """vLLM publishes an asynchronous load's blocks to its prefix cache when the load completes, but
    blend's recompute runs the question over the request's own blocks, so it can only run once the
    request is scheduled: a blend request with misses is not loaded asynchronously. It waits, its
    jobs sent, without blocks; once they have run it loads synchronously (fill and recompute before
    the forward of the step that schedules it)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    scheduler, hasher = make_scheduler()
    context = scheduler.connector._context()
    reconfigure(context, blend_misses="blend")  # else prefilled: the next test
    params = SamplingParams(max_tokens=4, extra_args={BOUNDARIES_ARG: [40, 150], "graphchunk_mode": "blend"})
    scheduler.add_request(Request("b", SYS + C1 + Q, params, None, block_hasher=hasher))
    so, work = step(scheduler, done_before=0)
    assert not work.loads and not work.fills and len(work.jobs) == 2 and not so.num_scheduled_tokens
    assert scheduler.requests["b"].status == RequestStatus.WAITING  # not WAITING_FOR_REMOTE_KVS: no blocks
    assert scheduler.kv_cache_manager.get_block_ids("b") == ([],)
    so, work = step(scheduler, done_before=0)  # still running: no new jobs, nothing scheduled
    assert not work.jobs and not so.num_scheduled_tokens
    so, work = step(scheduler, done_before=2)  # reported after this step's schedule
    so, work = step(scheduler, done_before=2)
    assert so.num_scheduled_tokens == {"b": 20}
    (fill,) = work.fills
    assert [u.kind for u in fill.units] == ["sys", "rotated"] and fill.request.policy is not None
    assert (fill.start, fill.end) == (0, 150) and list(fill.block_ids) == list(so.scheduled_new_reqs[0].block_ids[0])


def test_a_blend_request_whose_misses_cost_more_than_its_prefill_is_prefilled_by_vllm(make_scheduler):
    """blend_misses 'prefill': sys and chunk missing (150 tokens) and the default recompute (30 % of
    110 chunk tokens and the 20-token question) cost more than the 150-token context, so vLLM
    computes the prompt itself (chunked by its 64-token budget), nothing loaded; the missing
    entries are planned once that step's metadata is built and their jobs sent with the next step.
    A later request over the same documents is all hits and blended; one whose only miss is a
    130-token chunk among hits (130 + 92 < 248, the 280-token context after vLLM's prefix-cache hit
    of one block of sys) waits for it and is blended."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    scheduler, hasher = make_scheduler()
    context = scheduler.connector._context()

    def blend(req_id, tokens, boundaries):
        params = SamplingParams(max_tokens=8, extra_args={BOUNDARIES_ARG: boundaries, "graphchunk_mode": "blend"})
        return Request(req_id, tokens, params, None, block_hasher=hasher)

    scheduler.add_request(blend("p", SYS + C1 + Q, [40, 150]))
    so, work = step(scheduler, done_before=0)
    assert so.num_scheduled_tokens == {"p": 64} and so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert not (work.jobs or work.fills or work.loads) and context.metrics.blend_full_prefills == 1
    so, work = step(scheduler, done_before=0)
    assert so.num_scheduled_tokens == {"p": 64} and [len(j.token_ids) for j in work.jobs] == [40, 110]
    assert [c[0] for c in work.counts if c[0] != "lookup_seconds"] == ["lookups"]  # the chunk's; nothing reused
    assert [j.counted for j in work.jobs] == [False, True]  # the chunk's miss, counted once its job has run
    while scheduler.has_unfinished_requests():
        step(scheduler, done_before=2)
    scheduler.add_request(blend("q", SYS + C1 + list(range(5000, 5020)), [40, 150]))
    so, work = step(scheduler, done_before=2)
    assert so.num_scheduled_tokens == {"q": 20} and [f.req_id for f in work.fills] == ["q"]
    scheduler.add_request(blend("r", SYS + C2 + C1 + list(range(6000, 6020)), [40, 170, 280]))
    so, work = step(scheduler, done_before=2)
    assert "r" not in so.num_scheduled_tokens and [len(j.token_ids) for j in work.jobs] == [130]
    step(scheduler, done_before=3)
    so, work = step(scheduler, done_before=3)
    assert so.num_scheduled_tokens.get("r") == 20 and [f.req_id for f in work.fills] == ["r"]
    assert context.metrics.blend_full_prefills == 1


def test_blend_entries_context_captures_a_full_prefill_s_segments_in_the_step_completing_its_context(make_scheduler):
    """blend_entries 'context': the full-prefilled request of the test above sends no jobs; the
    step whose tokens complete its context (the third of vLLM's 64-token chunks) carries a capture
    of each segment it lacked, job ids from the jobs' sequence, for the workers to run after that
    step's forward. Its entries are ready once the workers report past them: a later request over
    the same documents is all hits, filled from them. A request aborted before its context is
    complete captures nothing and holds nothing. (Every request here carries one tenant's salt.)"""
    from vllm.v1.request import RequestStatus

    scheduler, hasher = make_scheduler()
    context = scheduler.connector._context()
    blend = capturing(context, hasher, "tenant-a")

    scheduler.add_request(blend("x", list(range(7000, 7040)) + C2 + Q, [40, 170]))
    step(scheduler, done_before=0)
    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(blend("p", SYS + C1 + Q, [40, 150]))
    for tokens in (64, 64):
        so, work = step(scheduler, done_before=0)
        assert so.num_scheduled_tokens == {"p": tokens} and not (work.jobs or work.captures or work.fills)
    so, work = step(scheduler, done_before=2)  # the workers ran the step's captures after its forward
    captures = work.captures
    assert so.num_scheduled_tokens == {"p": 44} and not work.jobs  # the rest, and a token per step these workers sampled
    assert [(c.job_id, c.req_id, c.lo, c.hi, len(c.entry_blocks)) for c in captures] == \
        [(0, "p", 0, 40, 2), (1, "p", 40, 150, 4)]
    assert [c[:2] for c in work.counts if c[0] != "lookup_seconds"] == [("lookups", 1), ("misses", 1)]
    assert context.metrics.blend_full_prefills == 2 and context.metrics.pool_refs_held == 0
    while scheduler.has_unfinished_requests():
        step(scheduler, done_before=2)
    scheduler.add_request(blend("q", SYS + C1 + list(range(5000, 5020)), [40, 150]))
    so, work = step(scheduler, done_before=2)
    assert so.num_scheduled_tokens == {"q": 20} and [f.req_id for f in work.fills] == ["q"]
    unit = work.fills[0].units[-1]  # (vLLM's prefix cache holds the prompt's first blocks: the same salt)
    assert (unit.entry_blocks, unit.epoch, unit.kind) == (captures[1].entry_blocks, captures[1].epoch, "rotated")


def capturing(context, hasher, salt: str | None):
    """Switches ``context`` to blend_entries 'context'; a maker of blend requests under ``salt``
    (the client's cache_salt, as graphchunk's frontend writes it into the chunk-key salt)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    reconfigure(context, blend_entries="context")

    def blend(req_id, tokens, boundaries, salt=salt):
        args = {BOUNDARIES_ARG: boundaries, "graphchunk_mode": "blend"}
        if salt is not None:
            args[SALT_ARG] = kv_salt(SimpleNamespace(cache_salt=salt, lora_request=None))
        return Request(req_id, tokens, SamplingParams(max_tokens=8, extra_args=args), None, block_hasher=hasher,
                       cache_salt=salt)
    return blend


def test_blend_entries_context_captures_only_inside_one_cache_salt(make_scheduler):
    """DESIGN.md §2: no client chooses the context another client's answer is computed from. A
    request without a cache_salt (or with an empty one) is never captured: its missing chunks are
    computed alone, from the next step on, as with blend_entries 'alone'; a request under salt A is
    captured, and a request under salt B over the same documents finds none of A's entries."""
    scheduler, hasher = make_scheduler()
    context = scheduler.connector._context()
    blend = capturing(context, hasher, None)
    for n, (salt, chunk) in enumerate(((None, C1), ("", C2))):
        req_id = f"anonymous{n}"
        scheduler.add_request(blend(req_id, SYS + chunk + Q, [40, 40 + len(chunk)], salt=salt))
        so, work = step(scheduler, done_before=2 * n)
        assert so.num_scheduled_tokens == {req_id: 64} and req_id not in context.admission.capturing
        so, work = step(scheduler, done_before=2 * n)  # its chunks computed alone, after its first step
        assert [len(job.token_ids) for job in work.jobs] == [40, len(chunk)] and not work.captures
        while scheduler.has_unfinished_requests():
            step(scheduler, done_before=2 * n + 2)
        context.reset()  # the next request misses again
    scheduler.add_request(blend("a", SYS + C1 + Q, [40, 150], salt="tenant-a"))
    captures = ()
    while scheduler.has_unfinished_requests():
        so, work = step(scheduler, done_before=4)
        captures += work.captures
        assert not work.jobs
    assert [c.req_id for c in captures] == ["a", "a"]
    scheduler.add_request(blend("b", SYS + C1 + list(range(5000, 5020)), [40, 150], salt="tenant-b"))
    so, work = step(scheduler, done_before=6)
    assert so.num_scheduled_tokens == {"b": 64} and not work.fills  # a full prefill: A's entries are not B's
    assert "b" in context.admission.capturing


def test_blend_entries_precompute_captures_the_last_chunk_behind_the_rest(make_scheduler):
    """graphchunk-precompute's engine (``blend_entries`` 'precompute'): a blend request runs as
    vLLM's full prefill whatever the pool holds, and only its last chunk is captured, its capture
    naming the tokens before it (written to the tier with the entry); nothing is computed alone.
    The same document last again is a pool hit: not captured twice."""
    from graphchunk.cache.context_plan import context_identity

    scheduler, hasher = make_scheduler()
    context = scheduler.connector._context()
    blend = capturing(context, hasher, None)
    reconfigure(context, blend_entries="precompute", store_path="/nonexistent")
    captures, done = [], 0
    for req_id, tokens, bounds in (("c2-behind-c1", SYS + C1 + C2 + Q, [40, 150, 280]),
                                   ("c2-again", SYS + C2 + Q, [40, 170])):
        scheduler.add_request(blend(req_id, tokens, bounds))
        while scheduler.has_unfinished_requests():
            so, work = step(scheduler, done_before=done)
            assert not work.jobs and not work.fills and not work.loads
            captures += work.captures
            done += len(work.captures)
    (capture,) = captures
    assert (capture.req_id, capture.lo, capture.hi) == ("c2-behind-c1", 150, 280)
    assert capture.entry_tokens == tuple(C2) and capture.context == context_identity(SYS + C1)
    assert capture.context.startswith("150:") and context.metrics.blend_full_prefills == 0


def test_a_step_admits_all_hit_blend_requests_up_to_the_recompute_budget(make_scheduler):
    """Blend's recompute runs as graphchunk's own forwards, which vLLM's token budget does not see:
    a step admits all-hit blend requests until their recompute (``RecomputePolicy.cost``: 30 % of
    240 chunk tokens and the 20-token question, 92) would pass ``recompute_budget`` (here 100), one
    at least; the budget is its own (``miss_budget`` does not bound it). The request put off is
    pending in the metrics until a later step admits it."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    scheduler, hasher = make_scheduler()
    context = scheduler.connector._context()
    reconfigure(context, blend_misses="blend")  # "a" waits for its misses

    def blend(req_id, question):
        params = SamplingParams(max_tokens=4, extra_args={BOUNDARIES_ARG: [40, 150, 280], "graphchunk_mode": "blend"})
        return Request(req_id, SYS + C1 + C2 + question, params, None, block_hasher=hasher)

    scheduler.add_request(blend("a", Q))
    _, work = step(scheduler, done_before=0)
    jobs = len(work.jobs)
    while scheduler.has_unfinished_requests():
        step(scheduler, done_before=jobs)
    for n, (budgets, (first, second), admitted) in enumerate(((dict(miss_budget=100), "bc", ["b", "c"]),
                                                              (dict(recompute_budget=100), "de", ["d"]))):
        reconfigure(context, **budgets)
        scheduler.add_request(blend(first, list(range(8000 + 100 * n, 8020 + 100 * n))))
        scheduler.add_request(blend(second, list(range(9000 + 100 * n, 9020 + 100 * n))))
        so, work = step(scheduler, done_before=jobs)
        assert [f.req_id for f in work.fills] == admitted
    assert "e" not in so.num_scheduled_tokens
    assert (context.metrics.blend_requests_pending, context.metrics.blend_recompute_deferrals) == (1, 1)
    so, work = step(scheduler, done_before=jobs)
    assert [f.req_id for f in work.fills] == ["e"] and so.num_scheduled_tokens["e"] == 20
    assert (context.metrics.blend_requests_pending, context.metrics.blend_recompute_deferrals) == (0, 1)
