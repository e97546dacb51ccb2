"""Graph templates inside the engine: every bucket of the session grid (tests/data/templates.toml)
replays — exactly at its boundaries (counted replayed) and partially filled (counted padded) — and
equals both vLLM's own forward (templates off; the engine runs without --enforce-eager, so that is
vLLM's compiled graph) and the oracle; steps outside every bucket run vLLM's forward, exactly, and
are counted eager. The grid is checked: every replay also passes the graph-safety check.

Each case first sends its prompts once (computing the chunks into the pool and whole blocks into
vLLM's prefix cache), then the same context with new questions of the same length: that step
computes only question tokens (the context tail comes from the pool), in one step even for
contexts longer than the step budget. Prompts are token ids with explicit boundaries, so every
segment has exactly the length the case names.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from conftest import GC_LLM_TEMPLATES
from exactness import (FIRST_TOKEN_TOL, LIMITS, LOGPROB_TOL, TOP_LOGPROBS, TextSource, assert_matches_oracle,
                       sampling)
from graphchunk.engine.frontend import BOUNDARIES_ARG
from graphchunk.graphs.buckets import Bucket, RequestShape, load_grid
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_oracle_thread")]

GRID = load_grid(str(GC_LLM_TEMPLATES))
MAX_TOKENS = 8
SHORT = 6  # tokens of each chunk but the longest
COUNTERS = ("graph_replays", "graph_padded", "graph_eager")


class Tokens:
    """Real-text token ids cut to exact lengths, from all paragraphs in an order of this module's
    own (whether its first requests miss the pool does not matter here, and it needs ~25k tokens)."""

    def __init__(self, paragraphs, tokenizer):
        shuffled = list(paragraphs)
        random.Random(14).shuffle(shuffled)
        self.text = TextSource(shuffled, tokenizer)
        self.tokenizer = tokenizer

    def take(self, n: int) -> list[int]:
        text = self.text.text(n + 8)
        ids = self.tokenizer.encode(" " + text, add_special_tokens=False)[:n]
        assert len(ids) == n
        return ids


@pytest.fixture(scope="module")
def tokens(paragraphs, tokenizer):
    return Tokens(paragraphs, tokenizer)


@dataclass(frozen=True)
class Shape:
    sys: int
    chunks: tuple[int, ...]
    question: int


@dataclass
class Prompt:
    context: list[int]
    boundaries: list[int]  # chunk starts, then the question's

    def with_question(self, question: list[int]):
        ids = self.context + question
        return ids, split_at(ids, self.boundaries, **LIMITS)


def make_prompt(tokens: Tokens, shape: Shape) -> Prompt:
    context, boundaries = tokens.take(shape.sys), []
    for n in shape.chunks:
        boundaries.append(len(context))
        context += tokens.take(n)
    return Prompt(context, boundaries + [len(context)])


def generate(llm, prompts: list[Prompt], questions: list[list[int]], max_tokens: int, ordinary=()):
    """Outputs, segmentations and graph-counter deltas (and replays per bucket) of one generate call,
    ordinary prompts first."""
    inputs, params, segs = [{"prompt_token_ids": ids} for ids in ordinary], [sampling(max_tokens)] * len(ordinary), []
    for prompt, question in zip(prompts, questions):
        ids, seg = prompt.with_question(question)
        p = sampling(max_tokens)
        p.extra_args = {BOUNDARIES_ARG: prompt.boundaries}
        inputs.append({"prompt_token_ids": ids})
        params.append(p)
        segs.append(seg)
    before, by_bucket = llm.stats(), replays_by_bucket(llm)
    outputs = generate_in_one_step(llm, inputs, params)
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in COUNTERS}
    delta["buckets"] = {name: n - by_bucket[name] for name, n in replays_by_bucket(llm).items() if n != by_bucket[name]}
    return outputs[len(ordinary):], segs, delta


_request_ids = itertools.count()


def generate_in_one_step(llm, inputs, params):
    """Like ``LLM.generate``, but every request reaches the scheduler before its first step:
    vLLM's engine core starts a step as soon as one request arrives, so ``generate`` may split a
    batch over steps. The scheduler is paused (keeping its state) while the requests are added."""
    engine = llm.llm.llm_engine
    engine.engine_core.call_utility("pause_scheduler", "keep", False)
    try:
        ids = [f"templates-{next(_request_ids)}" for _ in inputs]
        for request_id, prompt, p in zip(ids, inputs, params):
            engine.add_request(request_id, prompt, p)
    finally:
        engine.engine_core.call_utility("resume_scheduler")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    return [finished[request_id] for request_id in ids]


def replays_by_bucket(llm) -> dict[str, int]:
    """Steps that ran each bucket's template, exactly filled or padded."""
    return {row["bucket"]: row["replayed"] + row["padded"] for row in llm.templates_manifest()["buckets"]}


def run_question_step(llm, tokens, shapes: list[Shape], ordinary=()):
    """Warms the context of each shape, then runs new questions of the same lengths over it."""
    prompts = [make_prompt(tokens, s) for s in shapes]
    generate(llm, prompts, [tokens.take(s.question) for s in shapes], max_tokens=1)
    questions = [tokens.take(s.question) for s in shapes]
    outputs, segs, delta = generate(llm, prompts, questions, MAX_TOKENS, ordinary)
    return prompts, questions, outputs, segs, delta


def boundary_shapes(b: Bucket) -> list[Shape]:
    """Every axis at the bucket's limit: ``batch`` requests, ``num_chunks`` chunks, the longest
    ``max_chunk_len`` tokens, sys ``max_sys_len``, ``question_tokens`` each."""
    first = Shape(b.max_sys_len, (b.max_chunk_len,) + (SHORT,) * (b.num_chunks - 1), b.question_tokens)
    return [first] + [Shape(b.max_sys_len, (SHORT,), b.question_tokens)] * (b.batch - 1)


def partial_shapes(b: Bucket) -> list[Shape]:
    """Each axis one past the grid's next smaller value (or small, where there is none): below the
    bucket's limits, yet held by no smaller bucket."""
    def above_smaller(axis: str, floor: int) -> int:
        values = [getattr(x, axis) for x in GRID.buckets if getattr(x, axis) < getattr(b, axis)]
        return max(values) + 1 if values else floor

    first = Shape(40, (above_smaller("max_chunk_len", 60),) + (SHORT,) * (above_smaller("num_chunks", 1) - 1),
                  above_smaller("question_tokens", 5))
    return [first] + [Shape(12, (SHORT,), 3)] * (b.batch - 1)


def as_request_shape(s: Shape) -> RequestShape:
    return RequestShape(s.sys, s.chunks, s.question)


BUCKETS = sorted(GRID.buckets)


@pytest.mark.parametrize("fill", ["boundary", "partial"])
@pytest.mark.parametrize("bucket", BUCKETS, ids=[b.name for b in BUCKETS])
def test_every_bucket_replays_and_equals_eager_and_the_oracle(bucket, fill, gc_llm, oracle, tokens):
    shapes = (boundary_shapes if fill == "boundary" else partial_shapes)(bucket)
    assert GRID.bucket_for([as_request_shape(s) for s in shapes]) == bucket
    prompts, questions, replayed, segs, delta = run_question_step(gc_llm, tokens, shapes)
    exact = sum(s.question for s in shapes) == bucket.num_tokens
    assert exact == (fill == "boundary")
    assert delta == {"graph_replays": int(exact), "graph_padded": int(not exact), "graph_eager": 0,
                     "buckets": {bucket.name: 1}}
    for out, seg in zip(replayed, segs):
        assert_matches_oracle(out, seg, oracle, MAX_TOKENS)

    gc_llm.use_templates(False)
    try:
        eager, _, eager_delta = generate(gc_llm, prompts, questions, MAX_TOKENS)
    finally:
        gc_llm.use_templates(True)
    assert eager_delta == {"graph_replays": 0, "graph_padded": 0, "graph_eager": 0, "buckets": {}}
    for r, e in zip(replayed, eager):
        assert_same_completion(r, e)


def assert_same_completion(replayed, eager) -> None:
    a, b = replayed.outputs[0], eager.outputs[0]
    assert list(a.token_ids) == list(b.token_ids)
    for step, (top_a, top_b) in enumerate(zip(a.logprobs, b.logprobs)):
        shared = [t for t, lp in top_a.items() if lp.rank <= TOP_LOGPROBS and t in top_b]
        assert len(shared) >= TOP_LOGPROBS - 2
        diff = max(abs(top_a[t].logprob - top_b[t].logprob) for t in shared)
        assert diff <= (FIRST_TOKEN_TOL if step == 0 else LOGPROB_TOL), f"token {step}: {diff:.2e}"


@pytest.mark.parametrize("case", ["question_over", "chunk_over", "chunks_over", "sys_over", "batch_over", "mixed"])
def test_steps_outside_every_bucket_run_eager_exactly(case, gc_llm, oracle, tokens):
    widest = max(GRID.buckets, key=lambda b: (b.batch, b.num_chunks, b.max_chunk_len, b.max_sys_len,
                                              b.question_tokens))
    fits = Shape(20, (40, SHORT), 10)
    shapes = {
        "question_over": [Shape(20, (40,), widest.question_tokens + 1)],
        "chunk_over": [Shape(20, (widest.max_chunk_len + 1,), 10)],
        "chunks_over": [Shape(20, (SHORT,) * (widest.num_chunks + 1), 10)],
        "sys_over": [Shape(widest.max_sys_len + 1, (40,), 10)],
        "batch_over": [fits] * (widest.batch + 1),
        "mixed": [fits],
    }[case]
    ordinary = [tokens.take(30)] if case == "mixed" else []  # an ordinary prefill in the same step
    if case != "mixed":
        assert GRID.bucket_for([as_request_shape(s) for s in shapes]) is None
    _, _, outputs, segs, delta = run_question_step(gc_llm, tokens, shapes, ordinary)
    assert delta == {"graph_replays": 0, "graph_padded": 0, "graph_eager": 1, "buckets": {}}
    for out, seg in zip(outputs, segs):
        assert_matches_oracle(out, seg, oracle, MAX_TOKENS)


def test_captures_are_counted_and_published(gc_llm):
    manifest = gc_llm.templates_manifest()
    assert (manifest["backend"], manifest["checked"], manifest["captured_by"]) == ("compile", True, "graphchunk")
    assert manifest["vllm_graphs"]["compilation_mode"] == "DYNAMO_TRACE_ONCE"  # vLLM's own compilation stays on
    assert len(manifest["buckets"]) == len(GRID.buckets)
    assert {row["bucket"] for row in manifest["buckets"]} == {b.name for b in GRID.buckets}
    published = gc_llm.published_stats()
    assert published["graph_captures"] == gc_llm.stats()["graph_captures"] == len(GRID.buckets)
