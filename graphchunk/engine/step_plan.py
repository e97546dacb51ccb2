"""One step's plan, made on the host from vLLM's scheduler output before the runner sees it.

vLLM's scheduler already counts a segmented request's context as computed (graphchunk's KV
connector reports it as an external hit, ``connector.py``), so it schedules only the request's
question and generated tokens, and the step's connector metadata names the context of its
all-hit requests to fill before vLLM prepares its inputs (``fills``). A step in which every request computes only its question over
cached context is a cached-chunk prefill that a bucket of the grid may hold (``bucket``); a step
with any question over cached context is counted by how vLLM ran it (``counted``).

``plan_step`` is a pure function of its arguments; the engine applies the plan (``chunk_engine.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from graphchunk.engine.context_scheduler import ContextLoad, computed_before
from graphchunk.engine.request_args import ChunkRequest
from graphchunk.graphs.buckets import Bucket, RequestShape


@dataclasses.dataclass(frozen=True)
class StepPlan:
    fills: tuple[ContextLoad, ...] = ()
    """Context of this step's all-hit requests, to fill from the pool before vLLM prepares its inputs."""
    tokens_computed: int = 0
    """Prompt tokens of segmented requests vLLM's runner computes itself this step."""
    counted: bool = False
    """The step has a cached-chunk prefill (a question over cached context): counted by how it ran."""
    bucket: Bucket | None = None
    """The grid's bucket holding the step, when every request in it computes only its question."""
    prompted: tuple[str, ...] = ()
    """Segmented requests whose prompt this step computes to its end: from the next step on they
    decode, and planning no longer reads them."""


ChooseBucket = Callable[[list[RequestShape]], Bucket | None]
"""The grid's bucket choice for a step's question-only requests (``BucketCounts.choose``)."""


def plan_step(so, fills: tuple[ContextLoad, ...], prompting: dict[str, ChunkRequest],
              choose: ChooseBucket | None) -> StepPlan:
    """``fills``: the step's fills (its connector metadata); ``prompting``: the segmented requests
    whose prompt is not computed to its end, by id (decoding ones change nothing here: the plan
    costs the step's prompts, not its batch); ``choose``: the grid's bucket choice (None: no grid)."""
    scheduled = so.num_scheduled_tokens
    computed = computed_before(so) if prompting else {}
    questions, tokens_computed, prompted = [], 0, []
    for req_id, request in prompting.items():
        num_tokens = scheduled.get(req_id)
        if num_tokens is None:
            continue
        lay = request.seg.layout
        start = computed[req_id]
        tokens_computed += max(0, min(start + num_tokens, lay.num_tokens) - max(start, lay.context_len))
        if lay.context_len <= start < lay.num_tokens:
            questions.append(RequestShape(lay.sys_len, lay.chunk_lens, num_tokens))
        if start + num_tokens >= lay.num_tokens:
            prompted.append(req_id)
    counted = bool(questions) and choose is not None
    bucket = choose(questions) if counted and len(questions) == len(scheduled) else None
    return StepPlan(tuple(fills), tokens_computed, counted, bucket, tuple(prompted))
