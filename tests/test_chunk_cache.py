"""The step planner over a fake device whose "KV" of a token records what it was computed from.

A token's fake KV is (the tokens it attended to, its position); the fake forward checks that the
KV it attends to is already in place, so a missing partial-block copy or a wrong block table fails.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from graphchunk.cache.chunk_cache import ChunkCache, PseudoSeq, ScheduledPrompt, split_forward_batches
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.pool import ChunkPool, PoolExhausted
from graphchunk.metrics import COUNTERS, CacheMetrics
from graphchunk.segments import split_at

BS = 4


class FakeDevice:
    def __init__(self):
        self.kv = {}
        self.temperatures = {}  # slot: the key temperature of the copy that last wrote it
        self.forward_tokens = 0
        self.batches = []

    def slot(self, block_ids, i):
        return block_ids[i // BS] * BS + i % BS

    def prefill(self, seqs):
        self.batches.append(seqs)
        for seq in seqs:
            tokens = tuple(seq.token_ids)
            for j in range(seq.num_cached):
                assert self.kv.get(self.slot(seq.block_ids, j)) == (tokens[: j + 1], int(seq.positions[j])), \
                    "a pseudo-sequence attended to KV that is not its causal prefix"
            for i in range(seq.num_cached, len(tokens)):
                self.kv[self.slot(seq.block_ids, i)] = (tokens[: i + 1], int(seq.positions[i]))
                self.forward_tokens += 1

    def copy_blocks(self, src, dst):
        for s, d in zip(src, dst):
            for o in range(BS):
                if s * BS + o in self.kv:
                    self.kv[d * BS + o] = self.kv[s * BS + o]

    def copy_slots(self, src, dst, key_temperature=1.0):
        for s, d in zip(src.tolist(), dst.tolist()):
            self.kv[d] = self.kv[s]
            self.temperatures[d] = key_temperature

    def read_blocks(self, block_ids):
        return [self.kv.get(b * BS + o) for b in block_ids for o in range(BS)]

    def write_blocks(self, block_ids, data):
        for slot, value in zip([b * BS + o for b in block_ids for o in range(BS)], data, strict=True):
            self.kv[slot] = value

    def read_slots(self, slots):
        """The slots' fake KV as host memory keeps it, a tensor shaped as ``KVCopier.read_slots``
        gives it ([1 layer, 1, slots, 1, 1]): each element names its slot's KV in ``table``."""
        self.table = getattr(self, "table", [])
        first = len(self.table)
        self.table += [self.kv.get(slot) for slot in slots.tolist()]
        return torch.arange(first, len(self.table)).reshape(1, 1, -1, 1, 1)

    def write_slots(self, data, dst, key_temperature=1.0, deltas=None):
        assert deltas is None, "isolated only"
        for slot, name in zip(dst.tolist(), data.reshape(-1).tolist(), strict=True):
            self.kv[slot] = self.table[name]
            self.temperatures[slot] = key_temperature


class FakeTier:
    """The persistent tier's contract (``store.ChunkStore``): an entry's blocks by key, served
    only for the same tokens, mode and block count."""

    def __init__(self):
        self.files, self.loads, self.saves = {}, 0, 0

    def load(self, key, tokens, mode, num_blocks):
        found = self.files.get(key)
        if found is None or found[:3] != (tuple(tokens), mode, num_blocks):
            return None
        self.loads += 1
        return found[3]

    def save(self, key, tokens, num_tokens, mode, data):
        assert len(data) == -(-num_tokens // BS) * BS and None not in data[-BS:][: (num_tokens - 1) % BS + 1]
        self.saves += 1
        self.files[key] = (tuple(tokens), mode, len(data) // BS, list(data))


def expected_kv(seg, t):
    """Isolated semantics: what logical token t's KV is computed from."""
    lay = seg.layout
    sys = seg.sys_tokens
    if t < lay.sys_len:
        return sys[: t + 1], t
    for i, (begin, end) in enumerate(seg.bounds[1:-1]):
        if begin <= t < end:
            return sys + seg.chunk_tokens(i)[: t - begin + 1], lay.sys_len + t - begin


def make_prompt(sys_len, chunk_lens, q_len=2, base=0):
    ids, tok = [], 1000 + base
    lens = [sys_len, *chunk_lens, q_len]
    for n in lens:
        ids += [tok + k for k in range(n)]
        tok += 100
    boundaries = np.cumsum(lens[:-1]).tolist()
    return split_at(ids, boundaries, max_chunks=16, max_chunk_len=64)


def request_blocks(first, seg):
    return list(range(first, first + -(-seg.layout.num_tokens // BS)))


def cache(num_blocks=64, budget=1000, tier=None):
    return ChunkCache(ChunkPool(num_blocks, BS, first_block_id=1000), KeySpace("m", "f32"), budget, tier=tier)


def check_context(device, prompt):
    for t in range(prompt.start, prompt.context_end):
        slot = device.slot(prompt.block_ids, t)
        assert device.kv[slot] == expected_kv(prompt.seg, t), f"token {t}"


@pytest.mark.parametrize("sys_len", [0, 3, 4, 6])
def test_context_slots_hold_isolated_kv(sys_len):
    seg = make_prompt(sys_len, [5, 2, 7])
    device, cc = FakeDevice(), cache()
    prompt = ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(0, seg))
    cc.materialize([prompt], device)
    check_context(device, prompt)
    cc.pool.check_invariants()
    assert cc.pool.metrics.pool_blocks_used > 0 and all(e.ref_count == 0 for e in cc.pool._live.values())


def test_second_request_reuses_chunks_in_any_order():
    a = make_prompt(3, [5, 6])
    device, cc = FakeDevice(), cache()
    cc.materialize([ScheduledPrompt(a, None, 0, a.layout.num_tokens, request_blocks(0, a))], device)
    computed = device.forward_tokens
    assert (cc.metrics.lookups, cc.metrics.misses, cc.metrics.hits, cc.metrics.tokens_reused) == (2, 2, 0, 0)
    ids = list(a.sys_tokens) + list(a.chunk_tokens(1)) + list(a.chunk_tokens(0)) + list(a.question_tokens)
    b = split_at(ids, [3, 9, 14], max_chunks=4, max_chunk_len=64)
    prompt = ScheduledPrompt(b, None, 0, b.layout.num_tokens, request_blocks(20, b))
    cc.materialize([prompt], device)
    assert device.forward_tokens == computed, "all hits: nothing recomputed"
    check_context(device, prompt)
    assert (cc.metrics.lookups, cc.metrics.hits, cc.metrics.tokens_reused) == (4, 2, 3 + 11)


def test_key_temperature_divides_only_the_chunk_keys_copied_into_its_request():
    """Isolated mode's key temperature: a request's chunk tokens are copied with it, its sys tokens
    and another request's copies of the same entries with their own (1), and the pool's slots are
    never written by a copy (one cached entry serves every temperature)."""
    seg = make_prompt(3, [5, 6])
    device, cc = FakeDevice(), cache()
    hot = ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(0, seg), key_temperature=0.5)
    plain = ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(20, seg))
    cc.materialize([hot, plain], device)
    for prompt, chunk_temperature in ((hot, 0.5), (plain, 1.0)):
        check_context(device, prompt)
        for t in range(seg.layout.context_len):
            want = 1.0 if t < seg.layout.sys_len else chunk_temperature
            assert device.temperatures[device.slot(prompt.block_ids, t)] == want, f"token {t}"
    pool_slots = {b * BS + o for e in cc.pool._live.values() for b in e.block_ids for o in range(BS)}
    assert pool_slots and not pool_slots & set(device.temperatures), "a copy wrote into the pool"
    assert (cc.metrics.misses, cc.metrics.hits) == (2, 2)


def test_identical_chunks_in_one_step_are_computed_once():
    a, b = make_prompt(3, [5, 6]), make_prompt(3, [5, 6])
    device, cc = FakeDevice(), cache()
    prompts = [ScheduledPrompt(s, None, 0, s.layout.num_tokens, request_blocks(f, s)) for s, f in ((a, 0), (b, 20))]
    cc.materialize(prompts, device)
    assert device.forward_tokens == 3 + 5 + 6
    assert (cc.metrics.misses, cc.metrics.hits) == (2, 2)  # b found a's in-flight entries
    for p in prompts:
        check_context(device, p)


def test_salt_separates_tenants():
    a = make_prompt(3, [5])
    device, cc = FakeDevice(), cache()
    for salt, first in (("t1", 0), ("t2", 20)):
        cc.materialize([ScheduledPrompt(a, salt, 0, a.layout.num_tokens, request_blocks(first, a))], device)
    assert device.forward_tokens == 2 * (3 + 5)


@settings(max_examples=60, deadline=None)
@given(sys_len=st.integers(0, 9), chunk_lens=st.lists(st.integers(1, 12), min_size=1, max_size=5),
       cuts=st.lists(st.integers(1, 40), min_size=1, max_size=4), budget=st.integers(3, 20))
def test_chunked_prefill_ranges_fill_exactly_their_slots(sys_len, chunk_lens, cuts, budget):
    """Any split of the prompt into scheduled ranges fills each range's context slots correctly."""
    seg = make_prompt(sys_len, chunk_lens)
    device, cc = FakeDevice(), cache(budget=budget)
    blocks = request_blocks(0, seg)
    start = 0
    for cut in cuts + [seg.layout.num_tokens]:
        end = min(start + cut, seg.layout.num_tokens)
        if end <= start:
            break
        prompt = ScheduledPrompt(seg, None, start, end, blocks)
        cc.materialize([prompt], device)
        check_context(device, prompt)
        start = end
    assert all(sum(s.num_new for s in batch) <= budget for batch in device.batches)
    cc.pool.check_invariants()


def test_small_pool_runs_the_step_in_groups():
    # Each unit (sys + one chunk) fits; all of them at once do not.
    segs = [make_prompt(4, [8, 8], base=b) for b in range(3)]
    device, cc = FakeDevice(), cache(num_blocks=7)
    prompts = [ScheduledPrompt(s, None, 0, s.layout.num_tokens, request_blocks(30 * i, s)) for i, s in enumerate(segs)]
    cc.materialize(prompts, device)
    for p in prompts:
        check_context(device, p)
    assert cc.metrics.evictions > 0
    cc.pool.check_invariants()


def test_unit_larger_than_pool_surfaces():
    seg = make_prompt(4, [30])
    with pytest.raises(PoolExhausted):
        cache(num_blocks=5).materialize([ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(0, seg))],
                                        FakeDevice())


@settings(max_examples=60, deadline=None)
@given(sys_len=st.integers(0, 40), chunk_lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       repeat=st.booleans(), mode=st.sampled_from(["isolated", "blend"]), prefix_len=st.integers(0, 20))
def test_context_blocks_are_the_blocks_a_plan_takes(sys_len, chunk_lens, repeat, mode, prefix_len):
    """``context_blocks`` (what the API process refuses a context by) equals the pool blocks a plan
    of the whole context takes on an empty pool, a repeated chunk counted once; a pool one block
    smaller cannot hold it."""
    from graphchunk.cache.context_plan import ContextPlanner, context_blocks

    seg = make_prompt(sys_len, chunk_lens + chunk_lens[:1] * repeat)
    if repeat:  # the repeated chunk: the same tokens as the first
        ids, first = list(seg.token_ids), seg.bounds[1]
        last = seg.bounds[-2]
        ids[last[0]:last[1]] = ids[first[0]:first[1]]
        seg = split_at(ids, [b for b, _ in seg.bounds[1:]], max_chunks=16, max_chunk_len=64)
    space = KeySpace("m", "f32", blend_prefix=tuple(range(7, 7 + prefix_len)))
    needed = context_blocks(seg, mode, BS, prefix_len)
    pool = ChunkPool(200, BS, first_block_id=1000)
    ContextPlanner(pool, space).plan(seg, None, mode, 0, seg.layout.context_len)
    assert pool.num_blocks - len(pool._free) == needed
    if needed > 1:
        with pytest.raises(PoolExhausted):
            ContextPlanner(ChunkPool(needed - 1, BS, first_block_id=1000), space).plan(seg, None, mode, 0,
                                                                                       seg.layout.context_len)


def test_split_forward_batches_respects_budget_and_order():
    seqs = [PseudoSeq(list(range(10)), np.arange(10), [0, 1, 2], 2), PseudoSeq([1, 2, 3], np.arange(3), [5], 0)]
    batches = split_forward_batches(seqs, 4)
    assert [[(len(s.token_ids), s.num_cached) for s in b] for b in batches] == [[(6, 2)], [(10, 6)], [(3, 0)]]


def test_tier_serves_another_pool_without_computing():
    """Server A computes (and writes through); server B, a fresh pool over the same tier, loads
    sys and chunks behind the same sys in another order and computes nothing."""
    tier, a = FakeTier(), make_prompt(6, [5, 7])
    device_a, cc_a = FakeDevice(), cache(tier=tier)
    cc_a.materialize([ScheduledPrompt(a, None, 0, a.layout.num_tokens, request_blocks(0, a))], device_a)
    assert tier.saves == 3 and (cc_a.metrics.misses, cc_a.metrics.tier_hits) == (2, 0)
    ids = list(a.sys_tokens) + list(a.chunk_tokens(1)) + list(a.chunk_tokens(0)) + list(a.question_tokens)
    b = split_at(ids, [6, 13, 18], max_chunks=4, max_chunk_len=64)
    device_b, cc_b = FakeDevice(), cache(tier=tier)
    prompt = ScheduledPrompt(b, None, 0, b.layout.num_tokens, request_blocks(0, b))
    cc_b.materialize([prompt], device_b)
    check_context(device_b, prompt)
    assert device_b.forward_tokens == 0 and tier.loads == 3 and tier.saves == 3
    m = cc_b.metrics
    assert (m.lookups, m.hits, m.tier_hits, m.misses, m.tokens_reused) == (2, 0, 2, 0, 6 + 12)
    cc_b.pool.check_invariants()


def test_a_tier_hit_in_a_later_step_never_takes_a_miss_back():
    """A chunk's miss job that the tier serves steps after its plan was counted (jobs ahead of it
    took the steps' budgets): every counter only grows from step to step (a decrease would be a
    negative Prometheus increment), and the outcome is a tier hit, not a miss."""
    tier, a = FakeTier(), make_prompt(6, [5, 7])
    cache(tier=tier).materialize([ScheduledPrompt(a, None, 0, a.layout.num_tokens, request_blocks(0, a))],
                                 FakeDevice())
    ids = list(a.sys_tokens) + [300 + t for t in range(9)] + list(a.chunk_tokens(1)) + list(a.question_tokens)
    b = split_at(ids, [6, 15, 22], max_chunks=4, max_chunk_len=64)
    device, cc = FakeDevice(), cache(tier=tier)
    plan = cc.planner.plan(b, None, "isolated", 0, b.layout.context_len)
    cc.runner.add_jobs(plan.jobs)
    cc.runner.count(plan.counts)
    counted = [[getattr(cc.metrics, name) for name in COUNTERS]]
    while cc.runner.done_before <= plan.needs:
        cc.runner.run_jobs(device, budget=4)
        counted.append([getattr(cc.metrics, name) for name in COUNTERS])
    assert len(counted) > 3 and tier.loads == 2  # the sys entry and chunk 1 from the tier, chunk 0 computed
    for before, after in zip(counted, counted[1:]):
        assert all(b <= a for b, a in zip(before, after)), dict(zip(COUNTERS, zip(before, after)))
    m = cc.metrics
    assert (m.lookups, m.hits, m.tier_hits, m.misses) == (2, 0, 1, 1)


def test_tier_miss_on_another_salt_or_sys():
    tier, a = FakeTier(), make_prompt(6, [5])
    cache(tier=tier).materialize([ScheduledPrompt(a, "t1", 0, a.layout.num_tokens, request_blocks(0, a))],
                                 FakeDevice())
    for salt, seg in (("t2", a), ("t1", make_prompt(5, [5]))):
        device, cc = FakeDevice(), cache(tier=tier)
        prompt = ScheduledPrompt(seg, salt, 0, seg.layout.num_tokens, request_blocks(0, seg))
        cc.materialize([prompt], device)
        check_context(device, prompt)
        assert (cc.metrics.tier_hits, cc.metrics.misses) == (0, 1)


@settings(max_examples=40, deadline=None)
@given(picks=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=1, max_size=8),
       pools=st.integers(6, 12))
def test_small_pool_over_a_tier_computes_each_entry_once(picks, pools):
    """Evicted entries come back from the tier: every context stays exact and each distinct
    chunk (and the sys prompt) is computed once over the whole trace, whatever the pool size."""
    tier, device = FakeTier(), FakeDevice()
    cc = cache(num_blocks=pools, tier=tier)
    distinct = run_trace(cc, device, picks)
    assert device.forward_tokens == 3 + sum(len(TRACE_DOCS[d]) for d in distinct)
    assert cc.metrics.misses == len(distinct) and tier.saves == 1 + len(distinct)


TRACE_DOCS = [make_prompt(3, [5 + d], base=d).chunk_tokens(0) for d in range(6)]
"""The documents ``run_trace``'s requests pick from (5 to 10 tokens)."""


def run_trace(cc, device, picks, after_each=lambda: None) -> set[int]:
    """One request per pick of ``TRACE_DOCS`` behind a 3-token sys prompt, materialized in turn:
    every context exact and the pool's invariants held after each (then ``after_each()``); returns
    the documents picked."""
    sys = tuple(range(500, 503))
    for i, pick in enumerate(picks):
        ids = list(sys) + [t for d in pick for t in TRACE_DOCS[d]] + [9, 9]
        bounds = np.cumsum([3] + [len(TRACE_DOCS[d]) for d in pick]).tolist()
        seg = split_at(ids, bounds, max_chunks=4, max_chunk_len=64)
        prompt = ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(100 * i, seg))
        cc.materialize([prompt], device)
        check_context(device, prompt)
        cc.pool.check_invariants()
        after_each()
    return {d for pick in picks for d in pick}


@settings(max_examples=30, deadline=None)
@given(picks=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=2, max_size=8),
       pools=st.integers(6, 10), host_entries=st.sampled_from([2, 100]))
def test_small_pool_over_host_memory_alone(picks, pools, host_entries):
    """host_bytes without store_path: entries evicted from the pool come back from host memory,
    every context exact; with room for every entry each is computed once, and every load is a host
    hit; with room for about two, host memory drops the least recently used and keeps to its budget,
    and the workers' payloads are exactly what the scheduler's index holds."""
    device, metrics = FakeDevice(), CacheMetrics()
    budget = host_entries * 10 * 8  # entries of up to 10 tokens, 8-byte names
    cc = ChunkCache(ChunkPool(pools, BS, first_block_id=1000, metrics=metrics), KeySpace("m", "f32"), 1000,
                    host=HostTier(budget, metrics), host_tokens=budget // 8)

    def within_budget():
        assert metrics.tier_host_bytes <= budget
        cc.planner.host.check_invariants()
        assert set(cc.runner.host._payloads) == set(cc.planner.host._live) - set(cc.planner.host._drops)

    distinct = run_trace(cc, device, picks, within_budget)
    assert metrics.tier_loads == metrics.tier_host_hits and metrics.lookups == metrics.hits + metrics.tier_hits + \
        metrics.misses
    if host_entries == 100:
        assert device.forward_tokens == 3 + sum(len(TRACE_DOCS[d]) for d in distinct)
        assert metrics.misses == len(distinct) and metrics.tier_hits == metrics.lookups - metrics.hits - len(distinct)


def test_an_entry_evicted_from_the_pool_is_served_from_host_memory():
    """The same request twice through a pool that holds one context: the second finds its chunks
    evicted by a request in between and loads them from host memory, computing nothing."""
    a, b = make_prompt(3, [5, 7]), make_prompt(3, [6, 6], base=50)
    device, metrics = FakeDevice(), CacheMetrics()
    cc = ChunkCache(ChunkPool(6, BS, first_block_id=1000, metrics=metrics), KeySpace("m", "f32"), 1000,
                    host=HostTier(1 << 20, metrics), host_tokens=1 << 17)
    for i, seg in enumerate([a, b, a]):
        prompt = ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(100 * i, seg))
        computed = device.forward_tokens
        cc.materialize([prompt], device)
        check_context(device, prompt)
    assert device.forward_tokens == computed and metrics.evictions > 0
    assert (metrics.tier_hits, metrics.misses) == (2, 4) and metrics.tier_host_hits == metrics.tier_loads >= 2
    # One copy: the chunks came from host memory into the request's slots, taking no pool block
    # (the sys prompt, which chunk jobs read from the pool, was loaded into it).
    assert not any(cc.pool.contains(*cc.planner._identity(a, None, "isolated", i)) for i in range(2))
    assert cc.pool.contains(*cc.planner._identity(a, None, "isolated", None))


# --- the epoch check: a copy reads only what it planned (context_run.py) ------------------------

def planned_hit(cc, seg, first_block):
    """``seg``'s context, computed into the pool, then planned again as all hits (units and all)."""
    prompt = ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(first_block, seg))
    plan = cc.planner.plan(seg, None, "isolated", 0, seg.layout.context_len)
    cc.runner.add_jobs(plan.jobs)
    cc.runner.run_jobs(FakeDevice())
    cc.planner.finish_jobs(cc.runner.done_before)
    cc.planner.release(plan)
    return prompt, cc.planner.plan(seg, None, "isolated", 0, seg.layout.context_len)


def test_a_copy_from_blocks_a_later_entry_took_fails_the_request_instead_of_reading_them():
    """A lifetime bug made visible: the plan's entries released too early, evicted, and their blocks
    rewritten by another entry's job before the copy ran. The copy does not run; the request's
    blocks from its first filled one on are reported invalid (vLLM fails it and evicts them)."""
    a, b = make_prompt(3, [5, 6]), make_prompt(3, [7, 6], base=50)
    device, cc = FakeDevice(), cache(num_blocks=8)  # a's entries take 6 blocks, b's 7
    prompt, plan = planned_hit(cc, a, first_block=0)
    cc.planner.release(plan)  # the bug: released before its copy ran
    other = cc.planner.plan(b, None, "isolated", 0, b.layout.context_len)  # evicts a's entries
    cc.runner.add_jobs(other.jobs)
    cc.runner.run_jobs(device)
    assert {blk for u in plan.units for blk in u.entry_blocks} & {blk for j in other.jobs for blk in j.entry_blocks}
    filled = cc.runner.fill([(prompt, plan.units)], device)
    assert filled == [] and cc.runner.take_invalid() == set(prompt.block_ids)
    assert not any(device.slot(prompt.block_ids, t) in device.kv for t in range(a.layout.context_len))
    assert cc.runner.take_invalid() == set()  # reported once


def test_copies_from_blocks_their_entry_still_holds_pass_the_check():
    a = make_prompt(3, [5, 6])
    device, cc = FakeDevice(), cache()
    prompt = ScheduledPrompt(a, None, 0, a.layout.num_tokens, request_blocks(0, a))
    plan = cc.planner.plan(a, None, "isolated", 0, a.layout.context_len)
    cc.runner.add_jobs(plan.jobs)
    cc.runner.run_jobs(device)
    cc.planner.finish_jobs(cc.runner.done_before)
    assert cc.runner.fill([(prompt, plan.units)], device) == [prompt] and cc.runner.take_invalid() == set()
    check_context(device, prompt)


def test_a_job_reading_blocks_that_changed_poisons_its_entry():
    """An isolated chunk's job reads its sys entry's blocks: if they no longer hold that entry, the
    chunk's entry is poisoned, never written to the tier, and every copy from it fails."""
    a = make_prompt(6, [5])
    device, cc = FakeDevice(), cache()
    plan = cc.planner.plan(a, None, "isolated", 0, a.layout.context_len)
    sys_job, chunk_job = plan.jobs
    cc.runner.add_jobs([sys_job])
    cc.runner.run_jobs(device)
    for block in sys_job.entry_blocks:
        cc.runner.epochs[block] += 1000  # another entry's job wrote there meanwhile
    cc.runner.add_jobs([chunk_job])
    cc.runner.run_jobs(device)
    cc.planner.finish_jobs(cc.runner.done_before)
    prompt = ScheduledPrompt(a, None, 0, a.layout.num_tokens, request_blocks(0, a))
    chunk_unit = [u for u in plan.units if u.kind == "chunk"]
    assert cc.runner.fill([(prompt, chunk_unit)], device) == []
    assert cc.runner.take_invalid() == set(prompt.block_ids[chunk_unit[0].lo // BS:])
    assert cc.runner.take_failed() == {chunk_job.epoch, sys_job.epoch}  # what it read leaves the index too


# --- host memory's check: a copy reads only a payload that is there (context_run.py) -------------

def host_cache(num_blocks=64):
    metrics = CacheMetrics()
    return ChunkCache(ChunkPool(num_blocks, BS, first_block_id=1000, metrics=metrics), KeySpace("m", "f32"), 1000,
                      host=HostTier(1 << 20, metrics), host_tokens=1 << 17)


def from_host(cc, seg, device):
    """``seg``'s context computed (and saved to host memory), the pool emptied: a new plan of it
    copies its chunks from host memory and loads its sys prompt from there (its jobs not yet run)."""
    cc.materialize([ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(0, seg))], device)
    cc.pool.clear()
    plan = cc.planner.plan(seg, None, "isolated", 0, seg.layout.context_len)
    assert [u.host for u in plan.units] == [False] + [True] * seg.layout.num_chunks
    assert [job.host_source >= 0 for job in plan.jobs] == [True]  # the sys prompt, into the pool
    return ScheduledPrompt(seg, None, 0, seg.layout.num_tokens, request_blocks(200, seg)), plan


def test_a_copy_from_a_host_payload_that_is_gone_plans_the_request_again():
    """A host entry the index holds ready but whose payload a worker lacks (a save that failed):
    the copy does not run, the request's blocks from its first chunk on are reported invalid, the
    request planned again, and the entry leaves the index: the next plan computes the chunk."""
    a = make_prompt(3, [5, 6])
    device, cc = FakeDevice(), host_cache()
    prompt, plan = from_host(cc, a, device)
    cc.runner.add_jobs(plan.jobs)
    cc.runner.run_jobs(device)
    cc.planner.finish_jobs(cc.runner.done_before)
    gone = plan.units[2]
    cc.runner.host.drop([gone.epoch])
    assert cc.runner.fill([(prompt, plan.units)], device) == []
    assert cc.runner.take_invalid() == set(prompt.block_ids[plan.units[1].lo // BS:])
    assert cc.runner.take_refill() == {""} and cc.runner.take_failed() == {gone.epoch}
    cc.planner.fail_entries({gone.epoch})
    cc.planner.release(plan)
    cc.planner.host.check_invariants()
    again = cc.planner.plan(a, None, "isolated", 0, a.layout.context_len)
    assert [u.host for u in again.units] == [False, True, False] and len(again.jobs) == 1  # chunk 1 computed
    cc.runner.drop_host(cc.planner.take_host_drops())
    assert cc.runner.host.get(gone.epoch) is None and cc.runner.host.get(plan.units[1].epoch) is not None


def test_a_sys_prompt_whose_payload_is_gone_is_computed_instead():
    """A sys prompt's job that would load from host memory finds its payload gone: it computes the
    entry instead (exact: the chunks copied behind it read the same KV) and reports the payload, so
    that the index forgets it."""
    a = make_prompt(6, [5, 6])
    device, cc = FakeDevice(), host_cache()
    prompt, plan = from_host(cc, a, device)
    (job,) = plan.jobs
    cc.runner.host.drop([job.host_source])
    computed = device.forward_tokens
    cc.runner.add_jobs(plan.jobs)
    cc.runner.run_jobs(device)
    cc.planner.finish_jobs(cc.runner.done_before)
    assert device.forward_tokens == computed + a.layout.sys_len
    assert cc.runner.take_failed() == {job.host_source}
    assert cc.runner.fill([(prompt, plan.units)], device) == [prompt]
    check_context(device, prompt)
    cc.planner.release(plan)
    cc.planner.fail_entries({job.host_source})
    cc.planner.host.check_invariants()
    assert not cc.planner.host.contains(*cc.planner._identity(a, None, "isolated", None))
