"""Pool allocator and index: budget, LRU eviction, refcounts, exact accounting."""
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from graphchunk.cache.pool import ChunkPool, PoolExhausted
from graphchunk.metrics import CacheMetrics


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(pool: ChunkPool, i: int, num_tokens: int):
    entry = pool.insert(key(i), (i,), num_tokens)
    pool.mark_ready(entry)
    return entry


def test_hit_requires_matching_tokens():
    pool = ChunkPool(num_blocks=8, block_size=4)
    entry = put(pool, 1, 5)
    pool.release(entry)
    assert pool.lookup(key(1), (1,)) is entry
    assert pool.lookup(key(1), (2,)) is None, "a hash hit with other tokens is a miss"
    assert entry.ref_count == 1


def test_lru_evicts_oldest_unused_entry_only():
    pool = ChunkPool(num_blocks=4, block_size=4)
    a, b = put(pool, 1, 8), put(pool, 2, 8)
    pool.release(a)
    pool.release(b)
    assert pool.lookup(key(1), (1,)) is a  # a is now in use and most recent
    c = put(pool, 3, 8)  # needs 2 blocks: evicts b, the only unused entry
    assert pool.lookup(key(2), (2,)) is None
    assert a.block_ids and c.block_ids and pool.metrics.evictions == 1
    pool.check_invariants()


def test_entries_in_use_are_never_evicted():
    pool = ChunkPool(num_blocks=4, block_size=4)
    put(pool, 1, 16)
    with pytest.raises(PoolExhausted, match="entries in use"):
        put(pool, 2, 4)
    with pytest.raises(PoolExhausted, match="more than the pool"):
        put(pool, 3, 17)
    pool.check_invariants()


def test_colliding_key_gets_an_unindexed_entry_freed_on_release():
    pool = ChunkPool(num_blocks=4, block_size=4)
    first = put(pool, 1, 4)
    other = pool.insert(key(1), (99,), 4)
    assert not other.indexed and pool.num_free_blocks == 2
    pool.release(other)
    assert pool.num_free_blocks == 3 and pool.lookup(key(1), (1,)) is first
    pool.check_invariants()


def test_unready_entry_is_dropped_when_its_creator_releases_it():
    pool = ChunkPool(num_blocks=4, block_size=4)
    entry = pool.insert(key(1), (1,), 4)
    pool.release(entry)  # e.g. the forward that would fill it failed
    assert pool.lookup(key(1), (1,)) is None and pool.num_free_blocks == 4


def test_metrics_track_usage():
    metrics = CacheMetrics()
    pool = ChunkPool(num_blocks=10, block_size=2, first_block_id=100, metrics=metrics)
    entry = put(pool, 1, 5)
    assert metrics.pool_blocks_used == 3 and metrics.pool_utilization == pytest.approx(0.3)
    assert all(100 <= b < 110 for b in entry.block_ids)


class PoolMachine(RuleBasedStateMachine):
    """Any sequence of operations keeps the accounting exact and never evicts an entry in use."""

    def __init__(self):
        super().__init__()
        self.pool = ChunkPool(num_blocks=12, block_size=3, first_block_id=7)
        self.held: list = []  # one element per reference we hold

    @rule(i=st.integers(0, 9), tokens=st.integers(1, 15))
    def insert(self, i, tokens):
        free_before = self.pool.num_free_blocks
        try:
            entry = self.pool.insert(key(i), (i, tokens), tokens)
        except PoolExhausted:
            in_use = sum(len(e.block_ids) for e in set(self.held))
            assert self.pool.blocks_for(tokens) > self.pool.num_blocks - in_use
            assert self.pool.num_free_blocks == free_before
            return
        if entry.indexed:
            self.pool.mark_ready(entry)
        self.held.append(entry)

    @rule(i=st.integers(0, 9), tokens=st.integers(1, 15))
    def lookup(self, i, tokens):
        entry = self.pool.lookup(key(i), (i, tokens))
        if entry is not None:
            assert entry.tokens == (i, tokens)
            self.held.append(entry)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        entry = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.release(entry)

    @invariant()
    def accounting_is_exact(self):
        self.pool.check_invariants()
        for entry in self.held:
            assert entry.block_ids, "an entry in use lost its blocks"
            assert entry.ref_count == sum(e is entry for e in self.held)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
