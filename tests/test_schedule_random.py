"""Randomized scheduling: graphchunk's connector under vLLM's own scheduler, its workers played by
graphchunk's own worker engine over a content-tracking fake device, two tensor-parallel ranks
(``schedule_harness.py``).

Each seed draws a stream of requests (sys prompts and documents shared between requests, both
modes, tenants, several arrivals per step) into a chunk pool that holds about two contexts and a
KV cache small enough that vLLM preempts; requests are aborted at random in any state (waiting,
waiting for misses, loaded, running, between a step and its output), a pool entry is made bad at
random (3 % of steps, as a lifetime bug would leave it), and the workers' reports of finished jobs
and loads arrive late at random. After every step:

- every context a worker filled holds exactly its semantics' KV in every slot, including what
  vLLM's prefix cache supplied (the fake device records, per slot, which tokens at which position
  made it): a fill that read a block some job overwrote before it, or a prefix-cache block of
  another layout, fails here;
- vLLM never computes a segmented request's context itself; a copy fails its epoch check only
  where it reads a bad entry (the invalid blocks are exactly those of such fills and of requests
  refused because they never fit the pool);
- the pool's accounting holds (``ChunkPool.check_invariants``).

At the end every request has finished (scheduled or refused, none waits forever), vLLM's own
accounting is back where it started (free KV blocks, no request held, no load waited for:
``schedule_harness.accounting``), no token computed by a forward that read context KV that was
not its request's semantics' was delivered, no request failed that graphchunk did not refuse
(a request whose fill failed its check is planned again), no reference is held and no block
leaked, and the stream evicted, hit and missed. Half as many seeds again run under vLLM's asynchronous
scheduling (``AsyncScheduler``: the next step is scheduled before the workers' output of the last
one arrives). A failing seed is in the test id: ``pytest tests/test_schedule_random.py -k
'seed17'`` replays it; ``GRAPHCHUNK_SCHEDULE_SEEDS=200`` runs more.
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from graphchunk.engine.request_args import chunk_request
from graphchunk.metrics import EXPORTED, POOL_FIELDS, WORKER_FIELDS
from schedule_harness import BLOCK, STEPS, Stream, Steps, Workers, accounting, check_blocks

SEEDS = int(os.environ.get("GRAPHCHUNK_SCHEDULE_SEEDS", 24))
PREFIX = "Here is a document.\n\n"
"""blend_prefix of every third seed."""
HOST_BYTES = 40 * BLOCK * 8
"""host_bytes of every third seed (another third than PREFIX's): a host-memory level alone, holding
about 40 blocks' tokens of the fake device's payloads (a slot named in 8 bytes), more than the pool's
24 and fewer than the stream's entries: pool misses it serves in one copy, and entries it drops."""


STREAMS = [pytest.param(s, False, id=f"seed{s}") for s in range(SEEDS)] + \
    [pytest.param(s, True, id=f"async-seed{s}") for s in range(SEEDS // 2)]


ABORT_STATES = ("waiting", "loading", "running", "preempted", "in_flight")
"""Where a request is when the client goes away: waiting (never scheduled, or back in the queue),
waiting for its misses (vLLM's WAITING_FOR_REMOTE_KVS), running, preempted, and scheduled in a step
the workers have executed whose output vLLM has not processed yet (where vLLM's engine core
processes aborts)."""


def abort_candidates(scheduler) -> dict[str, list[str]]:
    """The live requests by state (``ABORT_STATES`` but ``in_flight``)."""
    from vllm.v1.request import RequestStatus

    states = {RequestStatus.WAITING: "waiting", RequestStatus.WAITING_FOR_REMOTE_KVS: "loading",
              RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted"}
    found = {state: [] for state in ABORT_STATES}
    for request in scheduler.requests.values():
        if not request.is_finished() and request.status in states:
            found[states[request.status]].append(request.request_id)
    return found


def run_stream(vllm_scheduler, seed: int, asynchronous: bool) -> dict[str, int]:
    """One random stream (module docstring), its checks made; returns how many aborts landed in
    each state (``ABORT_STATES``)."""
    from vllm.v1.engine import FinishReason

    rng = random.Random(seed)
    # Blend requests whose misses cost more than their prefill: vLLM's full prefill on odd seeds
    # (their entries computed alone for later requests, or taken from that prefill on seeds 1 mod 4),
    # blended on even ones; every third seed computes blend chunks after a fixed prefix, and another
    # third keeps entries in a host-memory tier level (no directory) below the pool.
    scheduler, handshake, hasher = vllm_scheduler(asynchronous, blend_misses="prefill" if seed % 2 else "blend",
                                                  blend_entries="context" if seed % 4 == 1 else "alone",
                                                  blend_prefix=PREFIX if seed % 3 == 2 else "",
                                                  host_bytes=HOST_BYTES if seed % 3 == 0 else 0)
    config = scheduler.connector._config
    context = scheduler.connector._context()
    pool = context.pool
    workers, stream = Workers(config, handshake, rng), Stream(rng, config, hasher)
    steps = Steps(scheduler, workers, asynchronous)
    idle = accounting(scheduler)
    added = []
    aborts = dict.fromkeys(ABORT_STATES, 0)

    def abort(req_id: str, state: str) -> None:
        steps.abort(req_id)
        aborts[state] += 1
        # What the request held is given back, or still accounted for, at once: vLLM's blocks, and
        # graphchunk's plans (only for requests vLLM still holds) and pool references.
        check_blocks(scheduler)
        assert set(context._requests) <= set(scheduler.requests), "a plan outlived its request"
        pool.check_invariants()

    def abort_in_flight(so) -> None:
        live = [r for r in so.num_scheduled_tokens if not scheduler.requests[r].is_finished()]
        if live and rng.random() < 0.04:
            abort(rng.choice(live), "in_flight")

    for step in range(STEPS * 3):
        if step < STEPS:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
                request = stream.request()
                added.append(request.request_id)
                scheduler.add_request(request)
            if rng.random() < 0.03:  # a bad entry, as a lifetime bug would leave
                workers.inject(pool)
        states = [(state, ids) for state, ids in abort_candidates(scheduler).items() if ids]
        if states and rng.random() < 0.08:  # a state drawn first: rare states are reached too
            state, ids = rng.choice(states)
            abort(rng.choice(ids), state)
        steps.step(between=abort_in_flight)
        pool.check_invariants()
        if context.planner.host is not None:
            context.planner.host.check_invariants()
        check_blocks(scheduler)
        if step >= STEPS and not scheduler.has_unfinished_requests():
            break
    steps.flush()
    assert not scheduler.has_unfinished_requests(), f"seed {seed}: requests never scheduled nor refused: " \
        f"{[(r.request_id, r.status) for r in scheduler.requests.values()]}"
    workers.settle()  # the workers' late reports (jobs run, loads done) arrive with the next steps
    steps.step()  # the last finished ids reach the workers
    steps.step()
    steps.flush()
    assert accounting(scheduler) == idle, "vLLM's KV blocks or requests were not all given back"
    assert not steps.served_wrong(), "a token computed over context KV that no fill checked was delivered"
    errors = [r for r, reason in steps.finished.items() if reason == FinishReason.ERROR]
    assert len(errors) == context.metrics.requests_failed, f"requests failed that graphchunk did not refuse: {errors}"
    assert (pool.metrics.pool_refs_held, pool.metrics.pool_blocks_leaked) == (0, 0)
    assert all(not engine.loads and not engine.runner.pending_tokens for engine in workers.engines)
    metrics = workers.engines[0].metrics
    assert metrics.hits and metrics.misses and len(added) > 20
    if config.host_bytes:  # pool misses served from host memory, alike on both ranks, within its budget
        assert metrics.tier_hits and metrics.tier_host_hits == metrics.tier_loads, seed
        assert len({(e.metrics.tier_loads, e.metrics.tier_host_bytes) for e in workers.engines}) == 1
        assert 0 < metrics.tier_host_bytes <= config.host_bytes
        # What the scheduler's index holds ready, every worker holds; a worker holds nothing the index
        # has not reserved, or dropped since its last step; nothing is held once traffic stops.
        host = context.planner.host
        ready = {epoch for epoch, entry in host._live.items() if entry.ready}
        for engine in workers.engines:
            held = set(engine.runner.host._payloads)
            assert ready <= held <= set(host._live) | set(host._drops), seed
        assert all(not entry.ref_count for entry in host._live.values())
    else:
        assert not metrics.tier_loads
    # What /metrics would show, as vLLM's scheduler stats carried it: every counter's increments sum to
    # its value (the pool's from the scheduler, the rest from rank 0's worker, counted once), every
    # gauge its last value.
    now = {**{name: getattr(metrics, name) for name in WORKER_FIELDS},
           **{name: getattr(context.metrics, name) for name in POOL_FIELDS}}
    reported = {**steps.reported.data.get("counters", {}), **steps.reported.data.get("gauges", {})}
    assert {name: reported.get(name, 0) for name in EXPORTED} == {name: now[name] for name in EXPORTED}
    return aborts


@pytest.mark.parametrize("seed, asynchronous", STREAMS)
def test_random_request_streams_fill_exactly_what_they_planned(vllm_scheduler, seed, asynchronous):
    aborts = run_stream(vllm_scheduler, seed, asynchronous)
    print(f"{'async' if asynchronous else 'sync'} seed {seed}: aborts by state {aborts}")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_aborts_land_in_every_state(vllm_scheduler, asynchronous):
    """Issue 63, point 4: across the first four seeds of each scheduling mode, requests are aborted
    in each of the five states (``ABORT_STATES``); the per-seed counts are printed (``-s``)."""
    counts = {seed: run_stream(vllm_scheduler, seed, asynchronous) for seed in range(4)}
    for seed, aborts in counts.items():
        print(f"{'async' if asynchronous else 'sync'} seed {seed}: aborts by state {aborts}")
    missing = [state for state in ABORT_STATES if not sum(aborts[state] for aborts in counts.values())]
    assert not missing, f"no abort landed in {missing}: {counts}"


def test_the_streams_exercise_pressure(vllm_scheduler):
    """Across a few seeds the pool evicts, vLLM preempts, runs blend requests as full prefills (the
    default blend_misses), takes entries from them (blend_entries 'context', the last seed) and
    blends question-aware ones: the random test covers all five."""
    evictions = preemptions = prefills = scored = captured = 0
    for seed in range(3):
        rng = random.Random(seed)
        scheduler, handshake, hasher = vllm_scheduler(blend_entries="context" if seed == 2 else "alone")
        # Captures come from salted requests only (one tenant's entries): the capturing seed salts most.
        salts = ("tenant-a", "tenant-b", None) if seed == 2 else (None, None, "tenant-b")
        workers = Workers(scheduler.connector._config, handshake, rng)
        stream = Stream(rng, scheduler.connector._config, hasher, salts)
        for step in range(STEPS):
            for _ in range(rng.choice([0, 1, 2, 4])):
                scheduler.add_request(stream.request())
            so = scheduler.schedule()
            preemptions += len(so.preempted_req_ids or ())
            scheduler.update_from_output(so, workers.step(so, scheduler))
        evictions += scheduler.connector._context().pool.metrics.evictions
        prefills += scheduler.connector._context().metrics.blend_full_prefills
        scored += workers.engines[0].metrics.blend_tokens_scored
        captured += workers.engines[0].metrics.blend_entries_captured
    assert evictions and preemptions and prefills and scored and captured, \
        (evictions, preemptions, prefills, scored, captured)


def test_the_content_check_sees_a_wrong_fill(vllm_scheduler):
    """The check above can fail: a fill that copies another chunk's KV is caught."""
    rng = random.Random(0)
    scheduler, handshake, hasher = vllm_scheduler()
    workers = Workers(scheduler.connector._config, handshake, rng)
    stream = Stream(rng, scheduler.connector._config, hasher)
    request = stream.request()
    engine = workers.engines[0]
    chunked = chunk_request(request.prompt_token_ids, request.sampling_params.extra_args, scheduler.connector._config)
    load = SimpleNamespace(request=chunked, block_ids=list(range(8)), req_id=request.request_id)
    with pytest.raises(AssertionError, match="context token 0 holds None"):
        workers.check_fills(engine, [load])
