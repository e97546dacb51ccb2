"""``bench_ttft.py``'s workload: token windows of CPython's help topics and the request sequence.

A document is the text from one paragraph on (``graphchunk.reference.text.help_topic_paragraphs``),
tokenized with the model's tokenizer and cut to exactly L tokens (each document starts at another
paragraph, so all are distinct); sys and questions are cut the same way to S and Q tokens.
Everything is seeded. ``build_workload`` lays out the request sequence ``bench_ttft.py``'s
docstring describes (global warm-up; per number of chunks a miss phase, seeds, a hit phase).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

LEADING = 32
"""Tokens at the start of every sys, document and question that no other one shares."""


@dataclass(frozen=True)
class Request:
    phase: str  # "global_warmup", "seed", "miss" or "hit"
    k: int
    index: int  # within its phase; index < warmup: not counted
    docs: tuple[int, ...]  # document ids, in prompt order
    question: tuple[int, ...]
    counted: bool
    source: int | None = None  # hit phase: index of the miss request with the same documents


@dataclass
class Workload:
    sys: tuple[int, ...]
    docs: list[tuple[int, ...]]
    requests: list[Request]
    chunk_tokens: int
    notes: list[str] = field(default_factory=list)

    def prompt(self, req: Request) -> tuple[list[int], list[int]]:
        """Token ids and segment boundaries (start of each chunk and of the question)."""
        ids, bounds = list(self.sys), []
        for d in req.docs:
            bounds.append(len(ids))
            ids.extend(self.docs[d])
        bounds.append(len(ids))
        ids.extend(req.question)
        return ids, bounds


class TextSource:
    """Token windows of exactly n tokens starting at paragraph p of the corpus."""

    def __init__(self, tokenizer):
        from graphchunk.reference.text import help_topic_paragraphs

        self.tokenizer = tokenizer
        self.paragraphs = help_topic_paragraphs()

    def window(self, p: int, n: int) -> tuple[int, ...] | None:
        text, tokens, q = "", [], p
        while q < len(self.paragraphs):
            text = self.paragraphs[q] if q == p else text + "\n\n" + self.paragraphs[q]
            q += 1
            if len(text) >= 2 * n:  # cheap guard before tokenizing (a token is ~4 characters)
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if len(tokens) >= n:
                    return tuple(tokens[:n])
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        return tuple(tokens[:n]) if len(tokens) >= n else None


def build_workload(tokenizer, *, sweep: list[int], chunk_tokens: int, sys_tokens: int, question_tokens: int,
                   repeats: int, warmup: int, seed: int) -> Workload:
    rng = random.Random(seed)
    source = TextSource(tokenizer)
    starts = list(range(len(source.paragraphs)))
    rng.shuffle(starts)
    starts_iter = iter(starts)

    def take(n: int, seen: set) -> tuple[int, ...]:
        # Distinct leading tokens, not just distinct windows: the help topics repeat some paragraphs,
        # and two documents opening with the same one would share prefix-cache blocks.
        for p in starts_iter:
            window = source.window(p, n)
            if window is not None and window[:LEADING] not in seen:
                seen.add(window[:LEADING])
                return window
        raise RuntimeError(f"the corpus has too few distinct {n}-token windows for this workload; "
                           "lower --repeats, --warmup or the sweep")

    seen: set = set()
    sys_ids = take(sys_tokens, seen) if sys_tokens else ()
    docs: list[tuple[int, ...]] = []
    firsts: set[int] = set()  # documents that have been the first document of a request
    used: list[int] = []  # documents of earlier requests, in order of first use
    requests: list[Request] = []
    notes: list[str] = []

    def fresh_docs(k: int) -> tuple[int, ...]:
        ids = []
        for _ in range(k):
            docs.append(take(chunk_tokens, seen))
            ids.append(len(docs) - 1)
        return tuple(ids)

    def add(req: Request) -> None:
        requests.append(req)
        firsts.add(req.docs[0])
        used.extend(d for d in req.docs if d not in used_set)
        used_set.update(req.docs)

    used_set: set[int] = set()
    question = lambda: take(question_tokens, seen)  # noqa: E731
    # One request ahead of everything, not counted: process start-up costs and the sys entry.
    add(Request("global_warmup", 1, 0, fresh_docs(1), question(), False))
    per_phase = warmup + repeats
    for k in sorted(set(sweep), reverse=True):
        if k == 1:
            # Each k=1 hit request needs a document that sat off the first position earlier (else
            # vLLM's prefix cache would serve its context); uncounted 2-chunk seed requests add them.
            spare = [d for d in used if d not in firsts]
            for i in range(max(0, per_phase - len(spare))):
                add(Request("seed", 2, i, fresh_docs(2), question(), False))
        misses = []
        for i in range(per_phase):
            req = Request("miss", k, i, fresh_docs(k), question(), i >= warmup)
            misses.append(req)
            add(req)
        for i, miss in enumerate(misses):
            if k > 1:  # the same documents, a first one that never was first
                first = rng.choice([d for d in miss.docs if d not in firsts])
                rest = [d for d in miss.docs if d != first]
                rng.shuffle(rest)
                add(Request("hit", k, i, (first, *rest), miss.question, i >= warmup, source=i))
            else:  # one document of an earlier request, never first
                doc = rng.choice([d for d in used if d not in firsts])
                add(Request("hit", k, i, (doc,), question(), i >= warmup))
    return Workload(sys_ids, docs, requests, chunk_tokens, notes)


def engine_requests(kind: str, workload: Workload, vanilla_miss_phase: bool = False) -> list[Request]:
    """graphchunk runs every request; vanilla the hit phase (the reordered prompts) and the global
    warm-up, and the miss phase too when asked (it costs vanilla the same: a full prefill)."""
    if kind == "graphchunk" or vanilla_miss_phase:
        return [r for r in workload.requests if kind == "graphchunk" or r.phase != "seed"]
    return [r for r in workload.requests if r.phase in ("global_warmup", "hit")]


def expected_stats(req: Request, workload: Workload, sys_tokens: int, question_tokens: int,
                   mode: str | None = None) -> dict[str, tuple[int, int]] | None:
    """graphchunk counter deltas a request must show, as inclusive ranges (None: unchecked).

    Chunk lookups only are counted (k per request); an all-miss request computes its k chunks
    and its question, an all-hit request its question only and reuses its k*L chunk tokens. The
    sys prompt's KV (S tokens) may be counted as reused in both (it is copied from the pool
    unless vLLM's prefix cache holds it). In blend mode (``mode``) the sys prompt may be computed
    instead, and an all-hit request recomputes some, not all, of its chunk tokens."""
    k, L, S, Q = req.k, workload.chunk_tokens, sys_tokens, question_tokens
    sys_computed = S if mode == "blend" else 0
    if req.phase in ("miss", "seed"):
        return {"lookups": (k, k), "hits": (0, 0), "misses": (k, k), "evictions": (0, 0),
                "tokens_reused": (0, S), "tokens_computed": (k * L + Q, k * L + Q + sys_computed)}
    if req.phase == "hit":
        found = {"lookups": (k, k), "hits": (k, k), "misses": (0, 0), "evictions": (0, 0),
                 "tokens_reused": (k * L, k * L + S), "tokens_computed": (Q, Q + sys_computed)}
        return {**found, "blend_tokens_recomputed": (1, k * L - 1)} if mode == "blend" else found
    return None


def stats_violations(delta: dict, expected: dict[str, tuple[int, int]]) -> dict:
    """{counter: (got, expected range)} for every counter outside its range."""
    return {key: (delta.get(key), list(rng)) for key, rng in expected.items()
            if delta.get(key) is None or not rng[0] <= delta[key] <= rng[1]}
