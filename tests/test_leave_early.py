"""Requests that do not end normally, under vLLM's own scheduler with graphchunk's connector and two
worker ranks of graphchunk's engine over the content-tracking fake device (``schedule_harness``):
each finding of issue 45 as a scenario that failed before its fix.

- aborted while waiting for their misses: vLLM's blocks and requests all come back;
- a fill that fails its check under asynchronous scheduling, its request gone before the report:
  no later request is served the unfilled blocks from vLLM's prefix cache;
- a bad entry fails the requests planned before the workers report it, then leaves the index;
  a bad system prompt entry too, when only chunk jobs read it (issue 63);
- a request whose context needs most of the pool is planned under a steady stream of smaller
  requests with misses, not starved;
- a blend request that was blended, preempted and resumed as a full prefill captures no entry
  from its (blended) KV.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

from schedule_harness import Stream, Steps, Workers, accounting

SYS = list(range(1000, 1020))


def docs(first: int, count: int, length: int) -> list[list[int]]:
    return [list(range(first + 500 * k, first + 500 * k + length)) for k in range(count)]


def setup(vllm_scheduler, asynchronous=False, seed=0, **gc):
    scheduler, handshake, hasher = vllm_scheduler(asynchronous, **gc)
    rng = random.Random(seed)
    config = scheduler.connector._config
    workers = Workers(config, handshake, rng)
    workers.settle()  # reports come with their step: each scenario sets its own order
    return scheduler, workers, Stream(rng, config, hasher), Steps(scheduler, workers, asynchronous)


def run(steps, until, limit: int = 60) -> int:
    """Steps until ``until()`` holds; returns how many it took (fails past ``limit``)."""
    for n in range(limit):
        if until():
            return n
        steps.step()
    raise AssertionError(f"not reached in {limit} steps")


def test_aborts_while_waiting_for_misses_give_vllm_its_blocks_back(vllm_scheduler):
    """Three isolated requests of new documents wait for their misses (WAITING_FOR_REMOTE_KVS,
    blocks allocated) and are aborted there: vLLM's free blocks return to the idle count, it
    forgets the requests, and a prompt needing most of the KV cache then runs (before the fix the
    blocks stayed allocated for good and that prompt waited for ever)."""
    from vllm.v1.request import RequestStatus

    scheduler, workers, stream, steps = setup(vllm_scheduler, miss_budget=8)
    idle = accounting(scheduler)
    requests = [stream.make(SYS, docs(20000 + 5000 * i, 2, 40), [40000, 40001]) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run(steps, lambda: all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests))
    assert accounting(scheduler)[0] < idle[0] - 15
    for request in requests:
        steps.abort(request.request_id)
    run(steps, lambda: accounting(scheduler) == idle, limit=4)
    big = stream.ordinary(40 * 16 - 8)  # 40 of vLLM's 48 blocks
    scheduler.add_request(big)
    run(steps, lambda: steps.finished.get(big.request_id) is not None, limit=20)
    assert accounting(scheduler) == idle


def test_a_failed_fill_leaves_no_prefix_hit_behind(vllm_scheduler):
    """Asynchronous scheduling: an all-hit request's fill fails its check (its entries made bad)
    and the request is aborted before the workers' report reaches the scheduler, so vLLM fails
    nothing and evicts nothing itself, though it hashed the blocks when it allocated them. The same
    prompt sent again must not take a prefix hit on the blocks never filled: it is planned and
    filled afresh (before the fix it read them)."""
    scheduler, workers, stream, steps = setup(vllm_scheduler, asynchronous=True)
    pool = scheduler.connector._context().pool
    idle = accounting(scheduler)
    documents = docs(20000, 2, 40)
    first = stream.make(SYS, documents, [40000])
    scheduler.add_request(first)
    run(steps, lambda: first.request_id in steps.finished)
    for entry in list(pool._index.values()):  # every entry of that context: the fill must fail
        workers.inject_entry(entry)
    again = stream.make(SYS, documents[::-1], [40000])  # past the sys prompt, no prefix hit: filled
    scheduler.add_request(again)
    steps.step()  # scheduled and filled (the fill fails); its output waits behind the next step
    assert again.request_id in workers.failed_fills
    steps.abort(again.request_id)
    steps.step()
    steps.flush()
    third = stream.make(SYS, documents[::-1], [40000])
    scheduler.add_request(third)
    run(steps, lambda: third.request_id in steps.finished)
    assert third.request_id not in workers.bad_reads, "it read context blocks no fill filled"
    assert not steps.served_wrong()
    steps.flush()
    run(steps, lambda: accounting(scheduler) == idle, limit=4)


def test_a_failed_asynchronous_load_fails_its_request_and_gives_its_blocks_back(vllm_scheduler):
    """An isolated request's misses are computed over a bad sys prompt entry: its jobs' entries are
    poisoned, its asynchronous load fails its check, and vLLM fails the request; it must still be
    reported loaded, else vLLM keeps its blocks for good."""
    from vllm.v1.engine import FinishReason

    scheduler, workers, stream, steps = setup(vllm_scheduler)
    pool = scheduler.connector._context().pool
    idle = accounting(scheduler)
    warm = stream.make(SYS, docs(20000, 1, 40), [40000])
    scheduler.add_request(warm)
    run(steps, lambda: warm.request_id in steps.finished)
    workers.inject_entry(next(e for e in pool._index.values() if tuple(e.tokens) == tuple(SYS)))
    request = stream.make(SYS, docs(26000, 2, 40), [40000])
    scheduler.add_request(request)
    run(steps, lambda: request.request_id in steps.finished)
    assert steps.finished[request.request_id] == FinishReason.ERROR and request.request_id in workers.failed_fills
    run(steps, lambda: accounting(scheduler) == idle, limit=4)
    assert not steps.served_wrong()


def test_a_bad_entry_fails_the_requests_planned_before_its_report_then_leaves_the_index(vllm_scheduler):
    """A document's entry made bad: the next request copying it fails, the workers report the entry
    and it leaves the pool's index (``entries_failed``); the requests after it compute the document
    again and complete (before the fix every request carrying the document failed until the entry
    was evicted)."""
    from vllm.v1.engine import FinishReason

    scheduler, workers, stream, steps = setup(vllm_scheduler)
    context = scheduler.connector._context()
    documents = docs(20000, 3, 40)
    warm = stream.make(SYS, documents, [40000])
    scheduler.add_request(warm)
    run(steps, lambda: warm.request_id in steps.finished)
    bad = next(e for e in context.pool._index.values() if tuple(e.tokens[len(SYS):]) == tuple(documents[0]))
    workers.inject_entry(bad)
    later = []
    for order in ((0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1)):  # each its own prefix: vLLM's cache shares the sys prompt
        request = stream.make(SYS, [documents[i] for i in order], [40010])
        later.append(request.request_id)
        scheduler.add_request(request)
        steps.step()
    run(steps, lambda: all(r in steps.finished for r in later))
    errors = [r for r in later if steps.finished[r] == FinishReason.ERROR]
    assert errors == later[:1], f"failed: {errors}"
    assert context.metrics.entries_failed == 1
    assert not steps.served_wrong()


def test_a_bad_system_prompt_entry_that_chunk_jobs_read_leaves_the_index(vllm_scheduler):
    """Issue 63, point 2: a system prompt of whole blocks (32 tokens) is served by vLLM's prefix
    cache, so no request copies it and no copy checks it; only the chunk jobs of new documents read
    its entry. Made bad, it poisons those jobs, and the workers report the entry they read as well
    as the jobs' own: it leaves the pool's index and the requests after compute it again and
    complete (before, only the jobs' entries were reported: every later request with a new document
    failed and the system prompt's entry stayed indexed)."""
    from vllm.v1.engine import FinishReason

    whole = list(range(1000, 1032))
    scheduler, workers, stream, steps = setup(vllm_scheduler)
    context = scheduler.connector._context()
    warm = stream.make(whole, docs(20000, 1, 40), [40000])
    scheduler.add_request(warm)
    run(steps, lambda: warm.request_id in steps.finished)
    bad = next(e for e in context.pool._index.values() if tuple(e.tokens) == tuple(whole))
    workers.inject_entry(bad)
    later = []
    for k in range(4):  # each with a document no request had: its chunk job reads the system prompt's entry
        request = stream.make(whole, docs(30000 + 3000 * k, 1, 40), [40000])
        later.append(request.request_id)
        scheduler.add_request(request)
        run(steps, lambda: request.request_id in steps.finished)
    errors = [r for r in later if steps.finished[r] == FinishReason.ERROR]
    assert errors == later[:1], f"failed: {errors}"
    assert all(entry.epoch != bad.epoch for entry in context.pool._index.values())
    assert not steps.served_wrong()


def test_a_large_context_is_planned_under_a_stream_of_small_misses(vllm_scheduler):
    """A request whose context needs 20 of the pool's 24 blocks arrives while small requests with a
    new document each keep coming, two a step, faster than their misses are computed: it is planned
    and completes within 30 steps (the pool's room is reserved for it; before, the small requests
    behind it took each freed block and it waited for as long as they kept coming: 80 steps and
    more)."""
    scheduler, workers, stream, steps = setup(vllm_scheduler, miss_budget=16)
    small = iter(range(1000))

    def arrive():
        for _ in range(2):
            k = next(small)
            scheduler.add_request(stream.make(SYS, [list(range(30000 + 100 * k, 30000 + 100 * k + 20))], [40000]))

    for _ in range(8):
        arrive()
        steps.step()
    large = stream.make(SYS, docs(20000, 3, 80), [40000, 40001])
    scheduler.add_request(large)
    for n in range(30):
        arrive()
        steps.step()
        if large.request_id in steps.finished:
            break
    assert large.request_id in steps.finished, "the large context was never planned"
    assert not steps.served_wrong()


def test_no_entry_is_captured_from_a_request_that_was_blended(vllm_scheduler):
    """blend_entries 'context': a question-aware blend request is filled (blended), then preempted
    with its entries evicted, and resumes as vLLM's full prefill (its misses now cost more than
    that): its own blocks hold blended KV, so nothing is captured from it; a request never blended
    that runs as a full prefill is captured, where it carries a cache_salt (one tenant's entries)."""
    scheduler, workers, stream, steps = setup(vllm_scheduler, blend_misses="prefill", blend_entries="context")
    context = scheduler.connector._context()
    mode = {"graphchunk_mode": "blend", "graphchunk_recompute": "question", "graphchunk_recompute_ratio": 0.3}
    documents = docs(20000, 2, 40)
    warm = stream.make(SYS, documents, [40000], mode, salt="tenant-a")
    scheduler.add_request(warm)
    run(steps, lambda: warm.request_id in steps.finished)
    request = stream.make(SYS, documents, [40001, 40002], mode, salt="tenant-a")
    args = request.sampling_params.extra_args
    assert context.matched(request.request_id, request.prompt_token_ids, args, 0)[0] > 0  # all hits
    context.allocated(request.request_id, list(range(8)), context._requests[request.request_id].context_len)
    context.metadata(NO_STEP)  # its fill is sent: its blocks hold blended KV from now on
    context.reset()  # its entries evicted while it is preempted
    assert context.matched(request.request_id, request.prompt_token_ids, args, 0) == (0, False)  # full prefill
    assert request.request_id not in context._capturing
    fresh = stream.make(SYS, docs(26000, 2, 40), [40003], mode, salt="tenant-a")
    assert context.matched(fresh.request_id, fresh.prompt_token_ids, fresh.sampling_params.extra_args, 0) == (0, False)
    assert fresh.request_id in context._capturing


NO_STEP = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
"""Scheduler output of a step that schedules nothing (the connector driven directly)."""
