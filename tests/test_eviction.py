"""Eviction policies on constructed cases (who is evicted, and why) and exact pool accounting on
random traces under every policy."""
import math
import random
from collections import OrderedDict

import pytest

from graphchunk.cache.eviction import POLICIES, Belady, make_policy
from graphchunk.cache.pool import ChunkPool, PoolExhausted


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(pool: ChunkPool, i: int, num_tokens: int = 4, cost=None):
    """Inserts entry i, marks it ready and releases it: cached, unused."""
    entry = pool.insert(key(i), (i,), num_tokens, cost)
    pool.mark_ready(entry)
    pool.release(entry)
    return entry


def hit(pool: ChunkPool, i: int, times: int = 1) -> None:
    for _ in range(times):
        pool.release(pool.lookup(key(i), (i,)))


def cached(pool: ChunkPool) -> set[int]:
    return {int.from_bytes(k, "little") for k in pool._index}


def test_lru_evicts_least_recently_released():
    pool = ChunkPool(num_blocks=4, block_size=4, policy="lru")
    for i in (1, 2, 3, 4):
        put(pool, i)
    hit(pool, 1)  # order now 2, 3, 4, 1
    put(pool, 5)
    assert cached(pool) == {1, 3, 4, 5}
    hit(pool, 3)  # order 4, 1, 5, 3
    put(pool, 6, num_tokens=8)  # two blocks: 4 and 1 go
    assert cached(pool) == {3, 5, 6} and pool.metrics.evictions == 3
    pool.check_invariants()


@pytest.mark.parametrize("policy, evicted", [("lru", 1), ("lfu", 2), ("gdsf", 2)])
def test_frequency_keeps_a_hot_entry_over_recent_one_offs(policy, evicted):
    pool = ChunkPool(num_blocks=3, block_size=4, policy=policy)
    put(pool, 1)
    hit(pool, 1, times=3)  # 1: four uses, the least recent
    put(pool, 2)
    put(pool, 3)  # 2, 3: one use each, more recent
    put(pool, 4)
    assert evicted not in cached(pool) and len(cached(pool)) == 3


def test_gdsf_weighs_recompute_cost():
    pool = ChunkPool(num_blocks=2, block_size=4, policy="gdsf")
    put(pool, 1, cost=100)  # older, expensive
    put(pool, 2, cost=1)  # newer, cheap
    put(pool, 3)
    assert cached(pool) == {1, 3}
    lru = ChunkPool(num_blocks=2, block_size=4, policy="lru")
    for i, cost in ((1, 100), (2, 1), (3, None)):
        put(lru, i, cost=cost)
    assert cached(lru) == {2, 3}, "the case must separate the policies"


def test_gdsf_default_cost_is_tokens_per_block():
    pool = ChunkPool(num_blocks=4, block_size=4, policy="gdsf")
    put(pool, 1, num_tokens=8)  # 2 full blocks: 4 tokens a block
    put(pool, 2, num_tokens=5)  # 2 blocks, 2.5 tokens a block, newer
    put(pool, 3, num_tokens=4)
    assert cached(pool) == {1, 3}


def test_lfu_ages_a_formerly_hot_entry_out():
    """The clock rises to each victim's priority, so a stream of one-offs catches up with a
    hot entry no longer used (plain LFU would keep it forever)."""
    pool = ChunkPool(num_blocks=2, block_size=4, policy="lfu")
    put(pool, 0)
    hit(pool, 0, times=3)  # priority 4
    put(pool, 1)  # fills the pool; then each one-off evicts the previous one: priorities 1, 2, 3
    for i in (2, 3, 4):
        put(pool, i)
        assert 0 in cached(pool) and i - 1 not in cached(pool)
    assert pool.policy.clock == 3
    put(pool, 5)  # 4's priority is 3 + 1 = 4: ties with 0, which has waited longer
    assert cached(pool) == {4, 5}


def test_belady_evicts_the_furthest_next_use():
    next_use = {1: 5, 2: math.inf, 3: 10, 4: 7, 5: 6}
    pool = ChunkPool(num_blocks=3, block_size=4,
                     policy=Belady(lambda e: next_use[int.from_bytes(e.key, "little")]))
    for i in (1, 2, 3):
        put(pool, i)
    put(pool, 4)
    assert cached(pool) == {1, 3, 4}
    put(pool, 5, num_tokens=8)  # next uses 5, 10, 7: 3 then 4 go
    assert cached(pool) == {1, 5}


def in_use_policies():
    return [*POLICIES, "belady"]


def policy_of(name: str, next_use):
    return Belady(next_use) if name == "belady" else name


@pytest.mark.parametrize("name", in_use_policies())
def test_entries_in_use_are_never_evicted(name):
    pool = ChunkPool(num_blocks=4, block_size=4,
                     policy=policy_of(name, lambda e: math.inf if e.key == key(1) else 0))
    put(pool, 1, num_tokens=8)
    put(pool, 2, num_tokens=8)
    hit(pool, 2, times=5)
    held = pool.lookup(key(1), (1,))  # least recent, least hit, never used again: every policy's
    # first choice were it unused
    put(pool, 3, num_tokens=8)
    assert cached(pool) == {1, 3} and held.block_ids
    pinned = pool.insert(key(4), (4,), 8)  # evicts 3; now every block is in use
    with pytest.raises(PoolExhausted, match="entries in use"):
        pool.insert(key(5), (5,), 4)
    assert held.block_ids and pinned.block_ids
    pool.check_invariants()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"eviction policy must be one of \('lru', 'lfu', 'gdsf'\), got 'fifo'"):
        ChunkPool(num_blocks=4, block_size=4, policy="fifo")
    assert make_policy("gdsf") is not make_policy("gdsf"), "each pool gets its own policy state"


def random_trace(pool: ChunkPool, rng: random.Random, steps: int, on_step=None) -> None:
    """Requests of 1-4 keys (skewed), some with the same key under other tokens (collisions),
    some inserts left unready and released (a failed forward), references held across requests."""
    held = []
    for _ in range(steps):
        request = []
        for i in {int(rng.paretovariate(0.8)) % 40 for _ in range(rng.randint(1, 4))}:
            tokens = (i, rng.random() < 0.05)
            entry = pool.lookup(key(i), tokens)
            if entry is None:
                try:
                    entry = pool.insert(key(i), tokens, rng.randint(1, 20), rng.choice([None, 1, 50]))
                except PoolExhausted:
                    continue
                if rng.random() < 0.95:
                    pool.mark_ready(entry)
            request.append(entry)
        held.append(request)
        if len(held) > rng.randint(1, 3):
            for entry in held.pop(0):
                pool.release(entry)
        for entry in (e for r in held for e in r):
            assert entry.block_ids, "an entry in use lost its blocks"
        if on_step:
            on_step()
        pool.check_invariants()
    for request in held:
        for entry in request:
            pool.release(entry)
    pool.check_invariants()


@pytest.mark.parametrize("name", in_use_policies())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trace_keeps_the_accounting_exact(name, seed):
    rng = random.Random(seed)
    pool = ChunkPool(num_blocks=24, block_size=4, first_block_id=3, policy=policy_of(name, lambda e: rng.random()))
    random_trace(pool, rng, 600)
    assert pool.metrics.evictions > 50, "the trace must exercise eviction"
    assert set(pool._evictable.values()) == evictable_per_policy(pool)
    assert pool.num_free_blocks + sum(len(e.block_ids) for e in pool._evictable.values()) == pool.num_blocks


def evictable_per_policy(pool: ChunkPool) -> set:
    policy = pool.policy
    return set(policy._order) if hasattr(policy, "_order") else set(policy._live)


def test_lru_is_the_original_order():
    """Reference model of the pool before policies (an OrderedDict of unused entries, oldest
    evicted first) on a random trace: the same entries are cached after every step."""
    rng = random.Random(7)
    pool = ChunkPool(num_blocks=20, block_size=4, policy="lru")
    sizes, order, free, in_use = {}, OrderedDict(), 20, {}
    for _ in range(1500):
        i = int(rng.paretovariate(0.7)) % 30
        if rng.random() < 0.3 and in_use:  # release one held entry
            j = rng.choice(sorted(in_use))
            pool.release(in_use.pop(j))
            order[j] = None
        elif pool.lookup(key(i), (i,)) is not None:
            if i in in_use:
                pool.release(pool._index[key(i)])  # hold one reference per key at most
            else:
                in_use[i] = pool._index[key(i)]
                del order[i]
        else:
            blocks = rng.randint(1, 3)
            if free + sum(sizes[j] for j in order) < blocks:
                with pytest.raises(PoolExhausted):
                    pool.insert(key(i), (i,), 4 * blocks)
                continue
            while free < blocks:
                victim = next(iter(order))
                del order[victim]
                free += sizes.pop(victim)
            sizes[i], free = blocks, free - blocks
            in_use[i] = pool.insert(key(i), (i,), 4 * blocks)
            pool.mark_ready(in_use[i])
        assert cached(pool) == set(sizes)
    pool.check_invariants()
