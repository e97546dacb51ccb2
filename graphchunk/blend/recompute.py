"""Blend mode's recompute policies: which reused chunk tokens get fresh KV (DESIGN.md §2).

A blend request reuses each chunk's KV computed alone at [0, L) and rotated to where the chunk
lands; the tokens a policy picks are recomputed under full causal attention over everything
before them. Policies:

``none``        naive reuse (seed 000): nothing is recomputed;
``cacheblend``  CacheBlend (EuroSys'25): every chunk token is recomputed through layers
                [0, check_layer]; the ``ratio`` share of chunk tokens whose K at ``check_layer``
                deviates most (squared L2, after rotation) from the reused K is recomputed
                through all layers. K, as CacheBlend's own implementation (LMCache's blender)
                ranks: it decides where the later tokens' attention goes, and K and V of one
                token deviate together (both come from the same hidden state);
``legolink``    EPIC's LegoLink (ICML'25): the first ``tokens`` tokens of every chunk, which
                computed alone became attention sinks.

Ratio 1 recomputes every chunk token (exactly a full prefill); ratio 0 or ``none`` is naive reuse.
A step selects among the chunk tokens it fills; when chunked prefill splits a context across
steps, each step's share is selected on its own (the ratio holds per step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphchunk.device import PseudoSeq, consecutive_runs, slots_of, split_forward_batches

POLICIES = ("none", "cacheblend", "legolink")


@dataclass(frozen=True)
class RecomputePolicy:
    name: str = "legolink"
    ratio: float = 0.15
    """cacheblend: share of chunk tokens recomputed through every layer, in [0, 1]."""
    tokens: int = 4
    """legolink: tokens recomputed at the start of every chunk."""

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"recompute policy must be one of {POLICIES}, got {self.name!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio <= 1:
            raise ValueError(f"recompute ratio must be a number in [0, 1], got {self.ratio!r}")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"recompute tokens must be an integer >= 0, got {self.tokens!r}")

    @property
    def needs_check(self) -> bool:
        """Whether selection needs the check-layer forward (cacheblend strictly between 0 and 1)."""
        return self.name == "cacheblend" and 0 < self.ratio < 1

    def describe(self) -> str:
        if self.name == "cacheblend":
            return f"cacheblend:{self.ratio!r}"
        return f"legolink:{self.tokens}" if self.name == "legolink" else "none"


def legolink_tokens(chunk_spans: list[tuple[int, int]], k: int) -> np.ndarray:
    """Logical indices of the first ``k`` tokens of each chunk span [begin, end)."""
    picks = [np.arange(b, min(e, b + k)) for b, e in chunk_spans]
    return np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)


def cacheblend_tokens(candidates: np.ndarray, deviation: np.ndarray, ratio: float) -> np.ndarray:
    """The ``ceil(ratio * n)`` candidates with the largest deviation (ties: the earlier token),
    in logical order."""
    count = min(len(candidates), math.ceil(ratio * len(candidates) - 1e-9))
    order = np.argsort(-np.asarray(deviation, np.float64), kind="stable")[:count]
    return np.sort(np.asarray(candidates, np.int64)[order])


# --- the recompute step, over the device ------------------------------------------------------

def recompute(prompts, device, *, check_layer: int, budget: int, block_size: int, metrics) -> None:
    """Gives the tokens each blend prompt's policy picks, among the chunk tokens its step filled,
    fresh KV over the request's own slots (after the rotated copies are in place).

    ``prompts``: ``chunk_cache.ScheduledPrompt``s with a policy and their block ids; ``device``:
    a ``KVDevice``; ``budget``: most new tokens per forward."""
    picks: dict[int, np.ndarray] = {}
    checked = []
    for n, prompt in enumerate(prompts):
        lay, policy = prompt.seg.layout, prompt.policy
        lo, hi = max(prompt.start, lay.sys_len), prompt.context_end
        if hi <= lo or policy.name == "none":
            continue
        candidates = np.arange(lo, hi)
        if policy.name == "legolink":
            spans = prompt.seg.bounds[1:-1]
            picks[n] = np.intersect1d(legolink_tokens(spans, policy.tokens), candidates)
        elif policy.needs_check:
            checked.append((n, candidates))
        elif policy.ratio > 0:
            picks[n] = candidates
    if checked:
        picks.update(_check(prompts, checked, device, check_layer, budget, block_size, metrics))
    seqs = [_seq(prompts[n], a, a + length) for n, chosen in picks.items() for a, length in consecutive_runs(chosen)]
    for batch in split_forward_batches(seqs, budget):
        device.prefill(batch)
    metrics.blend_tokens_recomputed += sum(len(chosen) for chosen in picks.values())


def _check(prompts, checked, device, check_layer: int, budget: int, block_size: int,
           metrics) -> dict[int, np.ndarray]:
    """CacheBlend's selection: every candidate through layers [0, check_layer]; the ones whose K at
    ``check_layer`` moved most from the reused K."""
    slots = {n: slots_of(prompts[n].block_ids, candidates, block_size) for n, candidates in checked}
    reused = {n: device.read_keys(check_layer, slots[n]).float() for n, _ in checked}
    seqs = [_seq(prompts[n], int(c[0]), int(c[-1]) + 1) for n, c in checked]
    for batch in split_forward_batches(seqs, budget):
        device.prefill(batch, num_layers=check_layer + 1)
    metrics.blend_tokens_checked += sum(len(c) for _, c in checked)
    picks = {}
    for n, candidates in checked:
        deviation = (device.read_keys(check_layer, slots[n]).float() - reused[n]).square().sum(dim=(1, 2))
        picks[n] = cacheblend_tokens(candidates, deviation.cpu().numpy(), prompts[n].policy.ratio)
    return picks


def _seq(prompt, a: int, b: int) -> PseudoSeq:
    """Tokens [a, b) of the request at their own positions, over its slots [0, a)."""
    return PseudoSeq(prompt.seg.token_ids[:b], np.arange(b), prompt.block_ids, a)


