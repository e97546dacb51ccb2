"""Requests that do not end normally, under vLLM's own scheduler with graphchunk's connector and two
worker ranks of graphchunk's engine over the content-tracking fake device (``schedule_harness``):
each finding of issue 45 as a scenario that failed before its fix.

- aborted while waiting for their misses: vLLM's blocks and requests all come back;
- a fill that fails its check under asynchronous scheduling, its request gone before the report:
  no later request is served the unfilled blocks from vLLM's prefix cache;
- a request whose fill fails its check is planned again and answered, never failed (issue 63):
  its asynchronous load, its synchronous fill, a request that took a prefix hit on a failed
  fill's blocks, and one vLLM preempted between the step that read the bad KV and that step's
  output (no token of that step is delivered); past its retries it fails, its blocks given back;
- a bad entry leaves the index once reported; a bad system prompt entry too, when only chunk
  jobs read it (issue 63);
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


def poison_context(scheduler, workers, stream, steps, documents) -> None:
    """Runs a request of ``documents`` to its end, then makes every pool entry bad: a request of the
    same documents in another order is all hits, and its fill fails its check."""
    warm = stream.make(SYS, documents, [40000])
    scheduler.add_request(warm)
    run(steps, lambda: warm.request_id in steps.finished)
    for entry in list(scheduler.connector._context().pool._index.values()):
        workers.inject_entry(entry)


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
    idle = accounting(scheduler)
    documents = docs(20000, 2, 40)
    poison_context(scheduler, workers, stream, steps, documents)  # the fill below must fail
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


def test_a_failed_asynchronous_load_is_planned_again_and_answered(vllm_scheduler):
    """An isolated request's misses are computed over a bad sys prompt entry: its jobs' entries are
    poisoned and its asynchronous load fails its check. The request goes back to vLLM's queue and
    is planned again without the bad entries: it completes, and vLLM gets every block back (before,
    vLLM failed it)."""
    from vllm.v1.engine import FinishReason

    scheduler, workers, stream, steps = setup(vllm_scheduler)
    context = scheduler.connector._context()
    idle = accounting(scheduler)
    warm = stream.make(SYS, docs(20000, 1, 40), [40000])
    scheduler.add_request(warm)
    run(steps, lambda: warm.request_id in steps.finished)
    workers.inject_entry(next(e for e in context.pool._index.values() if tuple(e.tokens) == tuple(SYS)))
    request = stream.make(SYS, docs(26000, 2, 40), [40000])
    scheduler.add_request(request)
    run(steps, lambda: request.request_id in steps.finished)
    assert request.request_id in workers.failed_fills
    assert steps.finished[request.request_id] == FinishReason.LENGTH
    assert (context.metrics.fills_retried, context.metrics.requests_failed) == (1, 0)
    run(steps, lambda: accounting(scheduler) == idle, limit=4)
    assert not steps.served_wrong()


def test_a_failed_fill_is_planned_again_with_the_request_that_shares_its_blocks(vllm_scheduler):
    """Two identical all-hit requests arrive in one step; the entries they copy are bad. The first
    is filled (the fill fails its check: it left its blocks unfilled, though vLLM hashed them when it
    allocated them), the second takes vLLM's prefix hit on those blocks. Both go back to vLLM's
    queue, are planned again and answered; neither is delivered a token computed over the bad
    blocks (before, vLLM failed both)."""
    from vllm.v1.engine import FinishReason

    scheduler, workers, stream, steps = setup(vllm_scheduler)
    context = scheduler.connector._context()
    idle = accounting(scheduler)
    documents = docs(20000, 2, 40)
    poison_context(scheduler, workers, stream, steps, documents)
    twins = [stream.make(SYS, documents[::-1], [40000, 40001]) for _ in range(2)]
    for request in twins:
        scheduler.add_request(request)
    run(steps, lambda: all(r.request_id in steps.finished for r in twins))
    assert [steps.finished[r.request_id] for r in twins] == [FinishReason.LENGTH] * 2
    assert twins[0].request_id in workers.failed_fills and twins[1].request_id in workers.bad_reads
    assert context.metrics.fills_retried == 2
    assert not steps.served_wrong()
    run(steps, lambda: accounting(scheduler) == idle, limit=4)


def test_a_request_preempted_after_its_fill_failed_is_delivered_nothing_computed_over_it(vllm_scheduler):
    """Issue 63, point 1, under asynchronous scheduling (step N+1 is scheduled before step N's output
    arrives): an all-hit request's fill fails its check in step N, and vLLM preempts it in step N+1
    (the KV cache is full and it is the newest running request). When step N's output arrives it is
    no longer running: the token its forward computed over the unfilled blocks must not be
    delivered, and it is planned again and answered (before, vLLM delivered that token and the
    request went on to finish 'length' on it)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    scheduler, workers, stream, steps = setup(vllm_scheduler, asynchronous=True)
    context = scheduler.connector._context()
    idle = accounting(scheduler)
    documents = docs(20000, 2, 40)
    poison_context(scheduler, workers, stream, steps, documents)
    request = stream.make(SYS, documents[::-1], list(range(40000, 40012)))  # 112 tokens: 7 whole blocks
    blocks_needed = 7
    big = stream.ordinary((idle[0] - blocks_needed) * 16 - 12, max_tokens=12)  # leaves exactly those 7 free
    scheduler.add_request(big)
    # Its prompt computed, and vLLM's deferred frees (the warm request's blocks) back in its pool.
    run(steps, lambda: big.num_computed_tokens >= big.num_prompt_tokens and not scheduler.deferred_frees)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == blocks_needed
    scheduler.add_request(request)
    step = steps.step()  # its fill fails; its output waits behind the next step
    assert request.request_id in step.num_scheduled_tokens and request.request_id in workers.failed_fills
    steps.step()  # its next token needs an eighth block: none is free
    assert request.status == RequestStatus.PREEMPTED and request.num_preemptions == 1
    run(steps, lambda: request.request_id in steps.finished and big.request_id in steps.finished)
    assert steps.finished[request.request_id] == FinishReason.LENGTH
    assert any(r == request.request_id for _, r in workers.bad_steps)
    assert not steps.served_wrong(), "a token computed over the failed fill was delivered"
    assert context.metrics.fills_retried == 1
    steps.flush()
    run(steps, lambda: accounting(scheduler) == idle, limit=4)


def test_a_request_past_its_retries_fails_and_gives_its_blocks_back(vllm_scheduler, monkeypatch):
    """With no retry left, a request whose fill failed its check is refused when planned again: vLLM
    fails it (``requests_failed``), nothing computed over the bad KV is delivered, and every block
    comes back."""
    from vllm.v1.engine import FinishReason

    from graphchunk.engine import context_scheduler

    monkeypatch.setattr(context_scheduler, "MAX_FILL_RETRIES", 0)
    scheduler, workers, stream, steps = setup(vllm_scheduler)
    context = scheduler.connector._context()
    idle = accounting(scheduler)
    documents = docs(20000, 2, 40)
    poison_context(scheduler, workers, stream, steps, documents)
    request = stream.make(SYS, documents[::-1], [40000])
    scheduler.add_request(request)
    run(steps, lambda: request.request_id in steps.finished)
    assert steps.finished[request.request_id] == FinishReason.ERROR
    assert (context.metrics.fills_retried, context.metrics.requests_failed) == (1, 1)
    assert not steps.delivered.get(request.request_id) and not steps.served_wrong()
    run(steps, lambda: accounting(scheduler) == idle, limit=4)


def test_a_bad_entry_leaves_the_index_once_reported(vllm_scheduler):
    """A document's entry made bad: the next request copying it is planned again, the workers report
    the entry and it leaves the pool's index (``entries_failed``); every request computes the
    document again and completes (before issue 45's fix every request carrying the document failed
    until the entry was evicted; before issue 63's the first one failed)."""
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
    assert not errors, f"failed: {errors}"
    assert context.metrics.entries_failed == 1 and context.metrics.fills_retried >= 1
    assert not steps.served_wrong()


def test_a_bad_system_prompt_entry_that_chunk_jobs_read_leaves_the_index(vllm_scheduler):
    """Issue 63, point 2: a system prompt of whole blocks (32 tokens) is served by vLLM's prefix
    cache, so no request copies it and no copy checks it; only the chunk jobs of new documents read
    its entry. Made bad, it poisons those jobs, and the workers report the entry they read as well
    as the jobs' own: it leaves the pool's index and the requests after compute it again; all
    complete, the first after a retry (before, only the jobs' entries were reported: every later
    request with a new document failed and the system prompt's entry stayed indexed)."""
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
    assert not errors, f"failed: {errors}"
    assert context.metrics.fills_retried == 1
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
    assert request.request_id not in context.admission.capturing
    fresh = stream.make(SYS, docs(26000, 2, 40), [40003], mode, salt="tenant-a")
    assert context.matched(fresh.request_id, fresh.prompt_token_ids, fresh.sampling_params.extra_args, 0) == (0, False)
    assert fresh.request_id in context.admission.capturing


NO_STEP = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
"""Scheduler output of a step that schedules nothing (the connector driven directly)."""
