"""vLLM's own scheduler with graphchunk's connector, its workers played by graphchunk's own worker
engine over a content-tracking fake device (two tensor-parallel ranks): the harness of the
randomized scheduling test (``test_schedule_random.py``) and of the tests of requests that leave
early (``test_leave_early.py``).

``Workers`` checks, in every step, that each context a worker filled holds exactly its semantics'
KV in every slot (``check_fills``), and notes each forward of a segmented request whose context
does not hold that KV (``check_reads``: what vLLM's prefix cache supplied included); ``Steps``
checks that no token such a forward computed is delivered (``served_wrong``). ``inject`` plants
a bad pool entry (its blocks no longer hold what was planned: a lifetime bug's effect), after
which copies from it must fail and the requests that read them be planned again.
``accounting`` is vLLM's side of what a request gives back: its blocks and its ``Request``.
"""
from __future__ import annotations

import collections
import os
import random
from types import SimpleNamespace
from unittest import mock

import torch

from graphchunk.cache.context_run import POISONED, ContextRunner
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.keys import KeySpace
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.chunk_engine import ChunkEngine
from graphchunk.engine.connector import GraphChunkHandshake, GraphChunkWorkerMeta, connector_config, work_of
from graphchunk.engine.context_scheduler import PoolHandshake, computed_before
from graphchunk.engine.frontend import RequestAnnotator, one_tenant
from graphchunk.engine.kv_binding import blend_prefix_tokens
from graphchunk.engine.connector_stats import GraphChunkStats, take_stats
from graphchunk.metrics import METRICS_FILE_ENV, WORKER_FIELDS, CacheMetrics, StatsReport
from perf.common.vllm_scheduler import vllm_scheduler

BLOCK = 16
KV_BLOCKS = 48
"""vLLM's own blocks: small enough that running requests are preempted."""
POOL_BLOCKS = 24
BUDGET = 96
RANKS = 2
STEPS = 160
GC = {"mode": "isolated", "max_chunks": 4, "max_chunk_len": 120, "miss_budget": 40}


class ContentDevice:
    """A ``KVDevice`` that records, per slot, the tokens and position whose KV is there."""

    def __init__(self):
        self.kv: dict[int, tuple] = {}
        self.blocks: dict[str, list[int]] = {}
        """Each request's block ids at vLLM's last forward of it (``request_blocks``)."""
        self.payloads: list = []
        """What ``read_blocks``' tensors name: the KV of each slot read."""

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

    def read_blocks(self, block_ids):
        """The blocks' KV as a host tensor, as ``KVCopier.read_blocks`` gives it ([1 layer, blocks,
        BLOCK], what the tier's host level keeps): each element names its slot's KV in ``payloads``."""
        first = len(self.payloads)
        self.payloads += [self.kv.get(self.slot(block_ids, i)) for i in range(len(block_ids) * BLOCK)]
        return torch.arange(first, len(self.payloads)).reshape(1, len(block_ids), BLOCK)

    def write_blocks(self, block_ids, data):
        for i, name in enumerate(data.reshape(-1).tolist()):
            self.kv[self.slot(block_ids, i)] = self.payloads[name]

    def copy_slots(self, src, dst, key_temperature=1.0):
        values = [self.kv.get(s) for s in src.tolist()]  # read all, then write: one copy kernel
        self.kv.update(zip(dst.tolist(), values))

    def copy_slots_rotated(self, src, dst, deltas):
        values = [self.kv.get(s) for s in src.tolist()]
        for d, value, delta in zip(dst.tolist(), values, deltas.tolist()):
            self.kv[d] = _rotated(value, delta)

    def read_slots(self, slots):
        """The slots' KV as a host tensor, shaped as ``KVCopier.read_slots`` gives it ([1 layer, 1,
        slots, 1, 1], what host memory keeps): each element names its slot's KV in ``payloads``."""
        first = len(self.payloads)
        self.payloads += [self.kv.get(s) for s in slots.tolist()]
        return torch.arange(first, len(self.payloads)).reshape(1, 1, -1, 1, 1)

    def write_slots(self, data, dst, key_temperature=1.0, deltas=None):
        values = [self.payloads[name] for name in data.reshape(-1).tolist()]
        moves = deltas.tolist() if deltas is not None else [None] * len(values)
        for d, value, delta in zip(dst.tolist(), values, moves, strict=True):
            self.kv[d] = value if delta is None else _rotated(value, delta)


def _rotated(value, delta: int):
    """Fake KV moved ``delta`` positions further (vLLM's forward's KV, a capture's, is at its own position)."""
    if value is not None and value[0] == "vllm":
        value = (value[1], len(value[1]) - 1)
    return None if value is None else (value[0], value[1] + delta)


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
    """Two tensor-parallel ranks of graphchunk's worker engine, each over its own fake device; with
    ``host_bytes``, each over its own host memory (the ranks run the same jobs and drops in the same
    order, so they hold the same payloads: ``all_ranks`` is not played)."""

    def __init__(self, config: GraphChunkConfig, handshake: PoolHandshake, rng: random.Random):
        self.rng, self.config, self.prefix = rng, config, handshake.space.blend_prefix
        self.engines = []
        for _ in range(RANKS):
            metrics = CacheMetrics()
            host = HostTier(config.host_bytes, metrics) if config.host_bytes else None
            runner = ContextRunner(BLOCK, BUDGET, metrics, host=host)
            stats = StatsReport(runner.metrics, WORKER_FIELDS) if not self.engines else None  # rank 0 reports
            self.engines.append(ChunkEngine(config, runner.metrics, runner, ContentDevice(), handshake, BUDGET,
                                            report=stats))
        self.loaded: dict[str, int] = {}
        """Loads reported by some ranks (vLLM's aggregator reports a request once every rank has)."""
        self.held: set[str] = set()
        """Loads completed but reported late."""
        self.done_before = [0] * RANKS
        self.settled = False
        """Reports no longer come late (``settle``)."""
        self.faulted: set[int] = set()
        """Epochs of the entries made bad (``inject``) or found bad by a worker (a job that read one)."""
        self.failed_fills: set[str] = set()
        """Requests a fill or load failed for (their copies read a bad entry)."""
        self.bad_reads: dict[str, int] = {}
        """Requests whose forward read context KV that is not their semantics' (and how often)."""
        self.tainted: set[str] = set()
        """Requests whose context did not hold their semantics' KV at their last forward."""
        self.bad_steps: set[tuple[int, str]] = set()
        """(step, request): the step's forward of the request read context KV not its semantics'
        (no token of that step may be delivered to it: ``Steps.served_wrong``)."""
        self.step_no = 0
        self.last: dict[str, int] = {}
        """Per request, the token after the last one vLLM computed."""
        self.reported_invalid: set[int] = set()
        """Blocks the last step reported invalid: under asynchronous scheduling vLLM schedules the
        next step (a prefix hit on them included) before that report reaches it."""

    def settle(self) -> None:
        """From now on every report arrives with its step, as vLLM's workers' do once traffic stops
        (each step's output carries every rank's progress): what came late so far arrives next step."""
        self.settled = True

    def inject(self, pool) -> int | None:
        """Makes a ready pool entry bad in every rank, as a lifetime bug would (its blocks no longer
        hold its epoch); returns that epoch (None: no ready entry)."""
        ready = [entry for entry in pool._index.values() if entry.ready]
        if not ready:
            return None
        return self.inject_entry(self.rng.choice(ready))

    def inject_entry(self, entry) -> int:
        for engine in self.engines:
            for block in entry.block_ids:
                engine.runner.epochs[block] = POISONED
        self.faulted.add(entry.epoch)
        return entry.epoch

    def step(self, so, scheduler):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.step_no += 1
        work = work_of(so.kv_connector_metadata)
        refused = {fill.req_id: fill for fill in work.fills if fill.refused}
        invalid, finished, failed, refill, bad_fills = set(), set(), set(), set(), []
        for rank, engine in enumerate(self.engines):
            loads = {load.req_id: load for load in engine.loads + list(work.loads)}
            with engine.step(so):
                engine.fill_context()
                fills = [f for f in work.fills if not f.refused]
                self.check_fills(engine, [f for f in fills if self.copies_hold(engine, f)])
                bad_fills += [f for f in fills if not self.copies_hold(engine, f)]
                self.forward(engine, so, scheduler)
            for req_id in engine.take_loaded():
                if req_id not in so.finished_req_ids:  # else dropped: its request left before its jobs ran
                    load = loads[req_id]
                    if not self.copies_hold(engine, load):
                        bad_fills.append(load)
                    else:
                        self.check_fills(engine, [load])
                self.loaded[req_id] = self.loaded.get(req_id, 0) + 1
                if self.loaded[req_id] == RANKS:
                    finished.add(req_id)
            invalid |= engine.take_invalid()
            failed |= engine.take_failed()
            refill |= engine.take_refill()
            if self.settled or self.rng.random() < 0.7:  # else the worker's report of its jobs comes a step late
                self.done_before[rank] = engine.done_before
        self.faulted |= failed
        expected_invalid = {b for fill in refused.values() for b in fill.block_ids}
        for load in bad_fills:  # a fill that failed its check: only one that copies a bad entry may
            assert any(unit.epoch in self.faulted for unit in load.units), \
                f"request {load.req_id}: a copy failed its epoch check: it would have read a block it did not plan"
            self.failed_fills.add(load.req_id)
            expected_invalid |= set(load.block_ids[min(u.lo for u in load.units) // BLOCK:])
        assert invalid == expected_invalid, "the invalid blocks are not those of refused and failed fills"
        self.reported_invalid = invalid
        assert refill == {load.req_id for load in bad_fills}, "the requests planned again are not those of failed fills"
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
                kv_connector_stats=take_stats(self.engines[0].report),
                kv_connector_worker_meta=GraphChunkWorkerMeta(min(self.done_before), frozenset(failed),
                                                              frozenset(refill))))

    @staticmethod
    def copies_hold(engine, load) -> bool:
        """Whether every entry a fill copies holds its planned epoch (else the fill failed its check)."""
        return all(engine.runner._holds(unit.entry_blocks, unit.epoch) for unit in load.units)

    def holds(self, engine, request, block_ids, t: int) -> bool:
        """Whether context token ``t`` of ``request`` holds its semantics' KV in ``block_ids``."""
        got = engine.kv.kv.get(engine.kv.slot(block_ids, t))
        return got in expected(request, t, self.prefix) or self.config.blend_entries == "context" and \
            request.policy is not None and one_tenant(request.salt) and t >= request.seg.layout.sys_len and \
            in_context(request, t, got)

    def check_fills(self, engine, loads):
        """Every context token of each filled load holds its semantics' KV; where one does not, the
        request shares a block that another request's failed fill left invalid, in this step or in
        the one before whose report vLLM has not processed yet (it is planned again, and nothing
        its forward computes is delivered: ``bad_reads``, ``Steps.served_wrong``), else the fill
        is wrong."""
        for load in loads:
            for t in range(load.request.seg.layout.context_len):
                if self.holds(engine, load.request, load.block_ids, t):
                    continue
                assert (engine.runner.invalid | self.reported_invalid) & set(load.block_ids), \
                    f"request {load.req_id}: context token {t} holds {engine.kv.kv.get(engine.kv.slot(load.block_ids, t))}"
                self.bad_reads[load.req_id] = self.bad_reads.get(load.req_id, 0) + 1
                break

    def check_reads(self, engine, req_id, chunked, block_ids, start) -> None:
        """Before vLLM's forward of a segmented request whose context is computed (from graphchunk's
        fills or vLLM's prefix cache): every context token holds its semantics' KV (checked the
        first time it runs after its context was (re)filled; a step that continues from the last
        one reads what that one read), else the step is noted (``bad_reads``, ``bad_steps``)."""
        if self.last.get(req_id) != start:
            if all(self.holds(engine, chunked, block_ids, t) for t in range(chunked.seg.layout.context_len)):
                self.tainted.discard(req_id)
            else:
                self.tainted.add(req_id)
                self.bad_reads[req_id] = self.bad_reads.get(req_id, 0) + 1
        if req_id in self.tainted:
            self.bad_steps.add((self.step_no, req_id))

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
            if chunked is not None and not prefilled:
                self.check_reads(engine, req_id, chunked, block_ids, start)
            tokens = list(request.all_token_ids)
            for t in range(start, start + n):
                engine.kv.kv[engine.kv.slot(block_ids, t)] = ("vllm", tuple(tokens[: t + 1]))
            if engine is self.engines[-1]:
                self.last[req_id] = start + n


def accounting(scheduler) -> tuple[int, list, set]:
    """vLLM's side of what requests give back: the KV blocks no request holds (free, or freed and
    returned to vLLM's pool once the step in flight is done: its deferred frees under asynchronous
    scheduling), the requests it still holds (with their status), and those whose load it still
    waits for."""
    manager = scheduler.kv_cache_manager
    held = {block for req_id in scheduler.requests for block in manager.get_block_ids(req_id)[0]}
    return (KV_BLOCKS - 1 - len(held) if check_blocks(scheduler) else -1,
            [(r.request_id, r.status) for r in scheduler.requests.values()],
            set(scheduler.finished_recving_kv_req_ids))


def check_blocks(scheduler, num_blocks: int = KV_BLOCKS) -> bool:
    """vLLM's block accounting holds: each of its ``num_blocks`` blocks' reference count is the
    number of requests vLLM still holds that hold it (a block shared through its prefix cache counts
    each) plus its deferred frees, and vLLM's free queue holds exactly the blocks counted by nobody,
    never a block of another owner (an id from ``num_blocks`` on: the chunk pool's)."""
    manager = scheduler.kv_cache_manager
    counts = collections.Counter(block for req_id in scheduler.requests for block in manager.get_block_ids(req_id)[0]
                                 if block < num_blocks)
    counts.update(block.block_id for _, blocks in scheduler.deferred_frees for block in blocks)
    pool = manager.block_pool
    wrong = {block.block_id: (block.ref_cnt, counts[block.block_id]) for block in pool.blocks[1:]
             if block.ref_cnt != counts[block.block_id]}
    assert not wrong, f"vLLM's blocks (reference count, holders + deferred frees): {wrong}"
    assert pool.get_num_free_blocks() == num_blocks - 1 - len(counts), "vLLM's free queue"
    assert all(b.block_id < num_blocks for b in pool.free_block_queue.get_all_free_blocks()), \
        "a block of another owner is in vLLM's free queue"
    return True


def make_vllm_scheduler(smollm2_path, gc: dict, asynchronous: bool = False):
    scheduler, config, hasher = vllm_scheduler(
        smollm2_path, num_blocks=KV_BLOCKS, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=6,
        max_model_len=1024, kv_transfer_config=connector_config(None), additional_config={"graphchunk": gc},
        asynchronous=asynchronous)
    model = config.model_config
    assert scheduler.defer_block_free == asynchronous  # vLLM's deferred frees, as async_scheduling has them
    # As the workers tell it: blend_prefix tokenized by the model's tokenizer (kv_binding's own function).
    space = KeySpace("m", "f32", blend_prefix=blend_prefix_tokens(model, gc.get("blend_prefix", "")))
    # Host memory's tokens as the workers count them: the fake device names a slot's KV in 8 bytes.
    handshake = PoolHandshake(KV_BLOCKS, POOL_BLOCKS, BLOCK, space, None, None, gc.get("host_bytes", 0) // 8)
    with mock.patch.dict(os.environ):
        os.environ.pop(METRICS_FILE_ENV, None)
        scheduler.connector.set_xfer_handshake_metadata({rank: GraphChunkHandshake(handshake) for rank in range(RANKS)})
    return scheduler, handshake, hasher


class Stream:
    """Random segmented requests over a few shared sys prompts and documents, annotated by
    graphchunk's own frontend (boundaries, mode, a cache_salt drawn from ``salts``)."""

    def __init__(self, rng: random.Random, config: GraphChunkConfig, hasher, salts=(None, None, "tenant-b")):
        self.rng, self.hasher, self.salts = rng, hasher, salts
        self.annotator = RequestAnnotator(dataclass_replace(config, separator=""), tokenizer=None)
        self.systems = [list(range(1000 * (k + 1), 1000 * (k + 1) + rng.randint(0, 40))) for k in range(2)]
        self.docs = [list(range(20000 + 500 * k, 20000 + 500 * k + rng.randint(3, 70))) for k in range(8)]
        self.count = 0

    def request(self):
        rng = self.rng
        sys_tokens = rng.choice(self.systems)
        chunks = rng.sample(self.docs, rng.randint(1, 3))
        question = [40000 + rng.randrange(50) for _ in range(rng.randint(1, 24))]
        mode = rng.choice([{}, {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink",
                                "graphchunk_recompute_tokens": 2},
                           {"graphchunk_mode": "blend", "graphchunk_recompute": "none"},
                           {"graphchunk_mode": "blend", "graphchunk_recompute": "cacheblend",
                            "graphchunk_recompute_ratio": 1.0},
                           {"graphchunk_mode": "blend", "graphchunk_recompute": "question",
                            "graphchunk_recompute_ratio": 0.3}])
        max_tokens = rng.randint(1, 6)
        return self.make(sys_tokens, chunks, question, mode, rng.choice(self.salts), max_tokens)

    def make(self, sys_tokens, chunks, question, mode: dict | None = None, salt: str | None = None,
             max_tokens: int = 4):
        """A segmented request of these parts (token lists), annotated as graphchunk's frontend does."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        tokens, boundaries = list(sys_tokens), []
        for chunk in chunks:
            boundaries.append(len(tokens))
            tokens += chunk
        boundaries.append(len(tokens))
        tokens += question
        params = SamplingParams(max_tokens=max_tokens,
                                extra_args={"graphchunk_boundaries": boundaries, **(mode or {})})
        shell = SimpleNamespace(prompt_token_ids=tokens, sampling_params=params, lora_request=None, mm_features=None,
                                cache_salt=salt)
        self.annotator.annotate(shell)
        self.count += 1
        return Request(f"r{self.count}", tokens, params, None, cache_salt=shell.cache_salt, block_hasher=self.hasher)

    def ordinary(self, num_tokens: int, max_tokens: int = 2):
        """A prompt with no documents (vLLM computes it alone)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.count += 1
        return Request(f"r{self.count}", [50000 + i for i in range(num_tokens)], SamplingParams(max_tokens=max_tokens),
                       None, block_hasher=self.hasher)


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


class Steps:
    """vLLM's engine core loop: ``step`` schedules and hands the step to the workers; their output
    reaches the scheduler at once (synchronous scheduling), or, with asynchronous scheduling (its
    ``AsyncScheduler``, a queue of two steps as ``EngineCore.step_with_batch_queue`` keeps), after
    the next step has been scheduled."""

    def __init__(self, scheduler, workers, asynchronous: bool):
        self.scheduler, self.workers, self.depth = scheduler, workers, 2 if asynchronous else 1
        self.queue: list = []
        self.finished: dict[str, object] = {}
        """Requests vLLM reported finished, with their ``FinishReason``."""
        self.aborted: set[str] = set()
        self.delivered: dict[str, list[int]] = {}
        """The tokens vLLM delivered to each request."""
        self.delivered_wrong: dict[str, int] = {}
        """Tokens vLLM delivered from a forward that read context KV not the request's semantics'."""
        self.reported = GraphChunkStats()
        """graphchunk's metrics as vLLM's scheduler stats carried them (``connector_stats.py``), summed."""

    def abort(self, req_id: str) -> None:
        """The client goes away (vLLM's ``finish_requests``, as the API server calls it)."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.aborted.add(req_id)

    def step(self, between=None):
        """One step; ``between(so)``, if given, runs after the workers executed it and before
        vLLM processes any output (where vLLM's engine core processes aborts)."""
        so = self.scheduler.schedule()
        self.queue.append((so, self.workers.step(so, self.scheduler), self.workers.step_no))
        if between is not None:
            between(so)
        if len(self.queue) >= self.depth or not so.total_num_scheduled_tokens:
            self.flush(keep=0 if not so.total_num_scheduled_tokens else self.depth - 1)
        return so

    def flush(self, keep: int = 0):
        while len(self.queue) > keep:
            so, output, step_no = self.queue.pop(0)
            for outputs in self.scheduler.update_from_output(so, output).values():
                if outputs.scheduler_stats is not None and outputs.scheduler_stats.kv_connector_stats:
                    self.reported = self.reported.aggregate(GraphChunkStats(outputs.scheduler_stats.kv_connector_stats))
                for out in outputs.outputs:
                    self.delivered.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.new_token_ids and (step_no, out.request_id) in self.workers.bad_steps:
                        self.delivered_wrong[out.request_id] = self.delivered_wrong.get(out.request_id, 0) + 1
                    if out.finish_reason is not None:
                        self.finished[out.request_id] = out.finish_reason

    def served_wrong(self) -> dict[str, int]:
        """Requests vLLM delivered a token computed over context KV not their semantics' (and how many)."""
        return dict(self.delivered_wrong)
