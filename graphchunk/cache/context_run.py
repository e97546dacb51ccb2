"""Device-side run of the context plans (``context_plan.py``), in every worker, over a ``KVDevice``.

``add_jobs`` queues the ``MissJob``s a step's plans created; ``run_jobs`` runs them in id order,
at most ``budget`` new tokens per call (None: all), in forwards of at most ``max_forward_tokens``
tokens, cutting a long job across forwards and steps (each piece continues the KV of the one
before); a job never shares a forward with the sys job whose KV it reads. A job's entry is first
looked up in the directory (``tier.py``): a payload there is loaded into the entry's blocks instead
of computed, and a computed entry is written through. With host memory (``host_tier.HostTier``) a
job the scheduler reserved room for saves its entry there once run (``MissJob.save_host``), and a
sys prompt's job may load its entry from there (``host_source``); what the scheduler drops is
freed as the step's work arrives (``drop_host``), before anything of it runs.
``done_before`` is the first job id not yet finished: the plans' scheduler learns it after each step.

``capture`` fills new blend entries from a request vLLM computed as a full prefill, after the
forward of the step that computed it (``EntryCapture``: each chunk's KV as that prefill computed
it, in the context before it there, keys rotated back to where a chunk sits in an entry, after the
blend prefix if any); it runs whole in its step, out of the jobs' order, so ``done_before`` is
the first queued job's id, or past every id seen. A capture that names its context
(``graphchunk-precompute``'s) is written to the tier too, the context's identity in the header.

``fill`` copies the context of requests whose jobs have all run from the pool into their own
slots (chunk keys divided by the request's key temperature when it is not 1; blend chunks'
keys rotated to where they land: one copy per key temperature and one rotated copy for all of the
step's requests, their slot lists built by array operations over all its units, ``unit_slots``),
and the units host memory serves from their payloads (``UnitCopy.host``: the rows gathered on the
host, one transfer and write per key temperature and one rotated), then gives the tokens each
blend request's recompute policy picks fresh KV (``blend/recompute.py``).

Every read is checked against what was planned, at no cost worth measuring (a comparison per
block): a job stamps its entry's blocks with the entry's epoch (``PoolEntry.epoch``) as it starts
writing them, and a copy (``UnitCopy.epoch``) or a job reading another entry (``MissJob.reads``)
runs only where the blocks still carry the planned epoch (a host unit, where host memory holds
its payload). A request whose copy would read anything else is not filled: its own blocks from the
first affected one on are reported invalid (``take_invalid``: the scheduler's connector evicts them
from vLLM's prefix cache whatever state their request is in) and the request is reported for a new
plan (``take_refill``: the scheduler's connector puts it back in vLLM's queue,
``engine/fill_retry.py``), and a job whose input is wrong stamps its entry ``POISONED``, so that
every copy from it fails the same way. Either way the
entry is reported (``take_failed``; a poisoned job's input entry too) and leaves the pool's index
at once: the request's next plan computes it again. With the scheduler's lifetimes right
(``engine/context_scheduler.py``) this never fires; it makes a lifetime bug a slower answer
instead of a wrong one that vLLM's prefix cache would keep serving.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from graphchunk.blend.recompute import recompute
from graphchunk.cache.context_plan import EntryCapture, MissJob, UnitCopy
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.tier import Tier
from graphchunk.device import KVDevice, PseudoSeq, slots_of
from graphchunk.log import logger
from graphchunk.metrics import CacheMetrics

POISONED = -1
"""The epoch of an entry whose job read blocks that did not hold what it planned to read."""


@dataclass
class _Progress:
    job: MissJob
    computed: int
    """Tokens of the job's pseudo-sequence whose KV is in place."""
    started: bool = False
    loaded: bool = False
    """Served by the directory or host memory (not written back to the directory)."""


class ContextRunner:
    def __init__(self, block_size: int, max_forward_tokens: int, metrics: CacheMetrics, *, check_layer: int = 1,
                 tier: Tier | None = None, host: HostTier | None = None):
        self.block_size, self.max_forward_tokens = block_size, max_forward_tokens
        self.metrics, self.check_layer, self.tier, self.host = metrics, check_layer, tier, host
        self._queue: deque[_Progress] = deque()
        self.done_before = 0
        """Every job (and capture) with a smaller id has run."""
        self._next_id = 0
        """Past every job and capture id received."""
        self._reused: dict[int, int] = {}
        """Per queued job: context tokens plans will copy from its entry."""
        self.epochs: dict[int, int] = {}
        """Per pool block: the epoch of the entry whose KV it holds (or is being written)."""
        self.invalid: set[int] = set()
        """Request blocks a failed copy left invalid, not yet reported (``take_invalid``)."""
        self.failed: set[int] = set()
        """Epochs of entries found not to hold what was planned, not yet reported (``take_failed``)."""
        self.refill: set[str] = set()
        """Requests a copy failed its check for, not yet reported (``take_refill``)."""

    @property
    def pending_tokens(self) -> int:
        return sum(len(p.job.token_ids) - p.computed for p in self._queue)

    def add_jobs(self, jobs: Sequence[MissJob]) -> None:
        for job in jobs:
            self._queue.append(_Progress(job, job.num_cached))
            self._reused[job.job_id] = 0
            self._next_id = max(self._next_id, job.job_id + 1)

    def drop_host(self, epochs) -> None:
        """Frees the host payloads the scheduler dropped (``HostIndex.take_drops``)."""
        if epochs and self.host is not None:
            self.host.drop(epochs)

    def count(self, counts) -> None:
        """Adds a plan's counts (``RequestPlan.counts``, its jobs added first) to the metrics."""
        for name, n, what in counts:
            if name == "reused":
                if what in self._reused:  # else its job has run already: computed, not reused
                    self._reused[what] += n
            elif name == "lookup_seconds":
                self.metrics.lookup_seconds += n
            else:
                self.metrics.count(name, n, what)

    def run_jobs(self, device: KVDevice, budget: int | None = None) -> None:
        left = budget if budget is not None else self.pending_tokens
        while self._queue and left > 0:
            batch, finishing = self._next_forward(device, min(left, self.max_forward_tokens))
            if batch:
                device.prefill(batch)
                computed = sum(s.num_new for s in batch)
                self.metrics.tokens_computed += computed
                left -= computed
            for progress in finishing:
                self._finish(progress, device)
            if not batch and not finishing:
                break

    def _next_forward(self, device: KVDevice, cap: int) -> tuple[list[PseudoSeq], list[_Progress]]:
        """One forward's pieces, from the head of the queue, and the jobs it completes (tier
        loads complete without one). Stops before a job whose sys job is still running."""
        batch, finishing, used = [], [], 0
        running: set[int] = set()
        """Jobs written by this forward: a job reading one of them (its sys job) waits for the next."""
        for progress in self._queue:
            job = progress.job
            if used >= cap or job.after in running:
                break
            if not progress.started:
                progress.started = True
                self._stamp(job)
                if self._load(job, device):
                    progress.computed, progress.loaded = len(job.token_ids), True
                    finishing.append(progress)
                    continue
                if job.partial_copy is not None:
                    device.copy_blocks([job.partial_copy[0]], [job.partial_copy[1]])
            take = min(len(job.token_ids) - progress.computed, cap - used)
            end = progress.computed + take
            batch.append(PseudoSeq(job.token_ids[:end], np.arange(end), job.block_ids, progress.computed))
            progress.computed, used = end, used + take
            running.add(job.job_id)
            if end == len(job.token_ids):
                finishing.append(progress)
            else:
                break  # the rest of this job comes next forward, before anything after it
        return batch, finishing

    def _finish(self, progress: _Progress, device: KVDevice) -> None:
        head = self._queue.popleft()
        assert head is progress, "jobs finish in id order"
        job = progress.job
        reused = self._reused.pop(job.job_id)
        if job.counted:  # counted now, not at plan time: a counter never goes down
            self.metrics.count("tier_hits" if progress.loaded else "misses", 1, job.mode)
        if progress.loaded:  # the tokens copied from a tier hit are reused
            self.metrics.count("tokens_reused", reused, job.mode)
        holds = self._holds(job.entry_blocks, job.epoch)
        if self.tier is not None and not progress.loaded and holds:
            self.tier.save(job.key, job.entry_tokens, job.num_tokens, job.mode, device.read_blocks(job.entry_blocks))
        if job.save_host:
            self._save_host(job.epoch, job.entry_blocks, job.offset, job.num_tokens, device, holds)
        self._advance()

    def _save_host(self, epoch: int, blocks, offset: int, end: int, device: KVDevice, holds: bool = True) -> None:
        """Keeps the entry's slots ``[offset, end)`` in host memory under its epoch, as the
        scheduler reserved; one that cannot be kept is reported (``take_failed``: the scheduler's
        index forgets it)."""
        if not (holds and self.host.put(epoch, device.read_slots(slots_of(blocks, np.arange(offset, end),
                                                                            self.block_size)))):
            self.failed.add(epoch)

    def _advance(self) -> None:
        self.done_before = self._queue[0].job.job_id if self._queue else self._next_id

    def capture(self, captures: Sequence[EntryCapture], device: KVDevice, blocks_of) -> None:
        """Runs the step's captures, after its forward: ``blocks_of(req_id)``, the request's block ids."""
        if not captures:
            return
        parts = []
        for capture in captures:
            for block in capture.entry_blocks:
                self.epochs[block] = capture.epoch
            n = capture.hi - capture.lo
            parts.append((slots_of(blocks_of(capture.req_id), np.arange(capture.lo, capture.hi), self.block_size),
                          slots_of(capture.entry_blocks, capture.offset + np.arange(n), self.block_size),
                          np.full(n, capture.offset - capture.lo, np.int64)))
            self._next_id = max(self._next_id, capture.job_id + 1)
        device.copy_slots_rotated(*(np.concatenate(part) for part in zip(*parts)))
        self.metrics.blend_entries_captured += len(captures)
        for capture in captures:
            if self.tier is not None and capture.context is not None:
                self.tier.save(capture.key, capture.entry_tokens, len(capture.entry_tokens), "blend",
                               device.read_blocks(capture.entry_blocks), context=capture.context)
            if capture.save_host:
                self._save_host(capture.epoch, capture.entry_blocks, capture.offset,
                                capture.offset + capture.hi - capture.lo, device)
        self._advance()

    def _stamp(self, job: MissJob) -> None:
        """Marks the job's entry blocks as its entry's, before anything writes them; poisoned when
        what it reads is not what its plan read. Both are reported: the job's entry and the entry it
        read (a system prompt's that vLLM's prefix cache serves is checked by no copy, only here)."""
        bad = [(blocks, epoch) for blocks, epoch in job.reads if not self._holds(blocks, epoch)]
        if bad:
            logger.error("graphchunk: job %d reads pool blocks %s that no longer hold the entry it was planned "
                         "over; its entry is poisoned and every request copying it fails", job.job_id,
                         [blocks for blocks, _ in bad])
        for block in job.entry_blocks:
            self.epochs[block] = POISONED if bad else job.epoch
        if bad:
            self.failed.update([job.epoch, *(epoch for _, epoch in bad)])

    def _unit_holds(self, unit: UnitCopy) -> bool:
        """Whether what the unit copies from holds what was planned: its entry's blocks the epoch, or
        host memory its payload."""
        if unit.host:
            return self.host is not None and self.host.get(unit.epoch) is not None
        return self._holds(unit.entry_blocks, unit.epoch)

    def _holds(self, blocks, epoch: int) -> bool:
        return epoch != POISONED and all(self.epochs.get(block) == epoch for block in blocks)

    def take_invalid(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def take_refill(self) -> set[str]:
        """Requests whose context a copy could not fill as planned since the last call: the
        scheduler's connector plans them again (``engine/fill_retry.py``)."""
        refill, self.refill = self.refill, set()
        return refill

    def take_failed(self) -> set[int]:
        """Epochs of the entries found bad since the last call: the scheduler drops them from the
        pool's index (``ContextPlanner.fail_entries``), so that the next request computes them again."""
        failed, self.failed = self.failed, set()
        return failed

    def _load(self, job: MissJob, device: KVDevice) -> bool:
        """Whether the job's entry was loaded (from host memory, or the directory) instead of computed."""
        if job.host_source >= 0 and self.host is not None:
            data = self.host.get_on_all_ranks(job.host_source)
            if data is not None:
                device.write_slots(data, slots_of(job.entry_blocks, np.arange(job.offset, job.num_tokens),
                                                  self.block_size))
                self.metrics.tier_loads += 1
                self.metrics.tier_host_hits += 1
                return True
            self.failed.add(job.host_source)  # computed instead; the scheduler's index forgets it
        if self.tier is None:
            return False
        data = self.tier.load(job.key, job.entry_tokens, job.mode, len(job.entry_blocks))
        if data is None:
            return False
        device.write_blocks(list(job.entry_blocks), data)
        return True

    # --- fills ---------------------------------------------------------------------------------

    def fill(self, requests: Sequence[tuple[object, Sequence[UnitCopy]]], device: KVDevice) -> list:
        """``requests``: (``chunk_cache.ScheduledPrompt`` with the request's block ids, its units).
        Returns the prompts filled (the others' blocks are in ``invalid``)."""
        filled = self.copy(requests, device)
        self.recompute(filled, device)
        return filled

    def copy(self, requests: Sequence[tuple[object, Sequence[UnitCopy]]], device: KVDevice) -> list:
        """Copies each request's units whose entries hold what was planned; returns those prompts.
        One copy per key temperature and one rotated copy for the whole step, their slot lists
        built by a fixed number of array operations (``unit_slots``), however many requests and
        units."""
        requests = [(prompt, units) for prompt, units in requests if self._check(prompt, units)]
        if not any(units for _, units in requests):
            return []
        pooled = [(prompt, [unit for unit in units if not unit.host]) for prompt, units in requests]
        slots = unit_slots(pooled, self.block_size)
        if slots is not None:
            src, dst, rotated, temperature, delta = slots
            plain = ~rotated
            for value in np.unique(temperature[plain]).tolist():
                chosen = plain & (temperature == value)
                device.copy_slots(src[chosen], dst[chosen], key_temperature=value)
            if rotated.any():
                device.copy_slots_rotated(src[rotated], dst[rotated], delta[rotated])
        self._copy_hosted(requests, device)
        return [prompt for prompt, _ in requests]

    def _copy_hosted(self, requests, device: KVDevice) -> None:
        """The requests' host units: their payload rows concatenated on the host (in unit order, as
        ``unit_slots`` lists the units' tokens), then one write per key temperature and one rotated."""
        hosted = [(prompt, [unit for unit in units if unit.host]) for prompt, units in requests]
        slots = unit_slots(hosted, self.block_size, source=False)
        if slots is None:
            return
        _, dst, rotated, temperature, delta = slots
        data = torch.cat([self.host.get(unit.epoch)[:, :, unit.lo - unit.begin:unit.hi - unit.begin]
                          for _, units in hosted for unit in units], dim=2)
        plain = ~rotated
        for value in np.unique(temperature[plain]).tolist():
            chosen = plain & (temperature == value)
            device.write_slots(_rows(data, chosen), dst[chosen], key_temperature=value)
        if rotated.any():
            device.write_slots(_rows(data, rotated), dst[rotated], deltas=delta[rotated])

    def _check(self, prompt, units: Sequence[UnitCopy]) -> bool:
        """Whether every unit's entry blocks hold the planned epoch; else the request's blocks from
        the first unit's on are marked invalid."""
        bad = [unit for unit in units if not self._unit_holds(unit)]
        if not bad:
            return True
        first = min(unit.lo for unit in units) // self.block_size
        self.failed.update(unit.epoch for unit in bad)
        self.refill.add(prompt.req_id)
        self.invalid.update(prompt.block_ids[first:])
        logger.warning("graphchunk: a context fill of request %s would copy pool blocks %s ([]: host memory) that "
                       "do not hold the entries it was planned from (epochs %s, found %s); it is planned again "
                       "instead of reading them",
                       prompt.req_id, [list(u.entry_blocks) for u in bad], [u.epoch for u in bad],
                       [[self.epochs.get(b) for b in u.entry_blocks] for u in bad])
        return False

    def fail(self, block_ids, why: str) -> None:
        """Fails a request whose context cannot be filled: logs ``why`` and leaves its ``block_ids``
        for ``take_invalid`` (vLLM fails the request and never serves the blocks from its prefix cache)."""
        logger.error("%s", why)
        self.invalid.update(block_ids)

    def recompute(self, prompts: Sequence, device: KVDevice) -> None:
        blended = [prompt for prompt in prompts if prompt.policy is not None]
        if blended:
            recompute(blended, device, check_layer=self.check_layer, budget=self.max_forward_tokens,
                      block_size=self.block_size, metrics=self.metrics)


def unit_slots(requests: Sequence[tuple[object, Sequence[UnitCopy]]], block_size: int, source: bool = True):
    """Per token of every unit, in request and unit order: (source slot in the entry's blocks (None
    without ``source``: host units), destination slot in the request's, rotated (blend), the key
    temperature of a plain copy (a chunk's: the request's; a sys prompt's: 1), the rotation's
    delta); None without units. Python reads each unit once; the slots come from array operations
    over the step's tokens together."""
    units = [(index, unit) for index, (_, request_units) in enumerate(requests) for unit in request_units]
    if not units:
        return None
    count = len(units)
    lengths = np.fromiter((u.hi - u.lo for _, u in units), np.int64, count)
    src_first = np.fromiter((u.offset + u.lo - u.begin for _, u in units), np.int64, count)
    dst_first = np.fromiter((u.lo for _, u in units), np.int64, count)
    rotated = np.fromiter((u.kind == "rotated" for _, u in units), bool, count)
    delta = np.fromiter((u.begin - u.offset for _, u in units), np.int64, count)
    temperature = np.fromiter((requests[i][0].key_temperature if u.kind == "chunk" else 1.0 for i, u in units),
                              np.float64, count)
    request_blocks, request_base = _flat([prompt.block_ids for prompt, _ in requests])
    owner = np.fromiter((i for i, _ in units), np.int64, count)
    which = np.repeat(np.arange(count), lengths)
    step = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    src_logical, dst_logical = src_first[which] + step, dst_first[which] + step
    src = None
    if source:
        entry_blocks, entry_base = _flat([u.entry_blocks for _, u in units])
        src = entry_blocks[entry_base[which] + src_logical // block_size] * block_size + src_logical % block_size
    dst = request_blocks[request_base[owner][which] + dst_logical // block_size] * block_size + \
        dst_logical % block_size
    return src, dst, rotated[which], temperature[which], delta[which]


def _rows(data: torch.Tensor, chosen: np.ndarray) -> torch.Tensor:
    """The payload rows (dimension 2: tokens) ``chosen`` marks: all of them without a copy."""
    return data if chosen.all() else data[:, :, torch.from_numpy(chosen)]


def _flat(sequences: list) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' ints concatenated, and where each starts."""
    lengths = np.fromiter((len(s) for s in sequences), np.int64, len(sequences))
    flat = np.fromiter(itertools.chain.from_iterable(sequences), np.int64, int(lengths.sum()))
    return flat, np.cumsum(lengths) - lengths
