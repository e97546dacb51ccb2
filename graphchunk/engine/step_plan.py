"""One step's plan, made on the host from vLLM's scheduler output before the runner sees it.

For every segmented request whose scheduled range overlaps its context, the range vLLM's runner
computes itself starts at the question (``ScheduledPrompt.compute_start``): the plan carries a
copy of the scheduler output shrunk so, the context ranges graphchunk fills from the chunk pool
before vLLM prepares its inputs (``fills``), and the requests whose one remaining context token
vLLM still computes, as a dummy whose KV must not overwrite the copied one (``dummies``). A step
in which every request computes only its question over cached context is a cached-chunk prefill
that a bucket of the grid may hold (``bucket``); a step with any question over cached context is
counted by how vLLM ran it (``counted``).

``plan_step`` is a pure function of its arguments; the engine applies the plan (``chunk_engine.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from graphchunk.cache.chunk_cache import ScheduledPrompt
from graphchunk.engine.frontend import ChunkRequest
from graphchunk.graphs.buckets import Bucket, RequestShape


@dataclasses.dataclass(frozen=True)
class StepPlan:
    scheduler_output: object
    """What vLLM's runner runs: the scheduler's output, shrunk where graphchunk fills context."""
    fills: tuple[tuple[str, ScheduledPrompt], ...] = ()
    """(request id, its scheduled context range) to fill from the pool; block ids are vLLM's."""
    dummies: frozenset[str] = frozenset()
    """Requests whose scheduled tokens are one context token, already filled: written nowhere."""
    tokens_computed: int = 0
    """Tokens of segmented requests vLLM's runner computes itself this step."""
    counted: bool = False
    """The step has a cached-chunk prefill (a question over cached context): counted by how it ran."""
    bucket: Bucket | None = None
    """The grid's bucket holding the step, when every request in it computes only its question."""


ChooseBucket = Callable[[list[RequestShape]], Bucket | None]
"""The grid's bucket choice for a step's question-only requests (``BucketCounts.choose``)."""


def plan_step(so, requests: dict[str, ChunkRequest], choose: ChooseBucket | None) -> StepPlan:
    """``requests``: the segmented requests by id; ``choose``: the grid's bucket choice (None: no grid)."""
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    shrink, fills, dummies, questions, tokens_computed = {}, [], set(), [], 0
    for req_id, num_tokens in so.num_scheduled_tokens.items():
        request = requests.get(req_id)
        if request is None:
            continue
        lay = request.seg.layout
        start, end = computed[req_id], computed[req_id] + num_tokens
        prompt = ScheduledPrompt(request.seg, request.salt, start, end, (), request.policy, request.key_temperature)
        own_start = prompt.compute_start()
        tokens_computed += max(0, min(end, lay.num_tokens) - max(own_start, start))
        if start < lay.context_len:  # also when own_start == start: one context token scheduled
            fills.append((req_id, prompt))
            shrink[req_id] = own_start
            if own_start < lay.context_len:
                dummies.add(req_id)
        if lay.context_len <= own_start < lay.num_tokens:
            questions.append(RequestShape(lay.sys_len, lay.chunk_lens, end - own_start))
    counted = bool(questions) and choose is not None
    bucket = choose(questions) if counted and len(questions) == len(so.num_scheduled_tokens) else None
    return StepPlan(_shrunk(so, computed, shrink) if shrink else so, tuple(fills), frozenset(dummies),
                    tokens_computed, counted, bucket)


def _shrunk(so, computed: dict[str, int], new_starts: dict[str, int]):
    """A copy of the scheduler output whose requests in ``new_starts`` compute from there on
    (``computed``: each scheduled request's original start)."""
    num_tokens = dict(so.num_scheduled_tokens)
    removed = 0
    new_reqs = []
    for req in so.scheduled_new_reqs:
        if req.req_id in new_starts:
            req = dataclasses.replace(req, num_computed_tokens=new_starts[req.req_id])
        new_reqs.append(req)
    cached = so.scheduled_cached_reqs
    cached_computed = [new_starts.get(r, n) for r, n in zip(cached.req_ids, cached.num_computed_tokens)]
    for req_id, start in new_starts.items():
        num_tokens[req_id] -= start - computed[req_id]
        removed += start - computed[req_id]
    return dataclasses.replace(
        so, scheduled_new_reqs=new_reqs, num_scheduled_tokens=num_tokens,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens - removed,
        scheduled_cached_reqs=dataclasses.replace(cached, num_computed_tokens=cached_computed))
