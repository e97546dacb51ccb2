"""Host-side plan of one step's chunk work, run over a device that computes and copies KV.

For every segmented request whose scheduled range ``[start, end)`` overlaps its context
``[0, C)`` (C = S + sum L_i):

1. acquire pool entries for its sys prompt and chunks; misses are computed as pseudo-sequences
   with ordinary causal attention: sys at positions [0, S), then each chunk as ``sys ‖ chunk``
   continuing the sys entry's KV (its partial last block copied first), positions [S, S+L_i);
2. copy the KV of the context tokens in ``[start, min(end, C))`` from pool slots into the
   request's own slots (the chunk tokens' keys divided by the request's key temperature, when
   it is not 1: the question's logits to them are then divided by it, ``config.key_temperature``);
3. tell the model runner where the request's own computation now starts: at C, or at ``end - 1``
   when the step holds no question token (that token is recomputed with its KV write skipped,
   because a scheduled request must keep at least one token).

Blend requests (``ScheduledPrompt.policy`` set, DESIGN.md §2) differ in step 1 and 2 only: a
chunk's entry is computed alone at positions [0, L), keyed without sys, and copied with its keys
rotated to the chunk's offset; afterwards ``recompute`` (``blend/recompute.py``) gives the tokens
the request's policy picks fresh KV over the request's own slots.

With a persistent tier (``store.py``), a pool miss is first looked up there: an entry the tier
holds is loaded into its pool blocks (before anything of the group is computed, so a loaded sys
entry serves the chunk misses after it) instead of computed; an entry computed is written
through to the tier before the step's copies.

Entries are held only within the step (released once copied), so preemption, aborts and chunked
prefill need no bookkeeping; identical chunks met in one step are computed once, and an entry is
ready for the very next request that looks it up (no asynchronous store).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from graphchunk.blend.recompute import RecomputePolicy, recompute
from graphchunk.cache.keys import KeySpace, chunk_key, sys_key
from graphchunk.cache.pool import ChunkPool, PoolEntry, PoolExhausted
from graphchunk.cache.store import ChunkStore
from graphchunk.device import KVDevice, PseudoSeq, slots_of, split_forward_batches  # noqa: F401 (re-exported)
from graphchunk.segments import SegmentedPrompt


@dataclass
class ScheduledPrompt:
    """A segmented request's share of one step."""

    seg: SegmentedPrompt
    salt: str | None
    start: int
    end: int
    block_ids: Sequence[int]
    policy: RecomputePolicy | None = None
    """Blend mode's recompute policy; None for isolated mode."""
    key_temperature: float = 1.0
    """Isolated mode: chunk keys are divided by it as they are copied into the request."""

    @property
    def mode(self) -> str:
        return "isolated" if self.policy is None else "blend"

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
    chunk_misses: list[tuple[PoolEntry, PseudoSeq]] = field(default_factory=list)
    partial_copies: list[tuple[int, int]] = field(default_factory=list)
    """(sys entry's partial last block, isolated chunk miss's first block)."""
    loads: list[tuple[PoolEntry, torch.Tensor]] = field(default_factory=list)
    """Misses the tier held: (entry, its blocks' KV) to write into the pool."""
    stores: list[tuple[PoolEntry, str]] = field(default_factory=list)
    """Computed misses to write through to the tier: (entry, mode)."""
    copies: list[tuple[np.ndarray, np.ndarray, float]] = field(default_factory=list)
    """Plain copies: (pool slots, request slots, key temperature: 1 but for isolated chunks)."""
    rotated: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    """Blend copies: (pool slots, request slots, positions each key moves)."""

    def undo_to(self, marks: tuple[int, ...]) -> None:
        for part, mark in zip(self._undoable(), marks):
            del part[mark:]

    @property
    def marks(self) -> tuple[int, ...]:
        return tuple(map(len, self._undoable()))

    def _undoable(self) -> tuple[list, ...]:
        return self.sys_misses, self.chunk_misses, self.partial_copies, self.loads, self.stores

    def loaded(self, entry: PoolEntry) -> bool:
        return any(e is entry for e, _ in self.loads)


class ChunkCache:
    def __init__(self, pool: ChunkPool, space: KeySpace, max_forward_tokens: int, check_layer: int = 1,
                 tier: ChunkStore | None = None):
        self.pool = pool
        self.tier = tier
        self.space = space
        self.block_size = pool.block_size
        self.max_forward_tokens = max_forward_tokens
        self.check_layer = check_layer
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
        blended = [p for p in prompts if p.policy is not None]
        if blended:
            recompute(blended, device, check_layer=self.check_layer, budget=self.max_forward_tokens,
                      block_size=self.block_size, metrics=self.metrics)

    # --- plan ---------------------------------------------------------------------------------

    def _plan_unit(self, prompt: ScheduledPrompt, chunk: int | None, lo: int, hi: int, group: _Group) -> None:
        """Acquires what logical tokens [lo, hi) of segment ``chunk`` (None: sys) need."""
        seg, sys_len, mode = prompt.seg, prompt.seg.layout.sys_len, prompt.mode
        acquired: list[PoolEntry] = []
        marks = group.marks
        try:
            sys_entry = None
            if sys_len and (chunk is None or mode == "isolated"):
                sys_entry = self._acquire_sys(seg, prompt.salt, mode, group, acquired)
            if chunk is None:
                entry, offset = sys_entry, 0
            else:
                entry, offset = self._acquire_chunk(seg, chunk, sys_entry, prompt.salt, mode, group, acquired)
        except PoolExhausted:  # undo this unit; its own misses are dropped by their last release
            group.undo_to(marks)
            for held in acquired:
                self.pool.release(held)
            raise
        if entry.ready or group.loaded(entry):
            self.metrics.count("tokens_reused", hi - lo, mode)
        group.held.extend(acquired)
        begin = seg.bounds[0 if chunk is None else 1 + chunk][0]
        src = slots_of(entry.block_ids, offset + np.arange(lo - begin, hi - begin), self.block_size)
        dst = slots_of(prompt.block_ids, np.arange(lo, hi), self.block_size)
        if mode == "blend" and chunk is not None:  # computed at [0, L), lands at [begin, begin + L)
            group.rotated.append((src, dst, np.full(hi - lo, begin, np.int64)))
        else:
            group.copies.append((src, dst, 1.0 if chunk is None else prompt.key_temperature))

    def _acquire_sys(self, seg, salt, mode, group, acquired) -> PoolEntry:
        key = sys_key(self.space, seg.sys_tokens, salt, mode)
        entry = self.pool.lookup(key, seg.sys_tokens)
        if entry is None:
            entry = self.pool.insert(key, seg.sys_tokens, seg.layout.sys_len)
            if not self._load(entry, mode, group):
                group.sys_misses.append(entry)
        acquired.append(entry)
        return entry

    def _acquire_chunk(self, seg, i, sys_entry, salt, mode, group, acquired) -> tuple[PoolEntry, int]:
        """The chunk's entry and the slot offset of its first token in the entry's blocks. The
        metrics count chunk lookups only (a sys prompt is looked up once per chunk it precedes,
        which would inflate them).

        Isolated: the entry holds ``sys ‖ chunk``'s KV from the sys prompt's partial last block on.
        Blend: the chunk alone, at positions [0, L), from the first slot."""
        chunk = seg.chunk_tokens(i)
        sys_tokens = seg.sys_tokens if mode == "isolated" else ()
        offset = len(sys_tokens) % self.block_size
        tokens = sys_tokens + chunk
        with self.metrics.timed_lookup():
            key = chunk_key(self.space, sys_tokens, chunk, salt, mode)
            entry = self.pool.lookup(key, tokens)
        outcome = "hits" if entry is not None else "misses"
        if entry is None:  # insert may raise PoolExhausted: nothing is counted or recorded before it
            entry = self.pool.insert(key, tokens, offset + len(chunk))
            if self._load(entry, mode, group):
                outcome = "tier_hits"
            elif mode == "blend":
                seq = PseudoSeq(chunk, np.arange(len(chunk)), entry.block_ids)
            else:
                sys_blocks = sys_entry.block_ids[: len(sys_tokens) // self.block_size] if sys_entry else []
                seq = PseudoSeq(tokens, np.arange(len(tokens)), [*sys_blocks, *entry.block_ids], len(sys_tokens))
                if offset:
                    group.partial_copies.append((sys_entry.block_ids[-1], entry.block_ids[0]))
            if outcome == "misses":
                group.chunk_misses.append((entry, seq))
        acquired.append(entry)
        self.metrics.count("lookups", 1, mode)
        self.metrics.count(outcome, 1, mode)
        return entry, offset

    def _load(self, entry: PoolEntry, mode: str, group: _Group) -> bool:
        """Finds a new entry's KV in the tier (to be written into its blocks when the group
        runs), or records it to be written through to the tier once computed."""
        if self.tier is None:
            return False
        data = self.tier.load(entry.key, entry.tokens, mode, len(entry.block_ids))
        if data is None:
            group.stores.append((entry, mode))
            return False
        group.loads.append((entry, data))
        return True

    # --- run ----------------------------------------------------------------------------------

    def _run(self, group: _Group, device: KVDevice) -> None:
        try:
            for entry, data in group.loads:
                device.write_blocks(entry.block_ids, data)
                self.pool.mark_ready(entry)
            self._prefill(device, [self._sys_seq(e) for e in group.sys_misses])
            for entry in group.sys_misses:
                self.pool.mark_ready(entry)
            if group.partial_copies:
                device.copy_blocks([s for s, _ in group.partial_copies], [d for _, d in group.partial_copies])
            self._prefill(device, [seq for _, seq in group.chunk_misses])
            for entry, _ in group.chunk_misses:
                self.pool.mark_ready(entry)
            for entry, mode in group.stores:
                self.tier.save(entry.key, entry.tokens, entry.num_tokens, mode, device.read_blocks(entry.block_ids))
            for temperature in sorted({t for _, _, t in group.copies}):
                parts = [(s, d) for s, d, t in group.copies if t == temperature]
                device.copy_slots(*(np.concatenate(part) for part in zip(*parts)), key_temperature=temperature)
            if group.rotated:
                device.copy_slots_rotated(*(np.concatenate(part) for part in zip(*group.rotated)))
        finally:
            for entry in group.held:
                self.pool.release(entry)

    def _sys_seq(self, entry: PoolEntry) -> PseudoSeq:
        return PseudoSeq(entry.tokens, np.arange(len(entry.tokens)), entry.block_ids)

    def _prefill(self, device: KVDevice, seqs: list[PseudoSeq]) -> None:
        for batch in split_forward_batches(seqs, self.max_forward_tokens):
            device.prefill(batch)
            self.metrics.tokens_computed += sum(s.num_new for s in batch)


def _units(prompt: ScheduledPrompt):
    """(segment, lo, hi) for each segment overlapping the prompt's context range: None is sys."""
    for i, (begin, end) in enumerate(prompt.seg.bounds[:-1]):
        lo, hi = max(begin, prompt.start), min(end, prompt.context_end)
        if lo < hi:
            yield (None if i == 0 else i - 1), lo, hi
