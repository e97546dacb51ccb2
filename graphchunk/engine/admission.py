"""Admission: whether and how a segmented request's context is planned, each time vLLM's scheduler
asks (``ContextScheduler.matched``), in vLLM's scheduler process over the one pool index. The
scheduler keeps the requests' state, the step's work and the hooks' order (``context_scheduler.py``);
this decides, for one request at a time, whether its context is planned, waits, runs as vLLM's
full prefill or is refused, and which of a full prefill's entries are kept.

A pool too full for the plan answers None (vLLM asks again next step) and reserves the pool's room
for that request: until it is planned (or leaves), every other request that would take room (a
miss) answers None too, and full prefills' entries are not kept; all-hit requests, which take no
room, go on. So its wait is bounded by the work in flight when it found no room: the jobs and
loads holding entries then (at ``miss_budget`` tokens a step) and the fills of one step, never by
the traffic that arrives after it. An all-hit blend request answers None too once the step's blend
recompute (which vLLM's token budget does not see: it runs as graphchunk's own forwards) would
pass ``recompute_budget`` tokens: one is always admitted. Blend requests holding a plan not yet
filled (waiting for their misses or for that budget) are the gauge ``blend_requests_pending``;
each put-off, ``blend_recompute_deferrals``.

A blend request whose misses and recompute would cost at least its full prefill (``blend_misses``:
``prefill_instead``) answers 0: vLLM computes its full prefill, exactly blend's target; its missing
entries are planned once the step's metadata is built (``next_step``), so their jobs run from the
next step on, after the prefill; with ``blend_entries`` 'context' they are instead filled from the
prefill itself, in the step that completes its context, after that step's forward
(``EntryCapture``), only for a request with a client's ``cache_salt`` (its entries are keyed by it:
that client's alone), whose prefill computes every chunk token over its sys prompt alone, and which
never had blended KV (``_captures_from``). With 'precompute' (``graphchunk-precompute``'s offline
engine) every blend request runs as a full prefill and only its last chunk is captured, behind the
rest as its context, and written to the tier.

A request whose context can never fit the pool, even with every other entry evicted, is refused
(``requests_failed``): its load carries the reason, and the workers fail it through vLLM's
KV-load-failure path instead of leaving it waiting for room that will never come (the API process
refuses most such requests before they are queued: ``frontend.RequestAnnotator``). A blend request
of a ranking policy runs as vLLM's full prefill instead (``blend_full_prefills``).
"""
from __future__ import annotations

import dataclasses

from graphchunk.cache.context_plan import ContextPlanner, EntryCapture, MissJob, RequestPlan, context_blocks
from graphchunk.cache.pool import ChunkPool, PoolExhausted
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.frontend import one_tenant
from graphchunk.engine.request_args import ChunkRequest
from graphchunk.log import logger
from graphchunk.metrics import CacheMetrics


@dataclasses.dataclass
class RequestState:
    """A request as the scheduler holds it between vLLM's calls, admission's decisions included."""

    chunked: ChunkRequest | None
    context_len: int
    recompute_cost: int = 0
    """Its blend recompute's tokens (``RecomputePolicy.cost``; 0 for isolated), worked out once."""
    plan: RequestPlan | None = None
    start: int = 0
    waiting: bool = False
    """Loads asynchronously: its workers fill it once its jobs have run."""
    refused: str | None = None
    """Why its context cannot be loaded (it never fits the pool)."""
    prefilled: bool = False
    """A blend request run as vLLM's full prefill (``Admission.prefill_instead``)."""
    filled: bool = False
    """Some of its context was sent to the workers to fill (blended KV, for a blend request)."""
    retries: int = 0
    """Times it was planned again after its context read KV that failed its check (``refill``)."""
    pool_blocks: int = -1
    """The pool blocks its whole context takes (``context_plan.context_blocks``; -1: not yet worked out)."""


def recompute_cost(request: ChunkRequest) -> int:
    """A request's blend recompute tokens (``RecomputePolicy.cost``; 0 for isolated)."""
    policy, lay = request.policy, request.seg.layout
    return policy.cost(lay.chunk_lens, lay.question_len) if policy is not None else 0


class Admission:
    """The scheduler's decisions over one pool index: plans, the pool room reserved for the request
    waiting longest, the step's blend recompute budget, and the full prefills' entries."""

    def __init__(self, config: GraphChunkConfig, planner: ContextPlanner, metrics: CacheMetrics):
        self.config, self.planner, self.metrics = config, planner, metrics
        if config.blend_entries == "context":
            logger.info("graphchunk: blend_entries 'context': a blend request's full prefill becomes blend entries "
                        "only when it carries a cache_salt, and only requests with the same cache_salt read them "
                        "(a salt is one tenant: its clients shape each other's blend KV); requests without one "
                        "use entries computed alone")
        if config.blend_entries == "precompute":
            logger.info("graphchunk: blend_entries 'precompute' (graphchunk-precompute's offline engine): every blend "
                        "request runs as vLLM's full prefill and its last chunk's KV, computed behind the system "
                        "prompt and documents before it, is written to the tier as that chunk's blend entry")
        self.capturing: dict[str, ChunkRequest] = {}
        """Full-prefilled blend requests whose missing entries are captured from their prefill
        (``blend_entries`` 'context') once a step completes their context."""
        self._for_later: list[ChunkRequest] = []
        """Requests run as full prefills this step, whose missing entries are planned after it."""
        self._recompute_tokens = 0
        """Blend recompute admitted into this step (``RecomputePolicy.cost``)."""
        self._room_for: str | None = None
        """The request waiting longest for pool room: until it is planned, no other plan takes room."""

    @property
    def pool(self) -> ChunkPool:
        return self.planner.pool

    def plan(self, req_id: str, state: RequestState, num_computed: int) -> RequestPlan | tuple[int | None, bool]:
        """The plan of the request's context from ``num_computed`` on, or vLLM's answer without one:
        0 (a full prefill), None (it waits for pool room), the rest of its context (refused)."""
        request = state.chunked
        mode = "isolated" if request.policy is None else "blend"
        if self.config.blend_entries == "precompute" and request.policy is not None and not state.filled:
            state.prefilled = True  # its last chunk's entry is captured behind what precedes it
            self.capturing[req_id] = request
            return 0, False
        if self.prefill_instead(request, num_computed, state.context_len):
            state.prefilled = True
            self.metrics.blend_full_prefills += 1
            if self._captures_from(state, num_computed):
                self.capturing[req_id] = request
            else:
                self._for_later.append(request)
            return 0, False
        if state.pool_blocks < 0:  # worked out once, however often it is asked again
            state.pool_blocks = context_blocks(request.seg, mode, self.pool.block_size,
                                               len(self.planner.space.blend_prefix))
        if state.pool_blocks > self.pool.num_blocks:  # never planned: it would only evict what others reuse
            return self._never_fits(req_id, state, num_computed,
                                    f"{state.pool_blocks} blocks, more than the pool's {self.pool.num_blocks}")
        if self._room_for not in (None, req_id) and \
                self.planner.missing_tokens(request.seg, request.salt, mode, num_computed, state.context_len):
            return None, False  # the pool's room goes to the request waiting for it first
        try:
            return self.planner.plan(request.seg, request.salt, mode, num_computed, state.context_len)
        except PoolExhausted as exc:
            if self.pool.in_use:
                logger.debug("graphchunk: request %s waits for pool room: %s", req_id, exc)
                self._room_for = self._room_for or req_id
                return None, False
            return self._never_fits(req_id, state, num_computed, str(exc))

    def admit(self, state: RequestState, num_computed: int, done_before: int) -> tuple[int | None, bool]:
        """vLLM's answer for a planned request, given the workers' first unfinished job: its context
        (asynchronously while its jobs run), or None: a blend plan waiting for its jobs (loaded
        synchronously once they have run, ``context_scheduler.py``), or a step whose blend
        recompute is full."""
        load_async = state.plan.needs >= done_before
        if load_async and state.chunked.policy is not None:
            return None, False  # blend: loaded synchronously once its jobs have run
        if not load_async and self._recompute_tokens and \
                self._recompute_tokens + state.recompute_cost > self.config.recompute_budget:
            self.metrics.blend_recompute_deferrals += 1
            return None, False  # this step's blend recompute is full: next step
        return state.context_len - num_computed, load_async

    def count_fill(self, state: RequestState) -> None:
        """A fill sent this step: its blend recompute counts against the step's budget."""
        self._recompute_tokens += state.recompute_cost

    def _never_fits(self, req_id: str, state: RequestState, num_computed: int, why: str) -> tuple[int, bool]:
        """A context the chunk pool cannot hold even when empty: a ranking blend request runs as
        vLLM's full prefill (blend's target, ``blend_full_prefills``); any other is refused (its
        load carries the reason: the workers fail it)."""
        policy = state.chunked.policy
        if policy is not None and policy.needs_check:
            logger.info("graphchunk: blend request %s's context cannot fit the chunk pool even when empty (%s): it "
                        "runs as vLLM's full prefill, blend's target", req_id, why)
            state.prefilled = True
            self.metrics.blend_full_prefills += 1
            return 0, False
        state.start = num_computed
        state.refused = (f"graphchunk: request {req_id}'s context cannot fit the chunk pool even when empty ({why}); "
                         f"raise graphchunk.pool_tokens or send fewer, shorter chunks")
        return state.context_len - num_computed, False

    def _captures_from(self, state: RequestState, start: int) -> bool:
        """Whether a request run as vLLM's full prefill from token ``start`` on fills new blend
        entries from it (``blend_entries`` 'context'): only when it carries a client's
        ``cache_salt`` (``frontend.one_tenant``: its entries are keyed by that salt, so only that
        client's requests ever read them; no client shapes the KV another's answer comes from),
        that prefill computes every chunk token over nothing but the sys prompt (``start`` within
        it; a sys prompt's KV is the same however it was computed), and nothing of its context was
        ever blended (a request blended, preempted and resumed holds blended KV in its own
        prefix-cache blocks). The others' chunks are computed alone (``_compute_for_later``)."""
        chunked = state.chunked
        return self.config.blend_entries == "context" and one_tenant(chunked.salt) and not state.filled and \
            start <= chunked.seg.layout.sys_len

    def leave_room(self, req_id: str) -> None:
        if self._room_for == req_id:
            self._room_for = None

    def prefill_instead(self, request: ChunkRequest, start: int, end: int) -> bool:
        """Whether a blend request's context ``[start, end)`` runs as vLLM's full prefill
        (``blend_misses``): its missing entries and its recompute cost at least the range itself.
        Only for policies that rank the context (cacheblend, question at a ratio strictly between
        0 and 1): vLLM's prefix cache never shares their KV between requests (their salt carries a
        nonce: ``frontend.blend_fingerprint``), so no blended request is handed this exact KV as
        blend KV. (Recomputing every token blends exactly: that path stays the exactness suite's.)"""
        policy = request.policy
        if policy is None or not policy.needs_check or self.config.blend_misses != "prefill" or \
                self.config.tiered:
            return False
        missing = self.planner.missing_tokens(request.seg, request.salt, "blend", start, end)
        return missing > 0 and missing + recompute_cost(request) >= end - start

    def captures(self, scheduled: dict[str, int], computed: dict[str, int]) -> tuple[tuple[EntryCapture, ...], list]:
        """Captures of the full-prefilled requests whose context this step completes, and their
        counts (which join the step's); ``scheduled``, ``computed``: the step's tokens per request,
        and those computed before it."""
        captures, counts = [], []
        for req_id, num_tokens in scheduled.items():
            request = self.capturing.get(req_id)
            if request is None or computed[req_id] + num_tokens < request.seg.layout.context_len:
                continue
            del self.capturing[req_id]
            if self._room_for is not None:  # a request waits for pool room: it gets it first
                continue
            plan = self.planner.capture(request.seg, request.salt, req_id,
                                        last_only=self.config.blend_entries == "precompute")
            captures += plan.captures
            counts += plan.counts
            self.planner.release(plan)
        return tuple(captures), counts

    def next_step(self) -> tuple[list[MissJob], list]:
        """Once the step's metadata is built and its fills' plans released: the next step's blend
        recompute budget starts empty, and the entries this step's full prefills lacked are
        planned: (jobs, counts) of the next step, run after this step's prefill."""
        self._recompute_tokens = 0
        jobs, counts = [], []
        for request in self._for_later:
            self._compute_for_later(request, jobs, counts)
        self._for_later = []
        return jobs, counts

    def _compute_for_later(self, request: ChunkRequest, jobs: list, counts: list) -> None:
        """Jobs for the entries a full-prefilled blend request lacked, its lookups counted; nothing
        is copied from them for it. None while a request waits for pool room."""
        if self._room_for is not None:
            return
        try:
            plan = self.planner.plan(request.seg, request.salt, "blend", 0, request.seg.layout.context_len)
        except PoolExhausted as exc:
            logger.debug("graphchunk: no pool room to keep a full-prefilled request's chunks: %s", exc)
            return
        jobs += plan.jobs
        counts += [count for count in plan.counts if count[0] not in ("tokens_reused", "reused")]
        self.planner.release(plan)

    def finished(self, req_id: str) -> None:
        """A request left: it captures nothing more, and no longer holds the pool's room."""
        self.capturing.pop(req_id, None)
        self.leave_room(req_id)
