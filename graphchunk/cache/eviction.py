"""Eviction policies of the chunk pool: which unused entry goes when blocks run out.

Contract. A policy orders the pool's *evictable* entries (indexed, ready, ``ref_count == 0``) and
nothing else. The pool tells it every event that changes that set or an entry's standing —
``inserted`` (a new indexed entry, in use, with its recompute cost), ``hit`` (a lookup found it),
``evictable`` (its last reference was released), ``in_use`` (an evictable entry was acquired),
``dropped`` (it left the pool, evicted or replaced) — and asks ``victim()`` for the entry to evict
next, only while at least one entry is evictable. ``victim`` chooses; the pool evicts and then
reports ``dropped``. A policy never sees an entry in use as a candidate, so no policy can evict one.

Policies (``POLICIES``; measured on Zipf RAG traces by ``perf/micro/bench_eviction.py``, results in
``perf/results/eviction.json``):

* ``lru``  least recently released first (graphchunk's original order; SGLang's
  ``--radix-eviction-policy`` and LMCache's ``cache_policy`` both default to LRU).
* ``lfu``  LFU with dynamic aging (LFU-DA): priority = clock + hits. Plain LFU (SGLang's ``lfu``:
  hit count, ties by recency; LMCache's ``LFU``) never forgets: a document popular an hour ago
  outlives today's; the clock, raised to each victim's priority, lets newcomers catch up.
* ``gdsf`` Greedy-Dual-Size-Frequency (Cherkasova 1998): priority = clock + hits * cost / size,
  same clock. cost = tokens a miss recomputes (``insert(cost=...)``, default the entry's
  ``num_tokens``), size = blocks held. What a cached entry saves per block of pool it occupies is
  hits * cost / blocks: the density of the knapsack the pool solves when the goal is fewest
  recomputed tokens. With cost = tokens, cost / size is ~block_size for every entry (less for an
  entry whose last block is mostly empty), so gdsf ranks like lfu weighted by how well an entry
  fills its blocks; a caller whose miss cost is not linear in tokens (attention over a long sys
  prompt, a fixed per-miss overhead) passes that cost instead. ``cost=1`` turns it into classic
  GDSF, which favours small entries and maximizes the count of chunk hits, not the tokens saved.
* ``Belady(next_use)``  offline only (not in ``POLICIES``): evicts the entry whose next use is
  furthest, from an oracle over a known trace; the reference the bench compares against.

Priorities are computed when an entry becomes evictable (the end of its latest use) and kept in
a lazily invalidated min-heap: stale items are skipped on pop and the heap is rebuilt when
garbage outnumbers live items. Ties go to the entry evictable longest (LRU order).
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from graphchunk.cache.pool import PoolEntry

POLICIES = ("lru", "lfu", "gdsf")
DEFAULT_POLICY = "gdsf"
"""Fewest recomputed tokens of the three at 34 of the bench's 36 points: 0.88 of LRU's on average."""


class EvictionPolicy:
    """Base: the hooks the pool calls; a policy overrides those it needs."""

    name = "?"

    def inserted(self, entry: PoolEntry, cost: float) -> None:
        pass

    def hit(self, entry: PoolEntry) -> None:
        pass

    def evictable(self, entry: PoolEntry) -> None:
        raise NotImplementedError

    def in_use(self, entry: PoolEntry) -> None:
        raise NotImplementedError

    def dropped(self, entry: PoolEntry) -> None:
        raise NotImplementedError

    def victim(self) -> PoolEntry:
        raise NotImplementedError


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self):
        self._order: OrderedDict[PoolEntry, None] = OrderedDict()

    def evictable(self, entry):
        self._order[entry] = None

    def in_use(self, entry):
        self._order.pop(entry, None)

    def dropped(self, entry):
        self._order.pop(entry, None)

    def victim(self):
        return next(iter(self._order))


class _HeapPolicy(EvictionPolicy):
    """Evicts the evictable entry of least ``priority(entry)``, fixed when it became evictable."""

    def __init__(self):
        self._heap: list[tuple[float, int, PoolEntry]] = []
        self._live: dict[PoolEntry, int] = {}  # evictable entry -> sequence number of its heap item
        self._seq = itertools.count()

    def priority(self, entry: PoolEntry) -> float:
        raise NotImplementedError

    def evictable(self, entry):
        seq = next(self._seq)
        self._live[entry] = seq
        heapq.heappush(self._heap, (self.priority(entry), seq, entry))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [item for item in self._heap if self._live.get(item[2]) == item[1]]
            heapq.heapify(self._heap)

    def in_use(self, entry):
        self._live.pop(entry, None)

    def dropped(self, entry):
        self._live.pop(entry, None)

    def victim(self):
        while True:
            prio, seq, entry = self._heap[0]
            if self._live.get(entry) == seq:
                self.chosen(prio)
                return entry
            heapq.heappop(self._heap)

    def chosen(self, priority: float) -> None:
        """Called with the victim's priority."""


class GDSF(_HeapPolicy):
    """priority = clock + hits * cost / blocks; the clock rises to each victim's priority."""

    name = "gdsf"

    def __init__(self):
        super().__init__()
        self.clock = 0.0
        self._hits: dict[PoolEntry, int] = {}
        self._cost: dict[PoolEntry, float] = {}

    def inserted(self, entry, cost):
        self._hits[entry] = 1
        self._cost[entry] = cost

    def hit(self, entry):
        self._hits[entry] += 1

    def dropped(self, entry):
        super().dropped(entry)
        self._hits.pop(entry, None)
        self._cost.pop(entry, None)

    def priority(self, entry):
        return self.clock + self._hits[entry] * self.weight(entry)

    def weight(self, entry: PoolEntry) -> float:
        return self._cost[entry] / len(entry.block_ids)

    def chosen(self, priority):
        self.clock = priority


class LFU(GDSF):
    """LFU with dynamic aging: GDSF with cost / size = 1, i.e. priority = clock + hits."""

    name = "lfu"

    def weight(self, entry):
        return 1.0


class Belady(_HeapPolicy):
    """Evicts the entry used again furthest in the future (offline: needs the trace).

    ``next_use(entry)`` is called when the entry becomes evictable and returns the time of its
    next use after now (``math.inf`` if none); that time does not change until the entry is used."""

    name = "belady"

    def __init__(self, next_use: Callable[[PoolEntry], float]):
        super().__init__()
        self.next_use = next_use

    def priority(self, entry):
        return -self.next_use(entry)


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy of that name (one of ``POLICIES``), or the instance given."""
    if isinstance(policy, EvictionPolicy):
        return policy
    classes = {"lru": LRU, "lfu": LFU, "gdsf": GDSF}
    if policy not in classes:
        raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
    return classes[policy]()
