"""The host-memory level's index, kept where vLLM schedules, beside the pool's: which entries the
workers hold in host memory (``host_tier.HostTier``), and what they drop.

The workers hold the payloads; this index decides what they keep, as vLLM's offloading connector's
scheduler-side manager does for its CPU blocks. A job (or capture) filling a pool entry reserves
room for the entry's payload (``reserve``: the tokens its copies read), taking it from the least
recently used entries nothing holds; the workers save the payload once the job has run, under the
pool entry's epoch, and the entry here becomes ready when the workers report the job run. What a
reservation dropped goes to the workers with the step's metadata (``take_drops``), which they
apply before anything of that step runs.

A lookup that misses the pool and finds a ready entry here (``lookup``) is served from host memory
in one copy into the request's own slots (no pool block taken: ``context_plan.py``), or, for a sys
prompt (whose KV chunk jobs read from the pool), loaded into its pool entry.

References, as the pool's: a plan holds each entry it copies from until its copies have been sent,
a job the entry it saves or loads until it has run; a referenced entry is never dropped, so no
payload is dropped while anything will still read or write it. An entry the workers found missing
(``forget``) leaves the index and is dropped with its last reference. Every operation costs what it
touches, never the level's size.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class HostEntry:
    key: bytes
    tokens: tuple[int, ...]
    """What the KV was computed from; a hash hit is verified against it."""
    num_tokens: int
    """Tokens of KV in the payload (what the budget counts)."""
    epoch: int
    """The pool entry's epoch it was saved from: the workers hold its payload under it."""
    ref_count: int = 0
    ready: bool = False
    """The workers have saved the payload (its job was reported run)."""
    indexed: bool = True


class HostIndex:
    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self._index: dict[bytes, HostEntry] = {}
        self._live: dict[int, HostEntry] = {}
        """Entries whose payload the workers hold or will hold, by epoch (indexed or forgotten in use)."""
        self._unused: OrderedDict[int, HostEntry] = OrderedDict()
        """Ready indexed entries nothing holds, least recently used first: what room is taken from."""
        self._unused_tokens = 0
        self.used = 0
        """Tokens of every live entry's payload."""
        self._drops: list[int] = []

    def lookup(self, key: bytes, tokens: tuple[int, ...]) -> HostEntry | None:
        """The ready entry for ``key`` whose tokens match, acquired; else None."""
        entry = self._index.get(key)
        if entry is None or not entry.ready or entry.tokens != tokens:
            return None
        self.acquire(entry)
        return entry

    def contains(self, key: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether a ready entry for ``key`` with these tokens exists (nothing acquired)."""
        entry = self._index.get(key)
        return entry is not None and entry.ready and entry.tokens == tokens

    def reserve(self, key: bytes, tokens: tuple[int, ...], num_tokens: int, epoch: int) -> HostEntry | None:
        """Room for a payload of ``num_tokens`` that the job of pool entry ``epoch`` saves: a new
        entry, acquired once (the job's), not ready; None when the entries in use leave no room, or
        an entry of the same key is in use (its payload stays)."""
        old = self._index.get(key)
        if old is not None:
            if old.ref_count:
                return None
            self._drop(old)
        if self.used - self._unused_tokens + num_tokens > self.budget:
            return None
        while self.used + num_tokens > self.budget:
            self._drop(next(iter(self._unused.values())))
        entry = self._index[key] = self._live[epoch] = HostEntry(key, tokens, num_tokens, epoch, ref_count=1)
        self.used += num_tokens
        return entry

    def acquire(self, entry: HostEntry) -> None:
        entry.ref_count += 1
        if self._unused.pop(entry.epoch, None) is not None:
            self._unused_tokens -= entry.num_tokens

    def release(self, entry: HostEntry) -> None:
        if entry.ref_count < 1:
            raise RuntimeError(f"release of a host entry not in use: {entry.key.hex()}")
        entry.ref_count -= 1
        if entry.ref_count:
            return
        if entry.indexed and entry.ready:
            self._unused[entry.epoch] = entry
            self._unused_tokens += entry.num_tokens
        else:
            self._drop(entry)

    def mark_ready(self, entry: HostEntry) -> None:
        entry.ready = True

    def forget(self, epochs) -> None:
        """The workers found these entries' payloads missing: no lookup finds them again; each is
        dropped with its last reference."""
        for epoch in epochs:
            entry = self._live.get(epoch)
            if entry is None or not entry.indexed:
                continue
            if entry.ref_count:
                self._unindex(entry)
            else:
                self._drop(entry)

    def take_drops(self) -> tuple[int, ...]:
        """Epochs of the payloads dropped since the last call: the workers free them (the step's metadata)."""
        drops, self._drops = tuple(self._drops), []
        return drops

    def _unindex(self, entry: HostEntry) -> None:
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
        if self._unused.pop(entry.epoch, None) is not None:
            self._unused_tokens -= entry.num_tokens
        entry.indexed = False

    def _drop(self, entry: HostEntry) -> None:
        if entry.indexed:
            self._unindex(entry)
        del self._live[entry.epoch]
        self.used -= entry.num_tokens
        self._drops.append(entry.epoch)

    def check_invariants(self) -> None:
        """Raises AssertionError when the accounting is off (tests; walks every entry)."""
        assert self.used == sum(e.num_tokens for e in self._live.values()) <= self.budget, "tokens miscounted"
        assert all(self._live.get(e.epoch) is e for e in self._index.values()), "indexed entry not live"
        assert all(e.ref_count == 0 and e.ready and e.indexed for e in self._unused.values()), "unused entry in use"
        assert self._unused_tokens == sum(e.num_tokens for e in self._unused.values())
        assert all(e.ref_count or (e.ready and e.epoch in self._unused) for e in self._index.values()), \
            "an entry neither held nor droppable"
