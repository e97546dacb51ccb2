"""Host-side plan of segmented requests' context: the one pool index, kept where vLLM schedules.

For a request's context range ``[start, end)`` (C = S + sum L_i, DESIGN.md §2), ``ContextPlanner.plan``
acquires a pool entry for the sys prompt and for each chunk overlapping the range and says what
the workers must do with them:

- a chunk absent from the pool that host memory holds (``host_index.HostIndex``, with
  ``host_bytes``) takes no pool entry: its ``UnitCopy`` copies from the host payload straight into
  the request's slots (one copy);
- any other entry absent from the pool is inserted and given a ``MissJob`` that computes it as a
  pseudo-sequence with ordinary causal attention (sys at positions [0, S); an isolated chunk as
  ``sys ‖ chunk`` continuing the sys entry's KV, its partial last block copied first, positions
  [S, S+L_i); a blend chunk alone at [0, L_i), or after the blend prefix at [m, m+L_i)), or loads
  it from the workers' directory (a sys prompt host memory holds: from there); the job reserves
  room for the entry in host memory, where the workers save it once it has run;
- an entry that an earlier job is still computing is waited for;
- every segment becomes a ``UnitCopy``: the slots of the request's tokens ``[lo, hi)`` in the
  entry's blocks (or host payload), copied into the request's own slots once every entry is ready.

Jobs get increasing ids; workers run them in id order (``context_run.py``) and report the first id
they have not finished (``finish_jobs``), which makes the entries of the jobs before it ready.
A plan with nothing to wait for (``needs`` < 0) is all hits: its request loads synchronously.

References: a plan holds one on each of its entries until its copies have been sent
(``release``), a job one on its entry (and an isolated chunk's job one on its sys entry) until it
has run; eviction (``pool.py``) only takes unreferenced ready entries, so no block is reused while
anything will still read or write it. When a plan may be released is the caller's rule (the
invariant in ``engine/context_scheduler.py``); host entries are held alike (``HostIndex``). Every
entry carries an epoch, unique per insert, that its job and every copy from it name
(``MissJob.epoch``, ``UnitCopy.epoch``): the workers check them. ``plan`` raises ``PoolExhausted``
(having undone itself) when the entries in use leave no room.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from graphchunk.cache.host_index import HostEntry, HostIndex
from graphchunk.cache.keys import KeySpace, chunk_key, sys_key
from graphchunk.cache.pool import ChunkPool, PoolEntry, PoolExhausted
from graphchunk.segments import SegmentedPrompt


@dataclass(frozen=True)
class UnitCopy:
    """One segment's share of a request's context: its tokens ``[lo, hi)``, whose KV sits in
    ``entry_blocks`` from slot ``offset`` on for the segment's first token (``begin``)."""

    entry_blocks: tuple[int, ...]
    offset: int
    lo: int
    hi: int
    begin: int
    kind: str
    """'sys'; 'chunk' (isolated: keys divided by the request's key temperature); 'rotated'
    (blend: computed at [offset, offset + L), after the blend prefix; keys rotated to where the
    chunk lands)."""
    epoch: int = 0
    """The entry's epoch (``PoolEntry.epoch``): what its blocks must hold when the copy runs."""
    host: bool = False
    """Copied from host memory: the payload saved under ``epoch`` (``HostEntry.epoch``) from the
    entry's slots ``[offset, ...)``, whose row ``t - begin`` holds token t's KV (``entry_blocks`` empty)."""


@dataclass(frozen=True)
class MissJob:
    """Computes one pool entry (or loads it from the tier): the pseudo-sequence ``token_ids`` at
    positions ``0..len-1`` over ``block_ids``, its first ``num_cached`` tokens already there."""

    job_id: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_cached: int
    entry_blocks: tuple[int, ...]
    """The entry's own blocks (what the tier stores)."""
    key: bytes
    entry_tokens: tuple[int, ...]
    num_tokens: int
    mode: str
    partial_copy: tuple[int, int] | None = None
    """(sys entry's partial last block, the chunk entry's first block): copied before the forward."""
    after: int = -1
    """The job computing the sys entry this one reads (-1: none, or it was ready)."""
    counted: bool = False
    """A chunk's job: its outcome is counted when it finishes (``misses``, or ``tier_hits`` when
    the tier served it); a sys prompt's is not counted."""
    epoch: int = 0
    """The entry's epoch, stamped on its blocks as the job starts writing them."""
    reads: tuple[tuple[tuple[int, ...], int], ...] = ()
    """Other entries' blocks the job reads, with their epochs (an isolated chunk's sys entry)."""
    offset: int = 0
    """The entry's slot of its first token a copy reads: host memory keeps slots [offset, num_tokens)."""
    save_host: bool = False
    """Host memory has room reserved for the entry (``HostIndex.reserve``): saved there once run."""
    host_source: int = -1
    """The epoch of the host payload the entry is loaded from instead (a sys prompt); -1: none.
    Computed after all when a rank no longer holds it."""


@dataclass(frozen=True)
class EntryCapture:
    """Fills a new blend entry from a request vLLM has just computed as a full prefill, after that
    step's forward: the request's tokens ``[lo, hi)`` (one chunk, computed in the context that preceded
    it there) from its own slots into ``entry_blocks`` from slot ``offset`` on (a chunk's: after where
    the blend prefix would be), keys rotated back by ``lo - offset`` to [offset, offset + hi - lo).
    Runs in the step it is sent with; its ``job_id`` comes from the jobs' sequence (the entry is
    ready once the workers report past it)."""

    job_id: int
    req_id: str
    lo: int
    hi: int
    entry_blocks: tuple[int, ...]
    epoch: int
    offset: int = 0
    key: bytes = b""
    entry_tokens: tuple[int, ...] = ()
    context: str | None = None
    """The identity of the tokens before the chunk (``context_identity``) when the workers also
    write the entry to the tier (``blend_entries`` 'precompute'); None: the pool only."""
    save_host: bool = False
    """Host memory has room reserved for the entry: saved there too (``MissJob.save_host``)."""


def context_identity(tokens) -> str:
    """What a contextualized entry was computed behind: the count and a 128-bit digest of the
    tokens before its chunk (the system prompt and the operator's context documents)."""
    return f"{len(tokens)}:{xxhash.xxh3_128_hexdigest(np.asarray(tokens, dtype=np.int64).tobytes())}"


@dataclass
class _Job:
    """A job the workers have not reported run: its entry, and the entries it holds."""
    entry: PoolEntry
    holds: list[PoolEntry]
    host_holds: list[HostEntry] = field(default_factory=list)
    """Host entries it holds: the room it saves its entry into (ready once it has run), the payload
    it loads from."""
    saves: HostEntry | None = None


@dataclass
class RequestPlan:
    units: list[UnitCopy] = field(default_factory=list)
    jobs: list[MissJob] = field(default_factory=list)
    """Jobs this plan created (others' jobs it waits for are not repeated)."""
    captures: list[EntryCapture] = field(default_factory=list)
    """Entries this plan fills from its request's own slots (``ContextPlanner.capture``)."""
    needs: int = -1
    """The last job id it waits for; -1: every entry is ready."""
    held: list[PoolEntry] = field(default_factory=list)
    host_held: list[HostEntry] = field(default_factory=list)
    counts: list[tuple[str, int, str | int]] = field(default_factory=list)
    """What the plan counts, for the workers to add to their metrics as they run it (``context_run``):
    (metric, n, mode), or ('reused', n, job id): tokens copied from an entry a job is computing,
    reused should the tier serve it."""


def context_blocks(seg: SegmentedPrompt, mode: str, block_size: int, prefix_len: int = 0) -> int:
    """The pool blocks a request's whole context holds at once when planned from its first token:
    its sys prompt's entry and one entry per distinct chunk (isolated: from the sys prompt's partial
    last block on; blend: after the blend prefix's ``prefix_len`` tokens), as ``ContextPlanner.plan``
    inserts them. A context needing more than the pool's blocks can never be planned."""
    lay = seg.layout
    offset = lay.sys_len % block_size if mode == "isolated" else prefix_len
    chunks = {tuple(seg.chunk_tokens(i)) for i in range(lay.num_chunks)}
    return -(-lay.sys_len // block_size) + sum(-(-(offset + len(chunk)) // block_size) for chunk in chunks)


class ContextPlanner:
    def __init__(self, pool: ChunkPool, space: KeySpace, host: HostIndex | None = None):
        """``host``: the host-memory level's index (``host_bytes``), None without one."""
        self.pool, self.space, self.host = pool, space, host
        self.block_size = pool.block_size
        self._next_job = 0
        self._running: dict[int, _Job] = {}
        """Jobs not yet reported run, in increasing id order (ids are handed out in order)."""

    def plan(self, seg: SegmentedPrompt, salt: str | None, mode: str, start: int, end: int) -> RequestPlan:
        plan = RequestPlan()
        num_jobs = self._next_job
        try:
            for index, (begin, stop) in enumerate(seg.bounds[:-1]):
                lo, hi = max(begin, start), min(stop, end)
                if lo < hi:
                    self._plan_unit(seg, salt, mode, None if index == 0 else index - 1, lo, hi, plan)
        except PoolExhausted:
            self.release(plan)
            for job in plan.jobs:  # never sent: their entries are dropped with their last release
                self._release_job(self._running.pop(job.job_id))
            self._next_job = num_jobs
            raise
        return plan

    def missing_tokens(self, seg: SegmentedPrompt, salt: str | None, mode: str, start: int, end: int) -> int:
        """Tokens of ``[start, end)`` whose entry (sys prompt or chunk) the pool holds neither ready
        nor in flight: what planning the range would compute. Acquires nothing."""
        missing = 0
        for index, (begin, stop) in enumerate(seg.bounds[:-1]):
            lo, hi = max(begin, start), min(stop, end)
            if lo < hi and not self._holds(*self._identity(seg, salt, mode, None if index == 0 else index - 1)):
                missing += hi - lo
        return missing

    def capture(self, seg: SegmentedPrompt, salt: str | None, req_id: str, last_only: bool = False) -> RequestPlan:
        """A plan for the sys prompt and chunks of blend request ``req_id``, which vLLM computes as a
        full prefill in the step this plan is sent with: a segment whose entry the pool holds neither
        ready nor in flight gets a new entry filled from the request's own slots (``EntryCapture``)
        instead of a job computing it (a chunk alone). Chunk lookups counted; nothing is copied into
        the request. A pool too full for an entry leaves that segment and the rest uncaptured.
        ``last_only`` (``blend_entries`` 'precompute'): only the last chunk, everything before it
        being its context, which the capture names (``EntryCapture.context``: written to the tier)."""
        plan = RequestPlan()
        segments = list(enumerate(seg.bounds[:-1]))
        for index, (lo, hi) in segments[-1:] if last_only else segments:
            chunk = None if index == 0 else index - 1
            if lo == hi or (last_only and chunk is None):
                continue
            key, tokens = self._identity(seg, salt, "blend", chunk)
            hit = self.pool.contains(key, tokens)
            if not hit:
                try:
                    entry = self._insert(key, tokens, len(tokens), plan)
                except PoolExhausted:
                    break
                offset = 0 if chunk is None else len(self.space.blend_prefix)
                saves = self._reserve(entry, offset)
                job_id = self._start_job(entry, [entry], saves)
                context = context_identity(seg.token_ids[:lo]) if last_only else None
                plan.captures.append(EntryCapture(job_id, req_id, lo, hi, tuple(entry.block_ids), entry.epoch, offset,
                                                  key, tuple(tokens), context, saves is not None))
            if chunk is not None:
                plan.counts += [("lookups", 1, "blend"), ("hits" if hit else "misses", 1, "blend")]
        return plan

    def release(self, plan: RequestPlan) -> None:
        for entry in plan.held:
            self.pool.release(entry)
        for hosted in plan.host_held:
            self.host.release(hosted)
        plan.held, plan.host_held = [], []

    def take_host_drops(self) -> tuple[int, ...]:
        """Host payloads dropped since the last call, for the workers (``HostIndex.take_drops``)."""
        return self.host.take_drops() if self.host is not None else ()

    @property
    def has_jobs(self) -> bool:
        """Whether any job (or capture) has not been reported run."""
        return bool(self._running)

    def fail_entries(self, epochs) -> None:
        """The workers found the entries of these epochs bad: they leave the index now (a job still
        computing one keeps its reference until it is reported run)."""
        if epochs:
            self.pool.forget(set(epochs))
            if self.host is not None:
                self.host.forget(epochs)

    def finish_jobs(self, done_before: int) -> None:
        """The workers have run every job with an id below ``done_before`` (``_running`` holds ids in
        increasing order: only the jobs finished are touched)."""
        while self._running and (job_id := next(iter(self._running))) < done_before:
            job = self._running.pop(job_id)
            self.pool.mark_ready(job.entry)
            job.entry.job_id = -1
            if job.saves is not None:
                self.host.mark_ready(job.saves)
            self._release_job(job)

    def _release_job(self, job: _Job) -> None:
        for held in job.holds:
            self.pool.release(held)
        for hosted in job.host_holds:
            self.host.release(hosted)

    # --- one segment ---------------------------------------------------------------------------

    def _plan_unit(self, seg, salt, mode, chunk: int | None, lo: int, hi: int, plan: RequestPlan) -> None:
        sys_entry = None
        if seg.layout.sys_len and (chunk is None or mode == "isolated"):
            sys_entry = self._acquire_sys(seg, salt, mode, plan)
        if chunk is None:
            entry, offset, kind = sys_entry, 0, "sys"
        else:
            entry, offset = self._acquire_chunk(seg, chunk, sys_entry, salt, mode, plan)
            kind = "rotated" if mode == "blend" else "chunk"
        plan.counts.append(("tokens_reused", hi - lo, mode) if entry.ready else ("reused", hi - lo, entry.job_id))
        begin = seg.bounds[0 if chunk is None else 1 + chunk][0]
        if isinstance(entry, HostEntry):
            plan.units.append(UnitCopy((), offset, lo, hi, begin, kind, entry.epoch, host=True))
        else:
            plan.units.append(UnitCopy(tuple(entry.block_ids), offset, lo, hi, begin, kind, entry.epoch))

    def _identity(self, seg, salt, mode, chunk: int | None) -> tuple[bytes, tuple[int, ...]]:
        """(key, tokens) of the sys prompt's entry (``chunk`` None) or of chunk ``chunk``'s: isolated,
        ``sys ‖ chunk``; blend, ``blend_prefix ‖ chunk`` (the chunk alone when there is no prefix).
        Worked out once per prompt and kept on it (a request is checked and planned several
        times, and its sys prompt looked up once per chunk); keys hash slices of its token array."""
        space, memo = seg.__dict__.get("_identities", (None, None))
        if space is not self.space:
            memo = {}
            seg.__dict__["_identities"] = (self.space, memo)
        identity = memo.get((salt, mode, chunk))
        if identity is None:
            identity = memo[salt, mode, chunk] = self._compute_identity(seg, salt, mode, chunk)
        return identity

    def _compute_identity(self, seg, salt, mode, chunk: int | None) -> tuple[bytes, tuple[int, ...]]:
        if chunk is None:
            return sys_key(self.space, seg.segment_array(0), salt, mode), seg.sys_tokens
        isolated = mode == "isolated"
        sys_tokens = seg.sys_tokens if isolated else tuple(self.space.blend_prefix)
        key = chunk_key(self.space, seg.segment_array(0) if isolated else sys_tokens, seg.segment_array(1 + chunk),
                        salt, mode)
        return key, sys_tokens + seg.chunk_tokens(chunk)

    def _acquire_sys(self, seg, salt, mode, plan: RequestPlan) -> PoolEntry:
        key, tokens = self._identity(seg, salt, mode, None)
        entry = self._lookup(key, tokens, plan)
        if entry is None:
            entry = self._insert(key, seg.sys_tokens, seg.layout.sys_len, plan)
            # in host memory: loaded from there into the pool, where chunk jobs read it
            hosted = self.host.lookup(key, tokens) if self.host is not None else None
            self._add_job(plan, entry, seg.sys_tokens, entry.block_ids, 0, mode, [entry], counted=False,
                          source=hosted)
        return entry

    def _acquire_chunk(self, seg, i, sys_entry, salt, mode, plan: RequestPlan) -> tuple[PoolEntry | HostEntry, int]:
        """The chunk's entry and the slot offset of its first token in the entry's blocks; a host
        entry (its payload starting there) when the pool misses and host memory holds it. The
        metrics count chunk lookups only (a sys prompt is looked up once per chunk it precedes).

        Isolated: the entry holds ``sys ‖ chunk``'s KV from the sys prompt's partial last block on.
        Blend: ``blend_prefix ‖ chunk`` at positions [0, m + L) from the first slot, the chunk's first
        token at slot (and position) m, the prefix's length."""
        chunk = seg.chunk_tokens(i)
        sys_tokens = seg.sys_tokens if mode == "isolated" else ()
        offset = len(sys_tokens) % self.block_size if mode == "isolated" else len(self.space.blend_prefix)
        start = time.perf_counter()
        key, tokens = self._identity(seg, salt, mode, i)
        entry = self._lookup(key, tokens, plan)
        plan.counts.append(("lookup_seconds", time.perf_counter() - start, mode))
        counts = [("lookups", 1, mode)] + ([("hits", 1, mode)] if entry is not None else [])  # in flight: a hit
        hosted = self.host.lookup(key, tokens) if entry is None and self.host is not None else None
        if hosted is not None:  # copied from host memory into the request: no pool entry
            plan.host_held.append(hosted)
            plan.counts += counts + [("tier_hits", 1, mode), ("tier_host_hits", 1, ""), ("tier_loads", 1, "")]
            return hosted, offset
        if entry is None:  # a miss, counted when its job finishes (computed, or loaded from the tier)
            entry = self._insert(key, tokens, offset + len(chunk), plan)
            if mode == "blend":
                self._add_job(plan, entry, tokens, entry.block_ids, 0, mode, [entry], offset=offset)
            else:
                sys_blocks = sys_entry.block_ids[: len(sys_tokens) // self.block_size] if sys_entry else []
                partial = (sys_entry.block_ids[-1], entry.block_ids[0]) if offset else None
                holds = [entry] + ([sys_entry] if sys_entry is not None else [])
                if sys_entry is not None:
                    self.pool.acquire(sys_entry)
                after = sys_entry.job_id if sys_entry is not None and not sys_entry.ready else -1
                reads = ((tuple(sys_entry.block_ids), sys_entry.epoch),) if sys_entry is not None else ()
                self._add_job(plan, entry, tokens, [*sys_blocks, *entry.block_ids], len(sys_tokens), mode, holds,
                              partial, after, reads=reads, offset=offset)
        plan.counts += counts
        return entry, offset

    def _lookup(self, key: bytes, tokens, plan: RequestPlan) -> PoolEntry | None:
        entry = self.pool.lookup(key, tokens)
        if entry is not None:
            plan.held.append(entry)
            if not entry.ready:
                plan.needs = max(plan.needs, entry.job_id)
        return entry

    def _insert(self, key: bytes, tokens, num_tokens: int, plan: RequestPlan) -> PoolEntry:
        entry = self.pool.insert(key, tokens, num_tokens)
        plan.held.append(entry)
        return entry

    def _holds(self, key: bytes, tokens) -> bool:
        """Whether the pool (ready or in flight) or host memory holds the entry."""
        return self.pool.contains(key, tokens) or (self.host is not None and self.host.contains(key, tokens))

    def _reserve(self, entry: PoolEntry, offset: int) -> HostEntry | None:
        """Host memory's room for the entry's payload (slots ``[offset, num_tokens)``), or None."""
        if self.host is None:
            return None
        return self.host.reserve(entry.key, tuple(entry.tokens), entry.num_tokens - offset, entry.epoch)

    def _start_job(self, entry: PoolEntry, holds: list[PoolEntry], saves: HostEntry | None = None,
                   source: HostEntry | None = None) -> int:
        """The next job id, for the job (or capture) that fills ``entry``: it takes a reference of
        its own on the entry, beside the plan's (others in ``holds``: the caller's), released with
        ``holds`` once the workers report it run; so are ``saves`` (host memory's room for the entry,
        then ready) and ``source`` (the host payload it loads), each holding one reference."""
        job_id, self._next_job = self._next_job, self._next_job + 1
        self.pool.acquire(entry)
        entry.job_id = job_id
        self._running[job_id] = _Job(entry, holds, [h for h in (saves, source) if h is not None], saves)
        return job_id

    def _add_job(self, plan: RequestPlan, entry: PoolEntry, token_ids, block_ids, num_cached: int, mode: str,
                 holds: list[PoolEntry], partial: tuple[int, int] | None = None, after: int = -1,
                 counted: bool = True, reads: tuple = (), offset: int = 0, source: HostEntry | None = None) -> None:
        saves = self._reserve(entry, offset) if source is None else None
        job = MissJob(self._start_job(entry, holds, saves, source), tuple(token_ids), tuple(block_ids), num_cached,
                      tuple(entry.block_ids), entry.key, tuple(entry.tokens), entry.num_tokens, mode, partial, after,
                      counted, entry.epoch, reads, offset, saves is not None, source.epoch if source else -1)
        plan.jobs.append(job)
        plan.needs = max(plan.needs, job.job_id)
