"""Context of segmented requests from the chunk pool, planned and run in one process.

For every segmented request whose scheduled range ``[start, end)`` overlaps its context
``[0, C)`` (C = S + sum L_i): acquire pool entries for its sys prompt and chunks, compute the
misses (or load them from the directory, ``tier.py``, or host memory, ``host_tier.py``), and copy
the KV of the context tokens in ``[start, min(end, C))`` into the request's own slots; blend
requests then recompute the tokens their policy picks. The plan is ``context_plan.py``'s, the run
``context_run.py``'s.

In an engine the two halves live apart: vLLM's scheduler process plans (graphchunk's KV
connector, ``engine/connector.py``, holds the one pool index) and every worker runs the plans,
misses under a token budget per step. ``ChunkCache`` joins them for one batch of requests run to
completion at once (``materialize``): the tests' and tools' synchronous form. A batch whose
entries outgrow the pool runs in several groups, each released once copied.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from graphchunk.blend.recompute import RecomputePolicy
from graphchunk.cache.context_plan import ContextPlanner, RequestPlan
from graphchunk.cache.context_run import ContextRunner
from graphchunk.cache.host_index import HostIndex
from graphchunk.cache.host_tier import HostTier
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.pool import ChunkPool, PoolExhausted
from graphchunk.cache.tier import Tier
from graphchunk.device import KVDevice, PseudoSeq, slots_of, split_forward_batches  # noqa: F401 (re-exported)
from graphchunk.segments import SegmentedPrompt


@dataclass
class ScheduledPrompt:
    """A segmented request's share of one step."""

    seg: SegmentedPrompt
    salt: str | None
    start: int
    end: int
    block_ids: Sequence[int]
    policy: RecomputePolicy | None = None
    """Blend mode's recompute policy; None for isolated mode."""
    key_temperature: float = 1.0
    """Isolated mode: chunk keys are divided by it as they are copied into the request."""
    req_id: str = ""
    """vLLM's request id (engine fills)."""

    @property
    def mode(self) -> str:
        return "isolated" if self.policy is None else "blend"

    @property
    def context_end(self) -> int:
        return min(self.end, self.seg.layout.context_len)


class ChunkCache:
    def __init__(self, pool: ChunkPool, space: KeySpace, max_forward_tokens: int, check_layer: int = 1,
                 tier: Tier | None = None, host: HostTier | None = None, host_tokens: int = 0):
        """``host``, ``host_tokens``: host memory below the pool and the tokens of KV it holds."""
        self.pool = pool
        self.metrics = pool.metrics
        self.planner = ContextPlanner(pool, space, HostIndex(host_tokens) if host is not None else None)
        self.runner = ContextRunner(pool.block_size, max_forward_tokens, self.metrics, check_layer=check_layer,
                                    tier=tier, host=host)

    def materialize(self, prompts: list[ScheduledPrompt], device: KVDevice) -> None:
        """Fills every prompt's context slots in its scheduled range. A prompt whose entries alone
        outgrow the pool goes one segment at a time, each released once copied."""
        group: list[tuple[ScheduledPrompt, RequestPlan]] = []
        for prompt in prompts:
            try:
                plan = self._plan(prompt)
            except PoolExhausted:
                self._run(group, device)
                group = []
                try:
                    plan = self._plan(prompt)
                except PoolExhausted:
                    for piece in _segments(prompt):
                        self._run([(piece, self._plan(piece))], device)  # a segment larger than the pool raises
                    continue
            group.append((prompt, plan))
        self._run(group, device)
        self.runner.recompute(prompts, device)

    def _plan(self, prompt: ScheduledPrompt) -> RequestPlan:
        plan = self.planner.plan(prompt.seg, prompt.salt, prompt.mode, prompt.start, prompt.context_end)
        self.runner.add_jobs(plan.jobs)
        self.runner.count(plan.counts)
        return plan

    def _run(self, group: list[tuple[ScheduledPrompt, RequestPlan]], device: KVDevice) -> None:
        try:
            self.runner.drop_host(self.planner.take_host_drops())
            self.runner.run_jobs(device)
            self.planner.finish_jobs(self.runner.done_before)
            self.runner.copy([(prompt, plan.units) for prompt, plan in group], device)
            invalid = self.runner.take_invalid()
            if invalid:
                raise RuntimeError(f"graphchunk: a context fill found pool blocks that do not hold what it planned "
                                   f"to copy (request blocks {sorted(invalid)} left unfilled)")
        finally:
            for _, plan in group:
                self.planner.release(plan)


def _segments(prompt: ScheduledPrompt) -> list[ScheduledPrompt]:
    """``prompt``'s context range cut at its segments' bounds."""
    cuts = sorted({prompt.start, prompt.context_end} | {b for b, _ in prompt.seg.bounds
                                                         if prompt.start < b < prompt.context_end})
    return [dataclasses.replace(prompt, start=lo, end=hi) for lo, hi in zip(cuts, cuts[1:])]
