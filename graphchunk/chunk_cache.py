"""Host-side plan of one step's chunk work, run over a device that computes and copies KV.

For every segmented request whose scheduled range ``[start, end)`` overlaps its context
``[0, C)`` (C = S + sum L_i):

1. acquire pool entries for its sys prompt and chunks; misses are computed as pseudo-sequences
   with ordinary causal attention: sys at positions [0, S), then each chunk as ``sys ‖ chunk``
   continuing the sys entry's KV (its partial last block copied first), positions [S, S+L_i);
2. copy the KV of the context tokens in ``[start, min(end, C))`` from pool slots into the
   request's own slots;
3. tell the model runner where the request's own computation now starts: at C, or at ``end - 1``
   when the step holds no question token (that token is recomputed with its KV write skipped,
   because a scheduled request must keep at least one token).

Entries are held only within the step (released once copied), so preemption, aborts and chunked
prefill need no bookkeeping; identical chunks met in one step are computed once, and an entry is
ready for the very next request that looks it up (no asynchronous store).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from graphchunk.keys import KeySpace, chunk_key, sys_key
from graphchunk.pool import ChunkPool, PoolEntry, PoolExhausted
from graphchunk.segments import SegmentedPrompt


@dataclass(frozen=True)
class PseudoSeq:
    """An extra forward: computes ``token_ids[num_cached:]`` at ``positions[num_cached:]``,
    attending causally to everything before, KV at logical index i in ``block_ids``' slot i."""

    token_ids: Sequence[int]
    positions: np.ndarray
    block_ids: Sequence[int]
    num_cached: int = 0

    @property
    def num_new(self) -> int:
        return len(self.token_ids) - self.num_cached


class KVDevice(Protocol):
    """What the plan needs from the device (implemented by the model runner)."""

    def forward(self, seqs: list[PseudoSeq]) -> None: ...

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None: ...

    def copy_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None: ...


@dataclass
class ScheduledPrompt:
    """A segmented request's share of one step."""

    seg: SegmentedPrompt
    salt: str | None
    start: int
    end: int
    block_ids: Sequence[int]

    @property
    def context_end(self) -> int:
        return min(self.end, self.seg.layout.context_len)

    def compute_start(self) -> int:
        """First logical token the model runner computes itself this step."""
        context_len = self.seg.layout.context_len
        if self.start >= context_len:
            return self.start
        return context_len if self.end > context_len else self.end - 1


@dataclass
class _Group:
    """Entries acquired for a batch of requests, computed and copied together."""

    held: list[PoolEntry] = field(default_factory=list)
    sys_misses: list[PoolEntry] = field(default_factory=list)
    chunk_misses: list[tuple[PoolEntry, PoolEntry | None, SegmentedPrompt, int]] = field(default_factory=list)
    copies: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


class ChunkCache:
    def __init__(self, pool: ChunkPool, space: KeySpace, max_forward_tokens: int):
        self.pool = pool
        self.space = space
        self.block_size = pool.block_size
        self.max_forward_tokens = max_forward_tokens
        self.metrics = pool.metrics

    def materialize(self, prompts: list[ScheduledPrompt], device: KVDevice) -> None:
        """Fills every prompt's context slots in its scheduled range (steps 1 and 2 above).

        Work goes in units of one segment (sys, or one chunk with its sys prompt), so a step
        whose entries outgrow the pool runs in several groups, each released once copied."""
        group = _Group()
        for prompt in prompts:
            for unit in _units(prompt):
                try:
                    self._plan_unit(prompt, *unit, group)
                except PoolExhausted:
                    if not group.held:
                        raise
                    self._run(group, device)
                    group = _Group()
                    self._plan_unit(prompt, *unit, group)
        self._run(group, device)

    # --- plan ---------------------------------------------------------------------------------

    def _plan_unit(self, prompt: ScheduledPrompt, chunk: int | None, lo: int, hi: int, group: _Group) -> None:
        """Acquires what logical tokens [lo, hi) of segment ``chunk`` (None: sys) need."""
        seg, sys_len = prompt.seg, prompt.seg.layout.sys_len
        acquired: list[PoolEntry] = []
        num_misses = len(group.sys_misses), len(group.chunk_misses)
        try:
            sys_entry = self._acquire_sys(seg, prompt.salt, group, acquired) if sys_len else None
            if chunk is None:
                entry, src = sys_entry, _slots(sys_entry.block_ids, np.arange(lo, hi), self.block_size)
            else:
                entry = self._acquire_chunk(seg, chunk, sys_entry, prompt.salt, group, acquired)
                begin = seg.bounds[1 + chunk][0]
                src = _slots(entry.block_ids, sys_len % self.block_size + np.arange(lo - begin, hi - begin),
                             self.block_size)
        except PoolExhausted:  # undo this unit; its own misses are dropped by their last release
            del group.sys_misses[num_misses[0]:], group.chunk_misses[num_misses[1]:]
            for entry in acquired:
                self.pool.release(entry)
            raise
        if entry.ready:
            self.metrics.tokens_reused += hi - lo
        group.held.extend(acquired)
        group.copies.append((src, _slots(prompt.block_ids, np.arange(lo, hi), self.block_size)))

    def _acquire_sys(self, seg, salt, group, acquired) -> PoolEntry:
        key = sys_key(self.space, seg.sys_tokens, salt)
        entry = self.pool.lookup(key, seg.sys_tokens)
        if entry is None:
            entry = self.pool.insert(key, seg.sys_tokens, seg.layout.sys_len)
            group.sys_misses.append(entry)
        acquired.append(entry)
        return entry

    def _acquire_chunk(self, seg, i, sys_entry, salt, group, acquired) -> PoolEntry:
        """The chunk's entry; the metrics count chunk lookups only (a sys prompt is looked up
        once per chunk it precedes, which would inflate them)."""
        chunk = seg.chunk_tokens(i)
        tokens = seg.sys_tokens + chunk
        with self.metrics.timed_lookup():
            key = chunk_key(self.space, seg.sys_tokens, chunk, salt)
            entry = self.pool.lookup(key, tokens)
        if entry is None:
            entry = self.pool.insert(key, tokens, seg.layout.sys_len % self.block_size + len(chunk))
            group.chunk_misses.append((entry, sys_entry, seg, i))
            self.metrics.misses += 1
        else:
            self.metrics.hits += 1
        self.metrics.lookups += 1
        acquired.append(entry)
        return entry

    # --- run ----------------------------------------------------------------------------------

    def _run(self, group: _Group, device: KVDevice) -> None:
        try:
            self._forward(device, [self._sys_seq(e) for e in group.sys_misses])
            for entry in group.sys_misses:
                self.pool.mark_ready(entry)
            partial = [(sys_e.block_ids[-1], e.block_ids[0]) for e, sys_e, seg, _ in group.chunk_misses
                       if seg.layout.sys_len % self.block_size]
            if partial:
                device.copy_blocks([s for s, _ in partial], [d for _, d in partial])
            self._forward(device, [self._chunk_seq(*miss) for miss in group.chunk_misses])
            for entry, *_ in group.chunk_misses:
                self.pool.mark_ready(entry)
            if group.copies:
                device.copy_slots(np.concatenate([s for s, _ in group.copies]),
                                  np.concatenate([d for _, d in group.copies]))
        finally:
            for entry in group.held:
                self.pool.release(entry)

    def _sys_seq(self, entry: PoolEntry) -> PseudoSeq:
        return PseudoSeq(entry.tokens, np.arange(len(entry.tokens)), entry.block_ids)

    def _chunk_seq(self, entry: PoolEntry, sys_entry: PoolEntry | None, seg: SegmentedPrompt, i: int) -> PseudoSeq:
        sys_len = seg.layout.sys_len
        sys_blocks = sys_entry.block_ids[: sys_len // self.block_size] if sys_entry else []
        return PseudoSeq(entry.tokens, np.arange(len(entry.tokens)), [*sys_blocks, *entry.block_ids], sys_len)

    def _forward(self, device: KVDevice, seqs: list[PseudoSeq]) -> None:
        for batch in split_forward_batches(seqs, self.max_forward_tokens):
            device.forward(batch)
            self.metrics.tokens_computed += sum(s.num_new for s in batch)


def split_forward_batches(seqs: list[PseudoSeq], budget: int) -> list[list[PseudoSeq]]:
    """Batches of at most ``budget`` new tokens; a longer sequence is cut into consecutive
    pieces, each a batch's last member so the next piece sees its KV."""
    batches, batch, used = [], [], 0
    for seq in seqs:
        cached = seq.num_cached
        while cached < len(seq.token_ids):
            take = min(len(seq.token_ids) - cached, budget - used)
            end = cached + take
            batch.append(PseudoSeq(seq.token_ids[:end], seq.positions[:end], seq.block_ids, cached))
            used += take
            cached = end
            if used == budget:
                batches.append(batch)
                batch, used = [], 0
    if batch:
        batches.append(batch)
    return batches


def _units(prompt: ScheduledPrompt):
    """(segment, lo, hi) for each segment overlapping the prompt's context range: None is sys."""
    for i, (begin, end) in enumerate(prompt.seg.bounds[:-1]):
        lo, hi = max(begin, prompt.start), min(end, prompt.context_end)
        if lo < hi:
            yield (None if i == 0 else i - 1), lo, hi


def _slots(block_ids: Sequence[int], logical: np.ndarray, block_size: int) -> np.ndarray:
    blocks = np.asarray(block_ids, np.int64)
    return blocks[logical // block_size] * block_size + logical % block_size
