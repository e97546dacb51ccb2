"""A request whose context read KV that failed its check goes back to vLLM's queue instead of
failing: vLLM's scheduler's side of graphchunk's fill retries.

The workers report, with a step's output, each request whose context fill failed its check
(``GraphChunkWorkerMeta.refill``) and the blocks it left unfilled (``invalid_block_ids``).
Before vLLM processes that output (``Scheduler.update_from_output``, wrapped for graphchunk engines
by graphchunk's plugin: ``plugin.py``), graphchunk's connector puts back in vLLM's queue every
request that read them (``readers``): the requests reported, and any other running or loading
request holding one of those blocks (a prefix-cache hit on a failed synchronous fill's blocks,
which vLLM hashed when it allocated them). ``requeue`` leaves each as vLLM leaves a request it
preempts: nothing computed, none of its in-flight output delivered. Its next schedule asks the
connector again, which plans the context anew (``ContextScheduler.refill``) without the bad
entries: they leave the index with the same output (``ContextScheduler.reported``).

- running: preempted as vLLM preempts (``Scheduler._preempt_request``), its in-flight output
  dropped: the token of the step that read the bad KV, and under asynchronous scheduling that of
  the step scheduled before its output arrived;
- waiting for its asynchronous load: rolled back to nothing computed and marked a failed load
  (``failed_recving_kv_req_ids``, as vLLM's own ``kv_load_failure_policy: recompute`` marks one):
  vLLM frees its blocks once the load is reported and then looks its prefix up again;
- preempted by vLLM between the step that read the bad KV and that step's output: it holds no
  block, and its in-flight output is dropped by vLLM itself (graphchunk's connector
  ``requires_kv_delivery``: a request preempted with output in flight recomputes it).

vLLM's own ``_handle_invalid_blocks`` then runs over the same output and fails what still holds
an invalid block: only requests graphchunk refused (``ContextScheduler.refill``), whose load was
never filled. vLLM's recompute policy is not used: it would recompute a context as an ordinary
causal prompt, neither isolated mode's semantics nor blend's. vLLM names used here that are not
part of its connector interface are listed in ``contract/names.py``.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterable


def readers(scheduler, refill: Iterable[str], invalid: set[int]) -> list:
    """The live requests that read KV that failed its check: those reported (``refill``) and the
    running or loading ones that hold one of the ``invalid`` blocks, each once. Walks vLLM's
    running and loading requests only on a step that reports invalid blocks."""
    found = {}
    for req_id in refill:
        request = scheduler.requests.get(req_id)
        if request is not None and not request.is_finished():
            found[req_id] = request
    if invalid:
        from vllm.v1.request import RequestStatus

        for request in itertools.chain(scheduler.running, scheduler.kv_holding_waiting):
            if request.request_id in found or request.status not in (RequestStatus.RUNNING,
                                                                     RequestStatus.WAITING_FOR_REMOTE_KVS):
                continue
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            if not invalid.isdisjoint(block_ids):
                found[request.request_id] = request
    return list(found.values())


def requeue(scheduler, request) -> None:
    """Leaves ``request`` in vLLM's queue with nothing computed and no output in flight (module
    docstring); a request vLLM preempted already is left as it is."""
    from vllm.v1.request import RequestStatus

    if request.status == RequestStatus.RUNNING:
        scheduler.running.remove(request)
        scheduler._preempt_request(request, time.monotonic(), drop_stale_output=True)
    elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        request.num_computed_tokens = 0
        scheduler.failed_recving_kv_req_ids.add(request.request_id)
