"""A step's host work follows the step's work, not the batch (DESIGN.md §10): the worker's position
rewrite is one fixed set of tensor operations however many requests the batch holds, and computes
what moving each request alone computes; planning a step reads only the requests still in their
prompt; the pool's accounting is kept as it changes (``check_invariants`` recounts it)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphchunk.cache.pool import ChunkPool, PoolExhausted
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.chunk_engine import ChunkEngine, position_shift
from graphchunk.engine.context_scheduler import PoolHandshake
from graphchunk.engine.request_args import ChunkRequest
from graphchunk.engine.step_plan import plan_step
from graphchunk.segments import split_at


def moved_one_by_one(query_start, num_computed, rows, context_len, offset, num_tokens) -> np.ndarray:
    """The rewrite as it was written first: each request's question and generated tokens moved alone."""
    positions = np.zeros(num_tokens, np.int64)
    for row, ctx, off in zip(rows, context_len, offset):
        begin, end = int(query_start[row]), int(query_start[row + 1])
        positions[begin + max(0, int(ctx) - int(num_computed[row])):end] += off
    return positions


@pytest.mark.parametrize("seed", range(20))
def test_position_shift_moves_each_request_as_it_would_alone(seed):
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, 40))
    scheduled = rng.integers(1, 30, num_reqs)
    query_start = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    num_computed = rng.integers(0, 200, num_reqs).astype(np.int32)
    rows = rng.choice(num_reqs, int(rng.integers(1, num_reqs + 1)), replace=False)
    context_len = num_computed[rows] + rng.integers(-20, 30, len(rows))  # before, inside and past the step
    offset = -rng.integers(1, 500, len(rows))
    shift = position_shift(query_start, num_computed, rows, context_len, offset)
    want = moved_one_by_one(query_start, num_computed, rows, context_len, offset, int(query_start[-1]))
    if shift is None:
        assert not want.any()
    else:
        got = np.zeros_like(want)
        got[:len(shift)] = shift
        assert np.array_equal(got, want)


def isolated_request(rng: random.Random, num_chunks: int) -> ChunkRequest:
    sys_len, lens = rng.randint(0, 20), [rng.randint(1, 40) for _ in range(num_chunks)]
    tokens, boundaries = list(range(sys_len)), []
    for n in lens:
        boundaries.append(len(tokens))
        tokens += [7] * n
    boundaries.append(len(tokens))
    tokens += [9] * rng.randint(1, 10)
    return ChunkRequest(split_at(tokens, boundaries, max_chunks=8, max_chunk_len=64), None, None)


def decode_step(num_reqs: int, seed: int = 0):
    """A worker engine holding ``num_reqs`` isolated requests, each past its prompt, and vLLM's
    prepared batch of one decode step over them (rows shuffled as vLLM's input batch may order them)."""
    rng = random.Random(seed)
    engine = ChunkEngine(GraphChunkConfig(), None, None, None, PoolHandshake(0, 1, 16, None, None, None), 0)
    requests = {f"r{i}": isolated_request(rng, rng.randint(2, 5)) for i in range(num_reqs)}
    engine._register(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=())),
                     list(requests.items()))
    order = list(requests)
    rng.shuffle(order)
    batch = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(order)},
                            num_computed_tokens_cpu=np.array([requests[r].seg.layout.num_tokens + rng.randint(0, 50)
                                                              for r in order], np.int32))
    query_start = np.arange(num_reqs + 1, dtype=np.int32)
    positions = torch.from_numpy(batch.num_computed_tokens_cpu.astype(np.int64))
    return engine, requests, order, batch, query_start, positions


def tensor_ops(fn) -> list[str]:
    """The aten operations ``fn`` runs (CPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted(event.name for event in prof.events() if event.name.startswith("aten::"))


def test_a_decode_step_s_position_rewrite_is_a_fixed_set_of_tensor_operations():
    """At 8, 64 and 512 isolated requests, the same operations (one add over the step's positions),
    and every request's token at its position by DESIGN.md §2 (logical index plus its offset)."""
    counted = {}
    for num_reqs in (8, 64, 512):
        engine, requests, order, batch, query_start, positions = decode_step(num_reqs)
        logical = positions.clone()
        counted[num_reqs] = tensor_ops(lambda: engine.rewrite_positions(batch, query_start, positions))
        want = logical + torch.tensor([requests[r].seg.layout.position_offset for r in order])
        assert torch.equal(positions, want)
    assert counted[8] == counted[64] == counted[512] and counted[8], counted


def test_planning_a_step_reads_only_the_requests_in_their_prompt():
    """``plan_step`` is handed the requests still in their prompt; one whose prompt the step completes
    is named (``prompted``) and the engine stops reading it; a decode step plans nothing."""
    rng = random.Random(0)
    prompting = {f"r{i}": isolated_request(rng, 3) for i in range(3)}
    lens = {r: q.seg.layout for r, q in prompting.items()}
    new = [SimpleNamespace(req_id=r, num_computed_tokens=lens[r].context_len) for r in prompting]
    so = SimpleNamespace(num_scheduled_tokens={"r0": lens["r0"].question_len, "r1": 1, "r2": lens["r2"].question_len,
                                               "other": 5},
                         scheduled_new_reqs=new,
                         scheduled_cached_reqs=SimpleNamespace(req_ids=["other"], num_computed_tokens=[40]))
    plan = plan_step(so, (), prompting, None)
    assert set(plan.prompted) == {"r0", "r2"} | ({"r1"} if lens["r1"].question_len == 1 else set())
    assert plan.tokens_computed == lens["r0"].question_len + 1 + lens["r2"].question_len
    assert plan_step(so, (), {}, None).tokens_computed == 0


def test_the_pool_keeps_its_accounting_as_it_changes():
    """Random inserts, lookups, releases, readiness, evictions and forgotten entries: the gauges the
    pool keeps as it goes equal the recount by walking it, after every operation."""
    rng = random.Random(3)
    pool = ChunkPool(64, 4)
    held = []
    for step in range(2000):
        op = rng.random()
        if op < 0.35:
            key = rng.randrange(40)
            entry = pool.lookup(bytes([key]), (key,))
            if entry is None:
                try:
                    entry = pool.insert(bytes([key]), (key,), rng.randint(1, 12))
                except PoolExhausted:
                    entry = None
            if entry is not None:
                held.append(entry)
        elif op < 0.75 and held:
            entry = held.pop(rng.randrange(len(held)))
            if not entry.ready and entry.indexed and rng.random() < 0.8:
                pool.mark_ready(entry)
            pool.release(entry)
        elif op < 0.8 and held:
            pool.forget({rng.choice(held).epoch})
        elif op < 0.82:
            pool.clear()
        pool.check_invariants()
    for entry in held:
        pool.release(entry)
    pool.check_invariants()
    assert pool.metrics.pool_refs_held == 0 and pool.metrics.pool_blocks_leaked == 0 and not pool.in_use


def filled_contexts(num_reqs: int, rotated: bool, gather: bool = True):
    """The context fills of one step (``ContextRunner.copy``) of ``num_reqs`` requests, each a sys
    prompt and four chunks read from ten pool entries, over vLLM's CPU KV layout (the copier's
    indexed path: ``gather``); returns the caches and a function running the copies."""
    from graphchunk.blend.rope import KeyRotation
    from graphchunk.cache.context_plan import UnitCopy
    from graphchunk.cache.context_run import ContextRunner
    from graphchunk.cache.kv_slots import KVCopier, KVSlotMap
    from graphchunk.metrics import CacheMetrics
    from test_kv_slots import BS, DIM, HEADS, write

    layers, pool, per_request = 2, 20, 2
    blocks = pool + per_request * num_reqs
    buffer = torch.randn(layers, blocks, HEADS, BS, 2 * DIM, generator=torch.Generator().manual_seed(num_reqs))
    caches = [buffer[i] for i in range(layers)]
    slot_map = KVSlotMap.probe(write(torch.float32), caches[0], 0, BS, HEADS, DIM)
    copier = KVCopier(caches, slot_map, blocks, gather=gather)
    angles = torch.arange(64.0)[:, None] * (1e-2 ** (torch.arange(0, DIM, 2) / DIM))[None]
    rotation = KeyRotation(torch.cat([angles.cos(), angles.sin()], dim=-1), DIM, is_neox_style=True)
    device = SimpleNamespace(copy_slots=copier.copy_slots,
                             copy_slots_rotated=lambda src, dst, deltas: copier.copy_slots_rotated(src, dst, deltas,
                                                                                                    rotation))
    runner = ContextRunner(BS, 64, CacheMetrics())
    rng = random.Random(num_reqs)
    entries = [((2 * e, 2 * e + 1), e + 1) for e in range(10)]  # (blocks, epoch)
    for entry_blocks, epoch in entries:
        runner.epochs.update({b: epoch for b in entry_blocks})
    requests = []
    for r in range(num_reqs):
        units, lo = [], 0
        for i, n in enumerate((5, 6, 6, 6, 6)):
            entry_blocks, epoch = rng.choice(entries)
            kind = "sys" if i == 0 else "rotated" if rotated else "chunk"
            units.append(UnitCopy(entry_blocks, rng.randrange(8), lo, lo + n, lo, kind, epoch))
            lo += n
        request_blocks = [pool + per_request * r + b for b in range(per_request)]
        requests.append((SimpleNamespace(block_ids=request_blocks, key_temperature=1.0, policy=None), units))
    return caches, lambda: runner.copy(requests, device)


@pytest.mark.parametrize("rotated", [False, True], ids=["isolated", "blend"])
def test_a_step_s_context_fills_are_a_fixed_set_of_tensor_operations(rotated):
    """Slot lists are built on the host; the copies of 8, 64 and 512 requests' contexts (five
    segments each, every one from a pool entry at its own offset) are the same tensor operations,
    and move what slicing each run of slots moves."""
    counted = {}
    for num_reqs in (8, 64, 512):
        caches, run = filled_contexts(num_reqs, rotated)
        counted[num_reqs] = tensor_ops(run)
        if num_reqs == 8:
            sliced, run_sliced = filled_contexts(num_reqs, rotated, gather=False)
            run_sliced()
            assert all(torch.equal(a, b) for a, b in zip(caches, sliced))
    assert counted[8] == counted[64] == counted[512] and counted[8], counted


@pytest.mark.parametrize("seed", range(30))
def test_a_step_s_slot_lists_are_what_each_unit_alone_names(seed):
    """``unit_slots`` builds the step's slot lists with array operations over all its units; each
    token's source, destination, kind, key temperature and rotation are what reading its unit
    alone gives (``slots_of`` per unit, as the fills were first written)."""
    from graphchunk.cache.context_plan import UnitCopy
    from graphchunk.cache.context_run import unit_slots
    from graphchunk.device import slots_of

    rng, bs = random.Random(seed), 16
    requests = []
    for _ in range(rng.randint(1, 6)):
        units, lo = [], 0
        for i in range(rng.randint(0, 5)):
            n = rng.randint(0, 40)
            begin = max(0, lo - rng.randint(0, 3)) if i else 0
            units.append(UnitCopy(tuple(rng.sample(range(1000, 2000), 5)), rng.randrange(bs), lo, lo + n, begin,
                                  rng.choice(["sys", "chunk", "rotated"]), 1))
            lo += n
        prompt = SimpleNamespace(block_ids=tuple(rng.sample(range(1000), 14)), key_temperature=rng.choice([1.0, 0.7]))
        requests.append((prompt, units))
    want = [[] for _ in range(5)]
    for prompt, units in requests:
        for u in units:
            n = u.hi - u.lo
            for part, values in zip(want, (
                    slots_of(u.entry_blocks, u.offset + np.arange(u.lo - u.begin, u.hi - u.begin), bs),
                    slots_of(prompt.block_ids, np.arange(u.lo, u.hi), bs), np.full(n, u.kind == "rotated"),
                    np.full(n, prompt.key_temperature if u.kind == "chunk" else 1.0), np.full(n, u.begin - u.offset))):
                part.append(values)
    got = unit_slots(requests, bs)
    if not any(units for _, units in requests):
        assert got is None
        return
    for name, g, w in zip(("src", "dst", "rotated", "temperature", "delta"), got, want):
        assert np.array_equal(g, np.concatenate(w)), name
