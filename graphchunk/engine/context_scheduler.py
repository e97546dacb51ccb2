"""The scheduler half of graphchunk's KV connector: which context vLLM may count as computed, and
what the workers must do for it, decided once, in vLLM's scheduler process, over the one pool index.

Per segmented request (``ChunkRequest``, read once from what graphchunk's frontend sent with it):

``matched``   (vLLM asks how many tokens beyond its own prefix-cache hit come from elsewhere)
              plans the context from that hit to C (``context_plan.ContextPlanner``): all hits
              load synchronously, before the step's forward; an isolated plan with misses loads
              asynchronously: the request waits while the workers run its jobs, a budget per step.
              A blend plan with misses answers None until its jobs have run (the plan held), then
              loads synchronously: its fill and recompute run in the step that schedules it, so
              vLLM, which publishes a synchronous load's blocks to its prefix cache at once and
              an asynchronous one's when it completes, never publishes blend KV that its
              recompute has not finished (the recompute needs the question's blocks).
              A pool too full for the plan answers None (vLLM asks again next step) and
              reserves the pool's room for that request: until it is planned (or leaves), every
              other request that would take room (a miss) answers None too, and full prefills'
              entries are not kept; all-hit requests, which take no room, go on. So its wait is
              bounded by the work in flight when it found no room: the jobs and loads holding
              entries then (at ``miss_budget`` tokens a step) and the fills of one step, never by
              the traffic that arrives after it. An all-hit blend request answers None too once
              the step's blend recompute (which vLLM's token budget does not see: it runs as
              graphchunk's own forwards) would pass ``recompute_budget`` tokens: one is always
              admitted. Blend requests holding a plan
              not yet filled (waiting for their misses or for that budget) are the gauge
              ``blend_requests_pending``; each put-off, ``blend_recompute_deferrals``.
              A blend request whose misses and recompute would cost at least its full prefill
              (``blend_misses``: ``prefill_instead``) answers 0: vLLM computes its full prefill,
              exactly blend's target; its missing entries are planned once the step's metadata is
              built (``metadata``), so their jobs run from the next step on, after the prefill;
              with ``blend_entries`` 'context' they are instead filled from the prefill itself, in
              the step that completes its context, after that step's forward (``EntryCapture``),
              only for a request with a client's ``cache_salt`` (its entries are keyed by it:
              that client's alone), whose prefill computes every chunk token over its sys prompt
              alone, and which never had blended KV (``_captures_from``). With 'precompute'
              (``graphchunk-precompute``'s offline engine) every blend request runs as a full
              prefill and only its last chunk is captured, behind the rest as its context, and
              written to the tier.
``allocated`` (vLLM allocated its blocks) turns the plan into a load: a fill this step (hits), or
              a load the workers complete by themselves once its jobs have run (isolated misses).
``metadata``  (vLLM builds the step's metadata) sends the step's new jobs, fills and loads, the
              plans' counts and the step's new segmented requests as read here (the workers read
              no request again; the pool's own metrics are published from here, once a step),
              then releases the plans of the step's fills.
``reported``  the workers' first unfinished job: earlier jobs' entries become ready; entries the
              workers found bad (a job that read the wrong input, a copy that failed its check)
              leave the index at once (``entries_failed``): the next request computes them again.
``refill``    (before vLLM processes a step's output, ``fill_retry.py``) a request whose context read
              KV that failed its check is planned again when vLLM schedules it next, counted
              (``fills_retried``); after ``MAX_FILL_RETRIES`` its next plan is refused instead.
``finished``  releases what a finished, aborted or preempted-and-dropped request still holds.
``take_events`` the pool's entries stored (ready) and removed since the last step, as vLLM's KV
              events (``kv_events.py``), which vLLM publishes on its KV-event stream
              (``--kv-events-config``) for KV-aware routers.

**The invariant** (what makes a fill read what it planned): *no pool block is written while a copy
planned from it is outstanding.* A block is written only by the job of a new entry, and a new
entry takes only blocks no entry in use holds (``pool.py``); so it suffices that every planned copy
holds its entries until the workers can no longer run it late:

- a fill of this step (all hits) holds them until ``metadata`` has been built, not merely until
  ``allocated``: one ``schedule()`` plans many requests between the two, and a later request's
  misses must not evict what an earlier one will copy in this step (the workers run a step's jobs
  before its fills). Jobs planned in later steps run after this step's fills: every worker runs
  steps in order, and a worker's device work is ordered in one stream;
- an asynchronous load holds them until a worker reports it filled (``loaded``); a load whose
  request finishes first is dropped by the workers before the next step's jobs run, and reported
  loaded all the same (``chunk_engine.py``: vLLM frees a request that left while waiting for its
  load only once the load is reported), so releasing it in ``finished`` is safe;
- a job holds its entry (and an isolated chunk's job its sys entry) until the workers report it
  run (``reported``: the first unfinished job, the smallest over tensor-parallel ranks).

Preemption needs nothing more: a preempted request holds no plan (its fill ran), and when vLLM
schedules it again it is planned afresh from its new prefix hit. The workers check every copy
against the entry's epoch anyway (``context_run.py``): should this ever be wrong, the request
goes back to vLLM's queue and is planned again (``refill``), its blocks lose their prefix-cache
hashes (``connector.py``, ``_evict_invalid``) and the entry leaves the index.

A request whose context can never fit the pool, even with every other entry evicted, is refused
(``requests_failed``): its load carries the reason, and the workers fail it through vLLM's
KV-load-failure path instead of leaving it waiting for room that will never come (the API
process refuses most such requests before they are queued: ``frontend.RequestAnnotator``). A
blend request of a ranking policy runs as vLLM's full prefill instead (``blend_full_prefills``).

A blend request the model cannot blend (``handshake.blend_refusal``, from the workers) and an
ordinary prompt load nothing: vLLM computes their full prefill itself.
"""
from __future__ import annotations

import dataclasses

from graphchunk.cache.chunk_cache import ScheduledPrompt
from graphchunk.cache.context_plan import ContextPlanner, EntryCapture, MissJob, RequestPlan, UnitCopy, context_blocks
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.pool import ChunkPool, PoolExhausted
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.frontend import ChunkRequest, chunk_request, one_tenant
from graphchunk.engine.kv_events import PoolEvents
from graphchunk.log import logger
from graphchunk.metrics import POOL_FIELDS, CacheMetrics, MetricsPublisher, StatsReport, engine_metrics_file

MAX_FILL_RETRIES = 8
"""Times a request whose context read KV that failed its check is planned again before it fails.
A failed check is a bug's effect, independent from one plan to the next: under the CI soak's
injections (a poisoned entry on every 5th step that copies, often the retried request's own step)
a retry fails again about one time in five, so 3 retries failed a request in about one run in
seven; 8 leave about one in 20 000 runs."""

@dataclasses.dataclass(frozen=True)
class PoolHandshake:
    """What the workers tell the scheduler once, after allocating the KV cache."""

    first_block: int
    num_blocks: int
    block_size: int
    space: KeySpace
    blend_refusal: str | None
    """Why blend mode cannot run on this model (None: it can)."""
    check_refusal: str | None
    """Why CacheBlend's check pass cannot run (None: it can)."""

    def runs(self, request: ChunkRequest) -> bool:
        """Whether the workers run ``request`` as segmented (else vLLM computes its full prefill)."""
        policy = request.policy
        return policy is None or (self.blend_refusal is None and not (policy.needs_check and self.check_refusal))


@dataclasses.dataclass(frozen=True)
class ContextLoad:
    """A request's context tokens ``[start, end)`` to copy into its ``block_ids`` from the pool."""

    req_id: str
    request: ChunkRequest
    start: int
    end: int
    block_ids: tuple[int, ...]
    units: tuple[UnitCopy, ...]
    needs: int = -1
    """The last job it waits for (-1: none: a fill of this step)."""
    refused: str | None = None
    """Why graphchunk cannot load this context (the workers fail the request); None: it can."""

    def prompt(self) -> ScheduledPrompt:
        """The request's context range, for the workers' fill (``context_run``; blend's recompute
        reads the whole request: its question is scored as a pseudo-sequence, scheduled or not)."""
        r = self.request
        return ScheduledPrompt(r.seg, r.salt, self.start, r.seg.layout.num_tokens, self.block_ids, r.policy,
                               r.key_temperature, self.req_id)


@dataclasses.dataclass
class StepWork:
    """One step's work for the workers (the connector metadata's content)."""

    jobs: tuple[MissJob, ...] = ()
    fills: tuple[ContextLoad, ...] = ()
    """Filled before this step's forward: the requests are scheduled in it."""
    loads: tuple[ContextLoad, ...] = ()
    """Filled by the workers once the jobs up to ``needs`` have run, then reported loaded."""
    counts: tuple = ()
    captures: tuple[EntryCapture, ...] = ()
    """New blend entries filled from requests' own slots after this step's forward."""
    requests: tuple[tuple[str, ChunkRequest], ...] = ()
    """The step's new requests (vLLM's ``scheduled_new_reqs``) that run segmented, as the scheduler
    read them: the workers hold these instead of reading each request again."""


def computed_before(so) -> dict[str, int]:
    """Tokens each request of scheduler output ``so`` had computed before the step."""
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return computed


@dataclasses.dataclass
class _Request:
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
    """A blend request run as vLLM's full prefill (``ContextScheduler.prefill_instead``)."""
    filled: bool = False
    """Some of its context was sent to the workers to fill (blended KV, for a blend request)."""
    retries: int = 0
    """Times it was planned again after its context read KV that failed its check (``refill``)."""
    pool_blocks: int = -1
    """The pool blocks its whole context takes (``context_plan.context_blocks``; -1: not yet worked out)."""


class ContextScheduler:
    def __init__(self, config: GraphChunkConfig, handshake: PoolHandshake, engine: int = 0):
        self.config, self.handshake = config, handshake
        self.metrics = CacheMetrics()
        pool = ChunkPool(handshake.num_blocks, handshake.block_size, handshake.first_block, self.metrics,
                         policy=config.eviction)
        self.planner = ContextPlanner(pool, handshake.space)
        self.events = PoolEvents(handshake.block_size)
        pool.listener = self.events
        path = engine_metrics_file(engine)
        self.publisher = MetricsPublisher(path, POOL_FIELDS) if path else None
        """Publishes the pool's metrics for the API process (``plugin.published_pool``) and ``GraphChunkLLM.stats()``."""
        self.report = StatsReport(self.metrics, POOL_FIELDS)
        """The pool's metrics for vLLM's stats (the connector's ``get_kv_connector_stats``)."""
        if config.blend_entries == "context":
            logger.info("graphchunk: blend_entries 'context': a blend request's full prefill becomes blend entries "
                        "only when it carries a cache_salt, and only requests with the same cache_salt read them "
                        "(a salt is one tenant: its clients shape each other's blend KV); requests without one "
                        "use entries computed alone")
        if config.blend_entries == "precompute":
            logger.info("graphchunk: blend_entries 'precompute' (graphchunk-precompute's offline engine): every blend "
                        "request runs as vLLM's full prefill and its last chunk's KV, computed behind the system "
                        "prompt and documents before it, is written to the tier as that chunk's blend entry")
        self._requests: dict[str, _Request] = {}
        self._jobs: list[MissJob] = []
        self._fills: list[ContextLoad] = []
        self._loads: list[ContextLoad] = []
        self._counts: list = []
        self._sent: list[RequestPlan] = []
        """Plans of this step's fills: held until its metadata is built (module docstring)."""
        self._done_before = 0
        """The workers' first unfinished job, as last reported."""
        self._for_later: list[ChunkRequest] = []
        """Requests run as full prefills this step, whose missing entries are planned after it."""
        self._capturing: dict[str, ChunkRequest] = {}
        """Full-prefilled blend requests whose missing entries are captured from their prefill
        (``blend_entries`` 'context') once a step completes their context."""
        self._recompute_tokens = 0
        """Blend recompute admitted into this step (``RecomputePolicy.cost``)."""
        self._room_for: str | None = None
        """The request waiting longest for pool room: until it is planned, no other plan takes room."""
        self.publish()

    @property
    def pool(self) -> ChunkPool:
        return self.planner.pool

    def matched(self, req_id: str, token_ids, extra_args: dict, num_computed: int) -> tuple[int | None, bool]:
        state = self._request(req_id, token_ids, extra_args)
        self._leave_room(req_id)  # taken again below while it still finds no room
        if num_computed >= state.context_len or state.prefilled:
            self._drop_plan(state)
            return 0, False
        if state.refused is not None:
            state.start = num_computed
            return state.context_len - num_computed, False
        if state.plan is None or state.start != num_computed:
            self._drop_plan(state)
            request = state.chunked
            mode = "isolated" if request.policy is None else "blend"
            if self.config.blend_entries == "precompute" and request.policy is not None and not state.filled:
                state.prefilled = True  # its last chunk's entry is captured behind what precedes it
                self._capturing[req_id] = request
                return 0, False
            if self.prefill_instead(request, num_computed, state.context_len):
                state.prefilled = True
                self.metrics.blend_full_prefills += 1
                if self._captures_from(state, num_computed):
                    self._capturing[req_id] = request
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
                plan = self.planner.plan(request.seg, request.salt, mode, num_computed, state.context_len)
            except PoolExhausted as exc:
                if self.pool.in_use:
                    logger.debug("graphchunk: request %s waits for pool room: %s", req_id, exc)
                    self._room_for = self._room_for or req_id
                    return None, False
                return self._never_fits(req_id, state, num_computed, str(exc))
            self._jobs += plan.jobs
            self._counts += plan.counts
            self._hold(state, plan)
            state.start = num_computed
        load_async = state.plan.needs >= self._done_before
        if load_async and state.chunked.policy is not None:
            return None, False  # blend: loaded synchronously once its jobs have run (module docstring)
        if not load_async and self._recompute_tokens and \
                self._recompute_tokens + state.recompute_cost > self.config.recompute_budget:
            self.metrics.blend_recompute_deferrals += 1
            return None, False  # this step's blend recompute is full: next step
        return state.context_len - num_computed, load_async

    def _never_fits(self, req_id: str, state: _Request, num_computed: int, why: str) -> tuple[int, bool]:
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

    def allocated(self, req_id: str, block_ids, num_external: int) -> None:
        state = self._requests.get(req_id)
        if state is None:
            return
        if state.refused is not None:
            if num_external:
                self._fills.append(ContextLoad(req_id, state.chunked, state.start, state.context_len, tuple(block_ids),
                                               (), refused=state.refused))
            return
        if state.plan is None:
            return
        if num_external == 0:
            if not state.waiting:  # vLLM took its tokens elsewhere (its own cache, another connector)
                self._drop_plan(state)
            return
        if num_external != state.context_len - state.start:
            raise RuntimeError(f"graphchunk: vLLM loads {num_external} tokens of request {req_id}'s context, "
                               f"not the {state.context_len - state.start} graphchunk planned")
        plan = state.plan
        load = ContextLoad(req_id, state.chunked, state.start, state.context_len, tuple(block_ids),
                           tuple(plan.units), plan.needs)
        state.filled = True
        if plan.needs < self._done_before:
            self._fills.append(load)
            self._recompute_tokens += state.recompute_cost
            self._sent.append(state.plan)  # released once the step's metadata is built, not before
            self._hold(state, None)
        else:
            self._loads.append(load)
            state.waiting = True

    def metadata(self, so) -> StepWork:
        """The step's work; ``so``, its scheduler output (which requests complete their context in it)."""
        captures = self._captures(so) if self._capturing else ()
        self.publish()
        work = StepWork(tuple(self._jobs), tuple(self._fills), tuple(self._loads), tuple(self._counts), captures,
                        self._segmented(so.scheduled_new_reqs))
        self._jobs, self._fills, self._loads, self._counts = [], [], [], []
        self._recompute_tokens = 0
        for plan in self._sent:
            self.planner.release(plan)
        self._sent = []
        for request in self._for_later:  # jobs of the next step: they run after this step's prefill
            self._compute_for_later(request)
        self._for_later = []
        return work

    def _segmented(self, new_reqs) -> tuple[tuple[str, ChunkRequest], ...]:
        """(id, request) of the new requests that run segmented (``_request`` read them once)."""
        found = []
        for new_req in new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is not None and state.chunked is not None:
                found.append((new_req.req_id, state.chunked))
        return tuple(found)

    def _captures_from(self, state: _Request, start: int) -> bool:
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

    def _leave_room(self, req_id: str) -> None:
        if self._room_for == req_id:
            self._room_for = None

    def prefill_instead(self, request: ChunkRequest, start: int, end: int) -> bool:
        """Whether a blend request's context ``[start, end)`` runs as vLLM's full prefill
        (``blend_misses``): its missing entries and its recompute cost at least the range itself.
        Only for policies that rank the context (cacheblend, question at a ratio strictly between
        0 and 1): vLLM's prefix cache never shares their KV between requests (their salt carries a
        nonce: ``frontend.blend_salt``), so no blended request is handed this exact KV as blend
        KV. (Recomputing every token blends exactly: that path stays the exactness suite's.)"""
        policy = request.policy
        if policy is None or not policy.needs_check or self.config.blend_misses != "prefill" or \
                self.config.store_path:
            return False
        missing = self.planner.missing_tokens(request.seg, request.salt, "blend", start, end)
        return missing > 0 and missing + self._recompute_cost(request) >= end - start

    def _captures(self, so) -> tuple[EntryCapture, ...]:
        """Captures of the full-prefilled requests whose context this step completes (their counts
        join the step's)."""
        computed, captures = computed_before(so), []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            request = self._capturing.get(req_id)
            if request is None or computed[req_id] + num_tokens < request.seg.layout.context_len:
                continue
            del self._capturing[req_id]
            if self._room_for is not None:  # a request waits for pool room: it gets it first
                continue
            plan = self.planner.capture(request.seg, request.salt, req_id,
                                        last_only=self.config.blend_entries == "precompute")
            captures += plan.captures
            self._counts += plan.counts
            self.planner.release(plan)
        return tuple(captures)

    def _compute_for_later(self, request: ChunkRequest) -> None:
        """Jobs for the entries a full-prefilled blend request lacked, its lookups counted; nothing
        is copied from them for it. None while a request waits for pool room."""
        if self._room_for is not None:
            return
        try:
            plan = self.planner.plan(request.seg, request.salt, "blend", 0, request.seg.layout.context_len)
        except PoolExhausted as exc:
            logger.debug("graphchunk: no pool room to keep a full-prefilled request's chunks: %s", exc)
            return
        self._jobs += plan.jobs
        self._counts += [count for count in plan.counts if count[0] not in ("tokens_reused", "reused")]
        self.planner.release(plan)

    def publish(self) -> None:
        """Publishes the pool's metrics (``POOL_FIELDS``) for /metrics and ``GraphChunkLLM.stats``:
        once a step (``metadata``), and when the last request leaves (``_publish_if_idle``: an idle
        engine builds no metadata). Costs the fields' count: every one is kept as it changes."""
        if self.publisher is not None:
            self.publisher.publish(self.metrics)

    def _publish_if_idle(self) -> None:
        """Publishes when no request is left: vLLM schedules no step for an idle engine, so what
        the last report or the last request's end changed would otherwise never reach /metrics.
        While requests remain, the next step's metadata publishes it."""
        if not self._requests:
            self.publish()

    def reported(self, done_before: int, failed=()) -> None:
        """The workers' first unfinished job, and the epochs of entries they found bad."""
        self._done_before = max(self._done_before, done_before)
        self.planner.finish_jobs(self._done_before)
        self.planner.fail_entries(failed)
        self._publish_if_idle()

    def loaded(self, req_id: str) -> None:
        """The workers filled the request's context (its asynchronous load is complete)."""
        state = self._requests.get(req_id)
        if state is not None and state.waiting:
            self._drop_plan(state)

    def refill(self, req_id: str) -> bool:
        """Whether a request whose context read KV that failed its check goes back to vLLM's queue
        (``fill_retry.py``), to be planned afresh when vLLM schedules it next (the bad entries
        have left the index by then: ``reported`` comes with the same output). Not a refused
        request: vLLM fails it. Past ``MAX_FILL_RETRIES`` its next plan is refused."""
        state = self._requests.get(req_id)
        if state is None:
            return True
        if state.refused is not None:
            return False
        state.retries += 1
        self.metrics.fills_retried += 1
        if state.retries > MAX_FILL_RETRIES:
            state.refused = (f"graphchunk: request {req_id}'s context read pool entries that failed their check "
                             f"{state.retries} times; it fails instead of being planned again (the server log names "
                             f"the entries; this is a graphchunk bug, please report it)")
        return True

    def finished(self, req_id: str) -> None:
        self._capturing.pop(req_id, None)
        self._leave_room(req_id)
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._drop_plan(state)
            self.metrics.requests_failed += state.refused is not None
        self._publish_if_idle()

    def reset(self) -> int:
        return self.pool.clear()

    def take_events(self) -> list:
        return self.events.take()

    def _request(self, req_id: str, token_ids, extra_args: dict) -> _Request:
        state = self._requests.get(req_id)
        if state is None:
            chunked = chunk_request(token_ids, extra_args, self.config)
            if chunked is not None and not self.handshake.runs(chunked):
                chunked = None
            context_len = chunked.seg.layout.context_len if chunked is not None else 0
            state = self._requests[req_id] = _Request(chunked, context_len if context_len < len(token_ids) else 0,
                                                      self._recompute_cost(chunked) if chunked is not None else 0)
        return state

    @staticmethod
    def _recompute_cost(request: ChunkRequest) -> int:
        policy, lay = request.policy, request.seg.layout
        return policy.cost(lay.chunk_lens, lay.question_len) if policy is not None else 0

    def _drop_plan(self, state: _Request) -> None:
        if state.plan is not None:
            self.planner.release(state.plan)
        self._hold(state, None)
        state.waiting = False

    def _hold(self, state: _Request, plan: RequestPlan | None) -> None:
        """Sets the request's plan, keeping the gauge of blend requests holding one (no walk)."""
        if state.chunked is not None and state.chunked.policy is not None:
            self.metrics.blend_requests_pending += (plan is not None) - (state.plan is not None)
        state.plan = plan
