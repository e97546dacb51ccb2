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
              Whether and how it is planned (the pool's room, the step's blend recompute budget, a
              full prefill instead, a context that never fits) is ``admission.py``'s.
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

Host memory (``host_bytes``) keeps the same rule for its payloads: *no payload is dropped while a
copy or job planned from it is outstanding.* Plans and jobs hold host entries as they hold pool
entries (``host_index.py``), only an entry nothing holds is dropped, and the drops travel with the
step's metadata (``StepWork.host_drops``), which the workers apply before anything of that step
runs: every copy planned earlier has run by then.

Preemption needs nothing more: a preempted request holds no plan (its fill ran), and when vLLM
schedules it again it is planned afresh from its new prefix hit. The workers check every copy
against the entry's epoch anyway (``context_run.py``): should this ever be wrong, the request
goes back to vLLM's queue and is planned again (``refill``), its blocks lose their prefix-cache
hashes (``connector.py``, ``_evict_invalid``) and the entry leaves the index.

A blend request the model cannot blend (``handshake.blend_refusal``, from the workers) and an
ordinary prompt load nothing: vLLM computes their full prefill itself.
"""
from __future__ import annotations

import dataclasses

from graphchunk.cache.chunk_cache import ScheduledPrompt
from graphchunk.cache.context_plan import ContextPlanner, EntryCapture, MissJob, RequestPlan, UnitCopy
from graphchunk.cache.host_index import HostIndex
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.pool import ChunkPool
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.admission import Admission, RequestState, recompute_cost
from graphchunk.engine.kv_events import PoolEvents
from graphchunk.engine.request_args import ChunkRequest, chunk_request
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
    host_tokens: int = 0
    """Tokens of KV the workers' host memory holds (``host_bytes``; 0: no host level)."""

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
    host_drops: tuple[int, ...] = ()
    """Host payloads to free (their epochs), before anything of the step runs (``HostIndex.take_drops``)."""


def computed_before(so) -> dict[str, int]:
    """Tokens each request of scheduler output ``so`` had computed before the step."""
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return computed


class ContextScheduler:
    def __init__(self, config: GraphChunkConfig, handshake: PoolHandshake, engine: int = 0):
        self.config, self.handshake = config, handshake
        self.metrics = CacheMetrics()
        pool = ChunkPool(handshake.num_blocks, handshake.block_size, handshake.first_block, self.metrics,
                         policy=config.eviction)
        host = HostIndex(handshake.host_tokens) if handshake.host_tokens else None
        self.planner = ContextPlanner(pool, handshake.space, host)
        self.events = PoolEvents(handshake.block_size)
        pool.listener = self.events
        path = engine_metrics_file(engine)
        self.publisher = MetricsPublisher(path, POOL_FIELDS) if path else None
        """Publishes the pool's metrics for the API process (``plugin.published_pool``) and ``GraphChunkLLM.stats()``."""
        self.report = StatsReport(self.metrics, POOL_FIELDS)
        """The pool's metrics for vLLM's stats (the connector's ``get_kv_connector_stats``)."""
        self.admission = Admission(config, self.planner, self.metrics)
        """Whether and how each request's context is planned (``admission.py``)."""
        self._requests: dict[str, RequestState] = {}
        self._jobs: list[MissJob] = []
        self._fills: list[ContextLoad] = []
        self._loads: list[ContextLoad] = []
        self._counts: list = []
        self._sent: list[RequestPlan] = []
        """Plans of this step's fills: held until its metadata is built (module docstring)."""
        self._done_before = 0
        """The workers' first unfinished job, as last reported."""
        self.publish()

    @property
    def pool(self) -> ChunkPool:
        return self.planner.pool

    def matched(self, req_id: str, token_ids, extra_args: dict, num_computed: int) -> tuple[int | None, bool]:
        state = self._request(req_id, token_ids, extra_args)
        self.admission.leave_room(req_id)  # taken again below while it still finds no room
        if num_computed >= state.context_len or state.prefilled:
            self._drop_plan(state)
            return 0, False
        if state.refused is not None:
            state.start = num_computed
            return state.context_len - num_computed, False
        if state.plan is None or state.start != num_computed:
            self._drop_plan(state)
            plan = self.admission.plan(req_id, state, num_computed)
            if not isinstance(plan, RequestPlan):
                return plan  # vLLM's answer without a plan: a full prefill, a wait for room, a refusal
            self._jobs += plan.jobs
            self._counts += plan.counts
            self._hold(state, plan)
            state.start = num_computed
        return self.admission.admit(state, num_computed, self._done_before)

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
            self.admission.count_fill(state)
            self._sent.append(state.plan)  # released once the step's metadata is built, not before
            self._hold(state, None)
        else:
            self._loads.append(load)
            state.waiting = True

    def metadata(self, so) -> StepWork:
        """The step's work; ``so``, its scheduler output (which requests complete their context in it)."""
        captures = self._captures(so) if self.admission.capturing else ()
        self.publish()
        work = StepWork(tuple(self._jobs), tuple(self._fills), tuple(self._loads), tuple(self._counts), captures,
                        self._segmented(so.scheduled_new_reqs), self.planner.take_host_drops())
        self._fills, self._loads = [], []
        for plan in self._sent:
            self.planner.release(plan)
        self._sent = []
        self._jobs, self._counts = self.admission.next_step()  # jobs of the next step: after this step's prefill
        return work

    def _captures(self, so) -> tuple[EntryCapture, ...]:
        """Captures of the full-prefilled requests whose context this step completes (their counts
        join the step's)."""
        captures, counts = self.admission.captures(so.num_scheduled_tokens, computed_before(so))
        self._counts += counts
        return captures

    def _segmented(self, new_reqs) -> tuple[tuple[str, ChunkRequest], ...]:
        """(id, request) of the new requests that run segmented (``_request`` read them once)."""
        found = []
        for new_req in new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is not None and state.chunked is not None:
                found.append((new_req.req_id, state.chunked))
        return tuple(found)

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
        self.admission.finished(req_id)
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._drop_plan(state)
            self.metrics.requests_failed += state.refused is not None
        self._publish_if_idle()

    def reset(self) -> int:
        """Drops the pool's unused entries (host memory keeps its own, as before the reset)."""
        return self.pool.clear()

    def take_events(self) -> list:
        return self.events.take()

    def _request(self, req_id: str, token_ids, extra_args: dict) -> RequestState:
        state = self._requests.get(req_id)
        if state is None:
            chunked = chunk_request(token_ids, extra_args, self.config)
            if chunked is not None and not self.handshake.runs(chunked):
                chunked = None
            context_len = chunked.seg.layout.context_len if chunked is not None else 0
            state = self._requests[req_id] = RequestState(chunked, context_len if context_len < len(token_ids) else 0,
                                                          recompute_cost(chunked) if chunked is not None else 0)
        return state

    def _drop_plan(self, state: RequestState) -> None:
        if state.plan is not None:
            self.planner.release(state.plan)
        self._hold(state, None)
        state.waiting = False

    def _hold(self, state: RequestState, plan: RequestPlan | None) -> None:
        """Sets the request's plan, keeping the gauge of blend requests holding one (no walk)."""
        if state.chunked is not None and state.chunked.policy is not None:
            self.metrics.blend_requests_pending += (plan is not None) - (state.plan is not None)
        state.plan = plan
