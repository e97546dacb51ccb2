"""The chunk pool: a fixed budget of KV blocks holding cached sys and chunk KV, with an index.

Blocks are ids in ``[first_block_id, first_block_id + num_blocks)`` of the per-layer KV tensors;
the pool only does the bookkeeping. Entries in use (``ref_count > 0``) are never evicted;
unused ones stay cached and, when blocks run out, are evicted in the order of the pool's
eviction policy (``eviction.py``: ``lru``, ``lfu``, ``gdsf``; default ``DEFAULT_POLICY``).

**Cost rule.** Every operation costs what it touches (the entry looked up, inserted, released,
evicted or forgotten), never the pool's size: it runs inside vLLM's ``schedule()`` several times a
step and once per request, and a pool of a GPU's KV budget holds thousands to a hundred thousand
entries (DESIGN.md §10). The accounting a leak would show in (references held, blocks used that no
indexed entry owns: the gauges ``pool_refs_held``, ``pool_blocks_leaked``) is kept in the metrics
by each operation, as it changes; ``check_invariants`` recounts everything by walking the pool,
for tests only.
"""
from __future__ import annotations

from dataclasses import dataclass

from graphchunk.cache.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from graphchunk.metrics import CacheMetrics


def cdiv(a: int, b: int) -> int:
    """Ceiling division (blocks of ``b`` tokens holding ``a`` tokens), as vLLM's
    ``vllm.utils.math_utils.cdiv``: importing that imports vllm, torch and inductor (seconds),
    and the engine-independent core (this pool, ``config.py``) imports without vLLM."""
    return -(a // -b)


class PoolExhausted(RuntimeError):
    """Every pool block belongs to an entry in use: the step needs more than the budget."""


@dataclass(eq=False)
class PoolEntry:
    key: bytes
    tokens: tuple[int, ...]
    """What the KV was computed from; a hash hit is verified against it."""
    num_tokens: int
    """KV tokens stored, in block order from the first slot of ``block_ids[0]``."""
    block_ids: list[int]
    ref_count: int = 0
    ready: bool = False
    """The KV has been written; until then only the entry's creator may read it."""
    indexed: bool = True
    """False for an entry whose key collided with another's tokens: freed on its last release."""
    job_id: int = -1
    """The job computing it while not ready (``context_plan.py``)."""
    epoch: int = 0
    """Which incarnation of its blocks' contents this entry is: unique per insert, never reused.
    The job that writes the entry stamps its blocks with it in the workers, and every copy planned
    from the entry names it (``context_run.py`` checks the two agree)."""


class ChunkPool:
    def __init__(self, num_blocks: int, block_size: int, first_block_id: int = 0,
                 metrics: CacheMetrics | None = None, policy: str | EvictionPolicy = DEFAULT_POLICY):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.first_block_id = first_block_id
        self.metrics = metrics or CacheMetrics()
        self.metrics.pool_blocks_total = num_blocks
        self._free = list(range(first_block_id + num_blocks - 1, first_block_id - 1, -1))
        self._index: dict[bytes, PoolEntry] = {}
        self.policy = make_policy(policy)
        self._evictable: dict[bytes, PoolEntry] = {}
        self._evictable_blocks = 0
        self._live: dict[int, PoolEntry] = {}
        """Entries holding blocks, by epoch (indexed or not: one whose key collided, one forgotten
        while in use)."""
        self._refs_held = 0
        """Sum of the live entries' ``ref_count`` (the metrics' ``pool_refs_held``)."""
        self._indexed_blocks = 0
        """Blocks held by indexed entries."""
        self._epochs = 0
        self.listener = None
        """Told of entries that became ready (``stored(entry)``) and of ready entries dropped
        (``removed(entry)``): the KV-event stream's source (``engine/context_scheduler.py``)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> bool:
        """Whether any entry is referenced (a plan, a job): blocks that may be freed later."""
        return self._refs_held > 0

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def lookup(self, key: bytes, tokens: tuple[int, ...]) -> PoolEntry | None:
        """The ready or in-flight entry for ``key`` whose tokens match, acquired; else None."""
        entry = self._index.get(key)
        if entry is None or entry.tokens != tokens:
            return None
        self.policy.hit(entry)
        self.acquire(entry)
        return entry

    def contains(self, key: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether a ready or in-flight entry for ``key`` with these tokens exists (nothing acquired,
        no hit recorded)."""
        entry = self._index.get(key)
        return entry is not None and entry.tokens == tokens

    def insert(self, key: bytes, tokens: tuple[int, ...], num_tokens: int, cost: float | None = None) -> PoolEntry:
        """A new entry with room for ``num_tokens``, acquired once, not yet ready. ``cost``: what a
        miss on it costs, in tokens recomputed (default ``num_tokens``); the gdsf policy weighs it."""
        needed = self.blocks_for(num_tokens)
        if needed > self.num_blocks:
            raise PoolExhausted(f"{num_tokens} tokens need {needed} blocks, more than the pool's {self.num_blocks}")
        reclaimable = len(self._free) + self._evictable_blocks
        if reclaimable < needed:
            raise PoolExhausted(f"{num_tokens} tokens need {needed} free blocks; {len(self._free)} are free "
                                f"and only {reclaimable} reclaimable, the rest belong to entries in use")
        if key in self._evictable:  # same key, other tokens, unused: the newcomer replaces it
            self._evict(key)
        while len(self._free) < needed:
            self._evict(self.policy.victim().key)
        self._epochs += 1
        entry = PoolEntry(key, tokens, num_tokens, [self._free.pop() for _ in range(needed)], ref_count=1,
                          epoch=self._epochs)
        entry.indexed = key not in self._index
        if entry.indexed:
            self._index[key] = entry
            self._indexed_blocks += needed
            self.policy.inserted(entry, num_tokens if cost is None else cost)
        self._live[entry.epoch] = entry
        self._count_refs(1)
        self._update_usage()
        return entry

    def acquire(self, entry: PoolEntry) -> None:
        entry.ref_count += 1
        self._count_refs(1)
        if entry.indexed and self._evictable.pop(entry.key, None) is not None:
            self._evictable_blocks -= len(entry.block_ids)
            self.policy.in_use(entry)

    def release(self, entry: PoolEntry) -> None:
        if entry.ref_count < 1:
            raise RuntimeError(f"release of an entry not in use: {entry.key.hex()}")
        entry.ref_count -= 1
        self._count_refs(-1)
        if entry.ref_count:
            return
        if entry.indexed and entry.ready:
            self._evictable[entry.key] = entry
            self._evictable_blocks += len(entry.block_ids)
            self.policy.evictable(entry)
        else:
            self._drop(entry)

    def mark_ready(self, entry: PoolEntry) -> None:
        entry.ready = True
        if self.listener is not None and entry.indexed:
            self.listener.stored(entry)

    def forget(self, epochs) -> int:
        """Drops from the index every live entry whose epoch is in ``epochs`` (a worker found it not
        holding what was planned): no later lookup finds it, and its blocks are freed with its last
        reference. Returns how many entries left the index."""
        bad = [entry for epoch in epochs if (entry := self._live.get(epoch)) is not None and entry.indexed]
        for entry in bad:
            if entry.ref_count:
                self._unindex(entry)
            else:
                self._drop(entry)
        self.metrics.entries_failed += len(bad)
        return len(bad)

    def clear(self) -> int:
        """Drops every unused entry (an operator's reset, as vLLM's ``reset_prefix_cache``);
        entries in use stay. Returns how many were dropped."""
        unused = list(self._evictable.values())
        for entry in unused:
            self._drop(entry)
        return len(unused)

    def _evict(self, key: bytes) -> None:
        self._drop(self._evictable[key])
        self.metrics.evictions += 1

    def _unindex(self, entry: PoolEntry) -> None:
        if self.listener is not None and entry.ready:
            self.listener.removed(entry)
        del self._index[entry.key]
        self._indexed_blocks -= len(entry.block_ids)
        self._update_usage()
        if self._evictable.pop(entry.key, None) is not None:
            self._evictable_blocks -= len(entry.block_ids)
        self.policy.dropped(entry)
        entry.indexed = False

    def _drop(self, entry: PoolEntry) -> None:
        if entry.indexed:
            self._unindex(entry)
        del self._live[entry.epoch]
        self._free.extend(reversed(entry.block_ids))
        entry.block_ids = []
        self._update_usage()

    def _count_refs(self, delta: int) -> None:
        self._refs_held += delta
        self.metrics.pool_refs_held = self._refs_held

    def _update_usage(self) -> None:
        """Blocks used, and those no indexed entry owns (0 between steps: an entry forgotten while
        in use holds its blocks until its last release)."""
        used = self.num_blocks - len(self._free)
        self.metrics.pool_blocks_used = used
        self.metrics.pool_blocks_leaked = used - self._indexed_blocks

    def check_invariants(self) -> None:
        """Raises AssertionError when the accounting is off, recounting it by walking every entry
        (tests; never on the hot path)."""
        assert all(epoch == e.epoch for epoch, e in self._live.items()), "a live entry under another epoch"
        assert self._refs_held == sum(e.ref_count for e in self._live.values()), "references miscounted"
        assert self._indexed_blocks == sum(len(e.block_ids) for e in self._index.values()), "indexed blocks miscounted"
        owned = [b for e in self._live.values() for b in e.block_ids]
        all_blocks = owned + self._free
        assert len(all_blocks) == len(set(all_blocks)) == self.num_blocks, "a block is lost or owned twice"
        assert set(all_blocks) == set(range(self.first_block_id, self.first_block_id + self.num_blocks))
        assert all(e.ref_count == 0 and e.ready for e in self._evictable.values()), "evictable entry in use"
        assert self._evictable_blocks == sum(len(e.block_ids) for e in self._evictable.values())
        assert all(self._live.get(e.epoch) is e for e in self._index.values()), "indexed entry without blocks"
        assert self.metrics.pool_blocks_used == len(owned)
        assert self.metrics.pool_refs_held == self._refs_held
        assert self.metrics.pool_blocks_leaked == len(owned) - self._indexed_blocks
