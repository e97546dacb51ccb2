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
                computed alone became attention sinks;
``question``    question-aware (after ProphetKV, ICML'26): the question runs once over the reused
                KV (the documents' keys already rotated to where they land), through every layer
                or, with ``layers`` k, only the first k (A3's and InfoFlow's early-layer pick: a
                scoring pass ~k/L of the full one), and the ``ratio`` share of chunk tokens it
                attends to most (softmax probability summed over its tokens, heads and those
                layers) is recomputed through all layers. The question must be scheduled in the
                same step as the chunk tokens it ranks; a step of chunked prefill that fills context without its question
                (or a question longer than a forward's budget, or one whose blocks vLLM has not
                all allocated yet: vLLM scheduled only part of it) ranks by CacheBlend's deviation
                instead, counted in ``blend_question_fallbacks``.

cacheblend and question take three refinements (``select_tokens``): ``sinks``, the first tokens of
every chunk recomputed first, within the ratio's count (LegoLink's sinks mixed with the ranking);
``spread``, the ratio taken over the step's chunk tokens together ('context': the highest scores
wherever they are) or over each chunk's on its own ('chunk': every chunk gets its share); and
``block``, the pick made in blocks of that many consecutive tokens of a chunk (cut from its first
token), ranked by their summed scores: the same count of tokens in fewer, longer runs, each run one
pseudo-sequence of the recompute forward (1: single tokens).

Ratio 1 recomputes every chunk token (exactly a full prefill); ratio 0 or ``none`` is naive reuse.
A step selects among the chunk tokens it fills; when chunked prefill splits a context across
steps, each step's share is selected on its own (the ratio holds per step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphchunk.device import PseudoSeq, consecutive_runs, slots_of, split_forward_batches

POLICIES = ("none", "cacheblend", "legolink", "question")
SPREADS = ("context", "chunk")


@dataclass(frozen=True)
class RecomputePolicy:
    name: str = "legolink"
    ratio: float = 0.15
    """cacheblend, question: share of chunk tokens recomputed through every layer, in [0, 1]."""
    tokens: int = 15
    """legolink: tokens recomputed at the start of every chunk."""
    sinks: int = 0
    """cacheblend, question: the first tokens of every chunk, recomputed first within the ratio's count."""
    spread: str = "context"
    """cacheblend, question: the ratio over the step's chunk tokens together ('context') or per chunk ('chunk')."""
    layers: int = 0
    """question: the scoring pass runs the question through the first ``layers`` layers and ranks by
    their attention (0: every layer; more than the model has: every layer)."""
    block: int = 1
    """cacheblend, question: tokens are picked in blocks of ``block`` consecutive tokens of a chunk,
    ranked by their summed scores (1: single tokens)."""

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"recompute policy must be one of {POLICIES}, got {self.name!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio <= 1:
            raise ValueError(f"recompute ratio must be a number in [0, 1], got {self.ratio!r}")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"recompute tokens must be an integer >= 0, got {self.tokens!r}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"recompute sinks must be an integer >= 0, got {self.sinks!r}")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 0:
            raise ValueError(f"recompute layers must be an integer >= 0 (0: every layer), got {self.layers!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"recompute block must be an integer >= 1 (1: single tokens), got {self.block!r}")
        if self.spread not in SPREADS:
            raise ValueError(f"recompute spread must be one of {SPREADS}, got {self.spread!r}")

    def cost(self, chunk_lens, question_len: int) -> int:
        """About how many tokens the policy runs through every layer for one request (its recomputed
        tokens, and the question-aware scoring pass's question): what admitting it adds to a step."""
        chunk_tokens = sum(chunk_lens)
        if self.name == "legolink":
            return sum(min(self.tokens, length) for length in chunk_lens)
        if self.name == "none":
            return 0
        return round(self.ratio * chunk_tokens) + (question_len if self.name == "question" else 0)

    @property
    def needs_check(self) -> bool:
        """Whether selection may need the check-layer forward (cacheblend, and question's fallback,
        with a ratio strictly between 0 and 1)."""
        return self.name in ("cacheblend", "question") and 0 < self.ratio < 1

    def describe(self) -> str:
        if self.name in ("cacheblend", "question"):
            sinks = f"+sinks:{self.sinks}" if self.sinks else ""
            layers = f"@{self.layers}" if self.layers and self.name == "question" else ""
            block = f"x{self.block}" if self.block > 1 else ""
            return f"{self.name}:{self.ratio!r}{sinks}{layers}{block}" + ("/chunk" if self.spread == "chunk" else "")
        return f"legolink:{self.tokens}" if self.name == "legolink" else "none"


def legolink_tokens(chunk_spans: list[tuple[int, int]], k: int) -> np.ndarray:
    """Logical indices of the first ``k`` tokens of each chunk span [begin, end)."""
    picks = [np.arange(b, min(e, b + k)) for b, e in chunk_spans]
    return np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)


def cacheblend_tokens(candidates: np.ndarray, deviation: np.ndarray, ratio: float) -> np.ndarray:
    """The ``ceil(ratio * n)`` candidates with the largest deviation (or question attention; ties:
    the earlier token), in logical order."""
    return _top(np.asarray(candidates, np.int64), np.asarray(deviation, np.float64), _count(ratio, len(candidates)))


def select_tokens(candidates: np.ndarray, scores: np.ndarray, policy: RecomputePolicy,
                  chunk_spans: list[tuple[int, int]]) -> np.ndarray:
    """cacheblend's and question's pick among ``candidates`` (logical indices, ascending) by
    ``scores`` (one per candidate): per group (the candidates together, or those of each chunk
    span with spread 'chunk'), ``ceil(ratio * n)`` of its n tokens: its sinks (the first
    ``policy.sinks`` tokens of each chunk; all of them, even past that count), then the rest in
    blocks (``policy.block`` tokens of a chunk span, cut from its first token; 1: single tokens)
    by their summed scores, whole until the count is reached: the last block taken keeps its
    first tokens (ties: the earlier block). In logical order."""
    candidates, scores = np.asarray(candidates, np.int64), np.asarray(scores, np.float64)
    if policy.spread == "chunk":
        groups = [(candidates >= b) & (candidates < e) for b, e in chunk_spans]
    else:
        groups = [np.ones(len(candidates), bool)]
    sink = np.isin(candidates, legolink_tokens(chunk_spans, policy.sinks))
    block = _block_keys(candidates, chunk_spans, policy.block)
    picks = [np.zeros(0, np.int64)]
    for group in groups:
        fixed, rest = group & sink, group & ~sink
        count = _count(policy.ratio, int(group.sum())) - int(fixed.sum())
        picks += [candidates[fixed], _top(candidates[rest], scores[rest], max(0, count),
                                          None if block is None else block[rest])]
    return np.sort(np.concatenate(picks))


def _block_keys(candidates: np.ndarray, chunk_spans: list[tuple[int, int]], block: int) -> np.ndarray | None:
    """Each candidate's block (``block`` tokens of its chunk span from the span's first token), as
    the block's first index; candidates outside every span are blocks of one. None for single
    tokens (``_top``'s plain ranking)."""
    if block == 1 or not chunk_spans:
        return None
    begins = np.asarray([b for b, _ in chunk_spans], np.int64)
    span = np.maximum(np.searchsorted(begins, candidates, side="right") - 1, 0)
    inside = (candidates >= begins[span]) & (candidates < np.asarray([e for _, e in chunk_spans])[span])
    return np.where(inside, begins[span] + (candidates - begins[span]) // block * block, candidates)


def _count(ratio: float, n: int) -> int:
    return min(n, math.ceil(ratio * n - 1e-9))


def _top(candidates: np.ndarray, scores: np.ndarray, count: int, blocks: np.ndarray | None = None) -> np.ndarray:
    """The ``count`` candidates of the blocks with the largest summed scores (``blocks``: each
    candidate's block key, nondecreasing; None: every candidate its own block), whole blocks
    until the last, which keeps its first candidates; ties: the earlier block."""
    if blocks is None or len(candidates) == 0:
        order = np.argsort(-scores, kind="stable")[:count]
        return np.sort(candidates[order])
    firsts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])
    lengths = np.diff(np.r_[firsts, len(candidates)])
    order = np.argsort(-np.add.reduceat(scores, firsts), kind="stable")
    taken = np.minimum(lengths[order], np.maximum(0, count - (np.cumsum(lengths[order]) - lengths[order])))
    keep = taken > 0
    starts, taken = firsts[order][keep], taken[keep]
    index = np.repeat(starts - np.r_[0, np.cumsum(taken)[:-1]], taken) + np.arange(taken.sum())
    return np.sort(candidates[index])


# --- the recompute step, over the device ------------------------------------------------------

def recompute(prompts, device, *, check_layer: int, budget: int, block_size: int, metrics) -> None:
    """Gives the tokens each blend prompt's policy picks, among the chunk tokens its step filled,
    fresh KV over the request's own slots (after the rotated copies are in place).

    ``prompts``: ``chunk_cache.ScheduledPrompt``s with a policy and their block ids; ``device``:
    a ``KVDevice``; ``budget``: most new tokens per forward."""
    picks: dict[int, np.ndarray] = {}
    checked, asked = [], []
    for n, prompt in enumerate(prompts):
        lay, policy = prompt.seg.layout, prompt.policy
        lo, hi = max(prompt.start, lay.sys_len), prompt.context_end
        if hi <= lo or policy.name == "none":
            continue
        candidates = np.arange(lo, hi)
        if policy.name == "legolink":
            spans = prompt.seg.bounds[1:-1]
            picks[n] = np.intersect1d(legolink_tokens(spans, policy.tokens), candidates)
        elif policy.needs_check and policy.name == "question" and _question_fits(prompt, budget, block_size):
            asked.append((n, candidates))
        elif policy.needs_check:
            checked.append((n, candidates))
            metrics.blend_question_fallbacks += policy.name == "question"
        elif policy.ratio > 0:
            picks[n] = candidates
    if asked:
        picks.update(_ask(prompts, asked, device, budget, metrics))
    if checked:
        picks.update(_check(prompts, checked, device, check_layer, budget, block_size, metrics))
    seqs = [_seq(prompts[n], a, a + length) for n, chosen in sorted(picks.items()) for a, length in consecutive_runs(chosen)]
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
        moved = (device.read_keys(check_layer, slots[n]).float() - reused[n]).square().sum(dim=(1, 2))
        deviation = device.sum_over_ranks(moved)  # every tensor-parallel rank ranks all heads alike
        picks[n] = _select(prompts[n], candidates, deviation.cpu().numpy())
    return picks


def _question_fits(prompt, budget: int, block_size: int) -> bool:
    """The question fits one forward, and the request's blocks hold all of it: the scoring pass
    writes its KV there. vLLM allocates blocks for the tokens it schedules, so a question that
    shares its step's token budget with other requests may have only part of them yet."""
    lay = prompt.seg.layout
    return prompt.end >= lay.num_tokens and lay.question_len <= budget and \
        len(prompt.block_ids) * block_size >= lay.num_tokens


def _ask(prompts, asked, device, budget: int, metrics) -> dict[int, np.ndarray]:
    """The question-aware selection: each question once over its request's reused context, through
    its policy's layers, in batches of at most ``budget`` tokens (one depth per batch); the
    candidates it attends to most."""
    picks = {}
    for depth in sorted({prompts[n].policy.layers for n, _ in asked}):
        group = [(n, candidates) for n, candidates in asked if prompts[n].policy.layers == depth]
        seqs = [_seq(prompts[n], prompts[n].seg.layout.context_len, prompts[n].seg.layout.num_tokens)
                for n, _ in group]
        scores, batch, used = [], [], 0
        for seq in seqs:
            if batch and used + seq.num_new > budget:
                scores += device.context_attention(batch, num_layers=depth or None)
                batch, used = [], 0
            batch.append(seq)
            used += seq.num_new
        scores += device.context_attention(batch, num_layers=depth or None)
        metrics.blend_tokens_scored += sum(seq.num_new for seq in seqs)
        picks.update({n: _select(prompts[n], candidates, scores[i][candidates].cpu().numpy())
                      for i, (n, candidates) in enumerate(group)})
    return picks


def _select(prompt, candidates: np.ndarray, scores: np.ndarray) -> np.ndarray:
    return select_tokens(candidates, scores, prompt.policy, prompt.seg.bounds[1:-1])


def _seq(prompt, a: int, b: int) -> PseudoSeq:
    """Tokens [a, b) of the request at their own positions, over its slots [0, a)."""
    return PseudoSeq(prompt.seg.token_ids[:b], np.arange(b), prompt.block_ids, a)


