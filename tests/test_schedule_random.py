"""Randomized scheduling: graphchunk's connector under vLLM's own scheduler, its workers played by
graphchunk's own worker engine over a content-tracking fake device, two tensor-parallel ranks.

Each seed draws a stream of requests (sys prompts and documents shared between requests, both
modes, tenants, several arrivals per step) into a chunk pool that holds about two contexts and a
KV cache small enough that vLLM preempts; requests are aborted at random (waiting for misses,
loaded, running) and the workers' reports of finished jobs and loads arrive late at random. After
every step:

- every context a worker filled holds exactly its semantics' KV in every slot, including what
  vLLM's prefix cache supplied (the fake device records, per slot, which tokens at which position
  made it): a fill that read a block some job overwrote before it, or a prefix-cache block of
  another layout, fails here;
- vLLM never computes a segmented request's context itself; no copy fails its epoch check (the
  only invalid blocks are those of requests refused because they never fit the pool);
- the pool's accounting holds (``ChunkPool.check_invariants``).

At the end every request has finished (scheduled or refused, none waits forever), no reference is
held and no block leaked, and the stream evicted, hit and missed. Half as many seeds again run
under vLLM's asynchronous scheduling (``AsyncScheduler``: the next step is scheduled before the
workers' output of the last one arrives). A failing seed is in the test id:
``pytest tests/test_schedule_random.py -k 'seed17'`` replays it; ``GRAPHCHUNK_SCHEDULE_SEEDS=200``
runs more.
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from graphchunk.cache.context_run import ContextRunner
from graphchunk.cache.keys import KeySpace
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.chunk_engine import ChunkEngine
from graphchunk.engine.connector import GraphChunkHandshake, GraphChunkWorkerMeta, connector_config, work_of
from graphchunk.engine.context_scheduler import PoolHandshake, computed_before
from graphchunk.engine.frontend import RequestAnnotator, chunk_request
from graphchunk.engine.kv_binding import blend_prefix_tokens
from graphchunk.metrics import METRICS_FILE_ENV, CacheMetrics

BLOCK = 16
KV_BLOCKS = 48
"""vLLM's own blocks: small enough that running requests are preempted."""
POOL_BLOCKS = 24
BUDGET = 96
RANKS = 2
SEEDS = int(os.environ.get("GRAPHCHUNK_SCHEDULE_SEEDS", 24))
STEPS = 160
GC = {"mode": "isolated", "max_chunks": 4, "max_chunk_len": 120, "miss_budget": 40}
PREFIX = "Here is a document.\n\n"
"""blend_prefix of every third seed."""


class ContentDevice:
    """A ``KVDevice`` that records, per slot, the tokens and position whose KV is there."""

    def __init__(self):
        self.kv: dict[int, tuple] = {}
        self.blocks: dict[str, list[int]] = {}
        """Each request's block ids at vLLM's last forward of it (``request_blocks``)."""

    def request_blocks(self, req_id: str) -> list[int]:
        return self.blocks[req_id]

    def slot(self, block_ids, i: int) -> int:
        return block_ids[i // BLOCK] * BLOCK + i % BLOCK

    def prefill(self, seqs, num_layers=None):
        if num_layers is not None:  # CacheBlend's check pass: the fake keeps only full-depth KV
            return
        for seq in seqs:
            for i in range(seq.num_cached, len(seq.token_ids)):
                self.kv[self.slot(seq.block_ids, i)] = (tuple(seq.token_ids[: i + 1]), int(seq.positions[i]))

    def context_attention(self, seqs, num_layers=None):
        """The question-aware scoring pass: the question's KV, and a score per cached token that
        every rank computes alike (a hash of the token id)."""
        self.prefill(seqs)
        return [torch.tensor([(t * 2654435761) % 997 / 997 for t in seq.token_ids[:seq.num_cached]])
                for seq in seqs]

    def read_keys(self, layer, slots):
        return torch.zeros(len(slots), 1, 1)

    def sum_over_ranks(self, values):
        return values

    def copy_blocks(self, src, dst):
        for s, d in zip(src, dst):
            for o in range(BLOCK):
                if s * BLOCK + o in self.kv:
                    self.kv[d * BLOCK + o] = self.kv[s * BLOCK + o]

    def copy_slots(self, src, dst, key_temperature=1.0):
        values = [self.kv.get(s) for s in src.tolist()]  # read all, then write: one copy kernel
        self.kv.update(zip(dst.tolist(), values))

    def copy_slots_rotated(self, src, dst, deltas):
        values = [self.kv.get(s) for s in src.tolist()]
        for d, value, delta in zip(dst.tolist(), values, deltas.tolist()):
            if value is not None and value[0] == "vllm":  # vLLM's forward's KV (a capture): at its position
                value = (value[1], len(value[1]) - 1)
            self.kv[d] = None if value is None else (value[0], value[1] + delta)


def expected(request, t: int, prefix: tuple[int, ...] = ()) -> set:
    """The KV context token ``t`` may hold by the request's semantics (DESIGN.md §2): isolated, a
    chunk token after the sys prompt at positions from S; blend (policy 'legolink' k=2 or 'none'),
    a chunk computed alone (after the deployment's blend ``prefix``, which the request never holds
    itself), moved to where it lands, its first tokens recomputed over the whole
    prefix; 'cacheblend' r=1, every token recomputed: full prefill's; 'question' r=0.3, each chunk
    token either (which ones its ranking picks is test_blend's and test_blend_exact's to check)."""
    seg, policy = request.seg, request.policy
    if t < seg.layout.sys_len:
        return {(tuple(seg.sys_tokens[: t + 1]), t)}
    for i, (begin, end) in enumerate(seg.bounds[1:-1]):
        if begin <= t < end:
            own = tuple(seg.chunk_tokens(i)[: t - begin + 1])
            if policy is None:
                return {(tuple(seg.sys_tokens) + own, seg.layout.sys_len + t - begin)}
            fresh, alone = (tuple(seg.token_ids[: t + 1]), t), (prefix + own, t)
            if policy.name == "legolink" and t - begin < policy.tokens or policy.ratio == 1:
                return {fresh}
            return {fresh, alone} if policy.needs_check else {alone}
    raise AssertionError(f"token {t} is not context")


def in_context(request, t: int, got) -> bool:
    """Whether blend chunk token ``t`` holds KV taken from a full prefill (blend_entries 'context'):
    computed at ``t`` after the chunk's tokens before it, and after something before the chunk."""
    begin = next(b for b, e in request.seg.bounds[1:-1] if b <= t < e)
    own = tuple(request.seg.token_ids[begin: t + 1])
    return got is not None and got[1] == t and len(got[0]) > len(own) and got[0][-len(own):] == own


class Workers:
    """Two tensor-parallel ranks of graphchunk's worker engine, each over its own fake device."""

    def __init__(self, config: GraphChunkConfig, handshake: PoolHandshake, rng: random.Random):
        self.rng, self.config, self.prefix = rng, config, handshake.space.blend_prefix
        self.engines = []
        for _ in range(RANKS):
            runner = ContextRunner(BLOCK, BUDGET, CacheMetrics())
            self.engines.append(ChunkEngine(config, runner.metrics, runner, ContentDevice(), handshake, BUDGET))
        self.loaded: dict[str, int] = {}
        """Loads reported by some ranks (vLLM's aggregator reports a request once every rank has)."""
        self.held: set[str] = set()
        """Loads completed but reported late."""
        self.done_before = [0] * RANKS
        self.settled = False
        """Reports no longer come late (``settle``)."""

    def settle(self) -> None:
        """From now on every report arrives with its step, as vLLM's workers' do once traffic stops
        (each step's output carries every rank's progress): what came late so far arrives next step."""
        self.settled = True

    def step(self, so, scheduler):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        work = work_of(so.kv_connector_metadata)
        refused = {fill.req_id: fill for fill in work.fills if fill.refused}
        invalid, finished = set(), set()
        for rank, engine in enumerate(self.engines):
            loads = {load.req_id: load for load in engine.loads + list(work.loads)}
            with engine.step(so):
                engine.fill_context()
                self.check_fills(engine, [f for f in work.fills if not f.refused])
                self.forward(engine, so, scheduler)
            for req_id in engine.take_loaded():
                self.check_fills(engine, [loads[req_id]])
                self.loaded[req_id] = self.loaded.get(req_id, 0) + 1
                if self.loaded[req_id] == RANKS:
                    finished.add(req_id)
            invalid |= engine.take_invalid()
            if self.settled or self.rng.random() < 0.7:  # else the worker's report of its jobs comes a step late
                self.done_before[rank] = engine.done_before
        expected_invalid = {b for fill in refused.values() for b in fill.block_ids}
        assert invalid == expected_invalid, "a copy failed its epoch check: it would have read a block it did not plan"
        late = set() if self.settled else {r for r in finished if self.rng.random() < 0.3}
        report, self.held = (finished - late) | self.held, late
        for req_id in report:
            self.loaded.pop(req_id, None)
        req_ids = list(so.num_scheduled_tokens)
        computed = computed_before(so)
        prompt_done = [computed[r] + so.num_scheduled_tokens[r] >= scheduler.requests[r].num_prompt_tokens
                       for r in req_ids]  # vLLM's runner samples nothing for a partial prefill
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] if done else [] for done in prompt_done],
            kv_connector_output=KVConnectorOutput(
                finished_recving=report or None, invalid_block_ids=invalid,
                kv_connector_worker_meta=GraphChunkWorkerMeta(min(self.done_before))))

    def check_fills(self, engine, loads):
        context = self.config.blend_entries == "context"
        for load in loads:
            request = load.request
            for t in range(request.seg.layout.context_len):
                got = engine.kv.kv.get(engine.kv.slot(load.block_ids, t))
                assert got in expected(request, t, self.prefix) or context and request.policy is not None and \
                    t >= request.seg.layout.sys_len and in_context(request, t, got), \
                    f"request {load.req_id}: context token {t} holds {got}"

    def forward(self, engine, so, scheduler):
        """vLLM's own forward: the scheduled tokens' KV, after the fills; never a segmented request's
        context, unless the scheduler's connector chose to run it as a full prefill (blend)."""
        computed = computed_before(so)
        context = scheduler.connector._context()
        for req_id, n in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            chunked = engine.requests.get(req_id)
            start = computed[req_id]
            prefilled = req_id in context._requests and context._requests[req_id].prefilled
            assert chunked is None or start >= chunked.seg.layout.context_len or \
                (prefilled and chunked.policy is not None), \
                f"vLLM computes request {req_id}'s context itself (from token {start})"
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
            engine.kv.blocks[req_id] = list(block_ids)
            tokens = list(request.all_token_ids)
            for t in range(start, start + n):
                engine.kv.kv[engine.kv.slot(block_ids, t)] = ("vllm", tuple(tokens[: t + 1]))


def make_vllm_scheduler(smollm2_path, gc: dict, asynchronous: bool = False):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(smollm2_path), dtype="float32", max_model_len=1024)
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=6, max_model_len=1024,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        kv_transfer_config=connector_config(None), additional_config={"graphchunk": gc})
    config.cache_config.num_gpu_blocks = KV_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=KV_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    if asynchronous:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler  # noqa: N814
    scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK)
    # As the workers tell it: blend_prefix tokenized by the model's tokenizer (kv_binding's own function).
    space = KeySpace("m", "f32", blend_prefix=blend_prefix_tokens(model, gc.get("blend_prefix", "")))
    handshake = PoolHandshake(KV_BLOCKS, POOL_BLOCKS, BLOCK, space, None, None)
    with mock.patch.dict(os.environ):
        os.environ.pop(METRICS_FILE_ENV, None)
        scheduler.connector.set_xfer_handshake_metadata({rank: GraphChunkHandshake(handshake) for rank in range(RANKS)})
    return scheduler, handshake, get_request_block_hasher(BLOCK, hash_fn)


class Stream:
    """Random segmented requests over a few shared sys prompts and documents, annotated by
    graphchunk's own frontend (boundaries, mode, salts)."""

    def __init__(self, rng: random.Random, config: GraphChunkConfig, hasher):
        self.rng, self.hasher = rng, hasher
        self.annotator = RequestAnnotator(dataclass_replace(config, separator=""), tokenizer=None)
        self.systems = [list(range(1000 * (k + 1), 1000 * (k + 1) + rng.randint(0, 40))) for k in range(2)]
        self.docs = [list(range(20000 + 500 * k, 20000 + 500 * k + rng.randint(3, 70))) for k in range(8)]
        self.count = 0

    def request(self):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        rng = self.rng
        sys_tokens = rng.choice(self.systems)
        chunks = rng.sample(self.docs, rng.randint(1, 3))
        question = [40000 + rng.randrange(50) for _ in range(rng.randint(1, 24))]
        tokens, boundaries = list(sys_tokens), []
        for chunk in chunks:
            boundaries.append(len(tokens))
            tokens += chunk
        boundaries.append(len(tokens))
        tokens += question
        mode = rng.choice([{}, {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink",
                                "graphchunk_recompute_tokens": 2},
                           {"graphchunk_mode": "blend", "graphchunk_recompute": "none"},
                           {"graphchunk_mode": "blend", "graphchunk_recompute": "cacheblend",
                            "graphchunk_recompute_ratio": 1.0},
                           {"graphchunk_mode": "blend", "graphchunk_recompute": "question",
                            "graphchunk_recompute_ratio": 0.3}])
        params = SamplingParams(max_tokens=rng.randint(1, 6), extra_args={"graphchunk_boundaries": boundaries, **mode})
        shell = SimpleNamespace(prompt_token_ids=tokens, sampling_params=params, lora_request=None, mm_features=None,
                                cache_salt=rng.choice([None, None, "tenant-b"]))
        self.annotator.annotate(shell)
        self.count += 1
        return Request(f"r{self.count}", tokens, params, None, cache_salt=shell.cache_salt, block_hasher=self.hasher)


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


@pytest.fixture(scope="module")
def vllm_scheduler(smollm2_path):
    from graphchunk.engine import plugin

    plugin.register()
    return lambda asynchronous=False, **gc: make_vllm_scheduler(smollm2_path, {**GC, **gc}, asynchronous)


class Steps:
    """vLLM's engine core loop: ``step`` schedules and hands the step to the workers; their output
    reaches the scheduler at once (synchronous scheduling), or, with asynchronous scheduling (its
    ``AsyncScheduler``, a queue of two steps as ``EngineCore.step_with_batch_queue`` keeps), after
    the next step has been scheduled."""

    def __init__(self, scheduler, workers, asynchronous: bool):
        self.scheduler, self.workers, self.depth = scheduler, workers, 2 if asynchronous else 1
        self.queue: list = []

    def step(self):
        so = self.scheduler.schedule()
        self.queue.append((so, self.workers.step(so, self.scheduler)))
        if len(self.queue) >= self.depth or not so.total_num_scheduled_tokens:
            self.flush(keep=0 if not so.total_num_scheduled_tokens else self.depth - 1)
        return so

    def flush(self, keep: int = 0):
        while len(self.queue) > keep:
            self.scheduler.update_from_output(*self.queue.pop(0))


STREAMS = [pytest.param(s, False, id=f"seed{s}") for s in range(SEEDS)] + \
    [pytest.param(s, True, id=f"async-seed{s}") for s in range(SEEDS // 2)]


@pytest.mark.parametrize("seed, asynchronous", STREAMS)
def test_random_request_streams_fill_exactly_what_they_planned(vllm_scheduler, seed, asynchronous):
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    # Blend requests whose misses cost more than their prefill: vLLM's full prefill on odd seeds
    # (their entries computed alone for later requests, or taken from that prefill on seeds 1 mod 4),
    # blended on even ones; every third seed computes blend chunks after a fixed prefix.
    scheduler, handshake, hasher = vllm_scheduler(asynchronous, blend_misses="prefill" if seed % 2 else "blend",
                                                  blend_entries="context" if seed % 4 == 1 else "alone",
                                                  blend_prefix=PREFIX if seed % 3 == 2 else "")
    config = scheduler.connector._config
    pool = scheduler.connector._context().pool
    workers, stream = Workers(config, handshake, rng), Stream(rng, config, hasher)
    steps = Steps(scheduler, workers, asynchronous)
    added = []
    for step in range(STEPS * 3):
        if step < STEPS:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
                request = stream.request()
                added.append(request.request_id)
                scheduler.add_request(request)
        live = [r for r in scheduler.requests.values() if not r.is_finished()]
        if live and rng.random() < 0.08:
            scheduler.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_ABORTED)
        steps.step()
        pool.check_invariants()
        if step >= STEPS and not scheduler.has_unfinished_requests():
            break
    steps.flush()
    assert not scheduler.has_unfinished_requests(), f"seed {seed}: requests never scheduled nor refused: " \
        f"{[(r.request_id, r.status) for r in scheduler.requests.values()]}"
    workers.settle()  # the workers' late reports (jobs run, loads done) arrive with the next steps
    steps.step()  # the last finished ids reach the workers
    steps.step()
    steps.flush()
    pool.audit()
    assert (pool.metrics.pool_refs_held, pool.metrics.pool_blocks_leaked) == (0, 0)
    assert all(not engine.loads and not engine.runner.pending_tokens for engine in workers.engines)
    metrics = workers.engines[0].metrics
    assert metrics.hits and metrics.misses and len(added) > 20


def test_the_streams_exercise_pressure(vllm_scheduler):
    """Across a few seeds the pool evicts, vLLM preempts, runs blend requests as full prefills (the
    default blend_misses), takes entries from them (blend_entries 'context', the last seed) and
    blends question-aware ones: the random test covers all five."""
    evictions = preemptions = prefills = scored = captured = 0
    for seed in range(3):
        rng = random.Random(seed)
        scheduler, handshake, hasher = vllm_scheduler(blend_entries="context" if seed == 2 else "alone")
        workers, stream = Workers(scheduler.connector._config, handshake, rng), Stream(rng, scheduler.connector._config,
                                                                                       hasher)
        for step in range(STEPS):
            for _ in range(rng.choice([0, 1, 2, 4])):
                scheduler.add_request(stream.request())
            so = scheduler.schedule()
            preemptions += len(so.preempted_req_ids or ())
            scheduler.update_from_output(so, workers.step(so, scheduler))
        evictions += scheduler.connector._context().pool.metrics.evictions
        prefills += scheduler.connector._context().metrics.blend_full_prefills
        scored += workers.engines[0].metrics.blend_tokens_scored
        captured += workers.engines[0].metrics.blend_entries_captured
    assert evictions and preemptions and prefills and scored and captured, \
        (evictions, preemptions, prefills, scored, captured)


def test_the_content_check_sees_a_wrong_fill(vllm_scheduler):
    """The check above can fail: a fill that copies another chunk's KV is caught."""
    rng = random.Random(0)
    scheduler, handshake, hasher = vllm_scheduler()
    workers = Workers(scheduler.connector._config, handshake, rng)
    stream = Stream(rng, scheduler.connector._config, hasher)
    request = stream.request()
    engine = workers.engines[0]
    chunked = chunk_request(request.prompt_token_ids, request.sampling_params.extra_args, scheduler.connector._config)
    load = SimpleNamespace(request=chunked, block_ids=list(range(8)), req_id=request.request_id)
    with pytest.raises(AssertionError, match="context token 0 holds None"):
        workers.check_fills(engine, [load])
