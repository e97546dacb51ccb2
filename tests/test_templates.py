"""Bucket counts inside the engine: every bucket of the session grid (tests/data/templates.toml)
holds its steps — filled exactly to its limits, and partially (in the engine for the smallest and
the widest bucket, ``ENGINE_CASES``) — which run on vLLM's own compiled graph (the engine runs
without --enforce-eager), are counted once in their bucket and equal the oracle; steps outside
every bucket run the same way, exactly, and are counted outside the buckets. On CPU vLLM's one
compiled dynamic-shape graph runs every step at its own token count: each cached-chunk prefill
counts as replayed, none padded (on CUDA a partial fill would be padded to vLLM's next capture
size).

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
from exactness import LIMITS, TextSource, assert_matches_oracle, sampling
from graphchunk.engine.request_args import BOUNDARIES_ARG
from graphchunk.graphs.buckets import Bucket, RequestShape, load_grid
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

GRID = load_grid(str(GC_LLM_TEMPLATES))
MAX_TOKENS = 8
SHORT = 6  # tokens of each chunk but the longest
COUNTERS = ("graph_replays", "graph_padded", "graph_eager")
ON_VLLMS_GRAPH = {"graph_replays": 1, "graph_padded": 0, "graph_eager": 0}
"""How one cached-chunk prefill step counts on CPU with vLLM's compilation on: its graph, unpadded."""
OUTSIDE = ""
"""The manifest's ``outside_buckets`` row, as a bucket name in ``runs_by_bucket``."""


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
    """Outputs, segmentations and graph-counter deltas (and steps per bucket) of one generate call,
    ordinary prompts first."""
    inputs, params, segs = [{"prompt_token_ids": ids} for ids in ordinary], [sampling(max_tokens)] * len(ordinary), []
    for prompt, question in zip(prompts, questions):
        ids, seg = prompt.with_question(question)
        p = sampling(max_tokens)
        p.extra_args = {BOUNDARIES_ARG: prompt.boundaries}
        inputs.append({"prompt_token_ids": ids})
        params.append(p)
        segs.append(seg)
    before, by_bucket = llm.stats(), runs_by_bucket(llm)
    outputs = generate_in_one_step(llm, inputs, params)
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in COUNTERS}
    delta["buckets"] = {name: n - by_bucket[name] for name, n in runs_by_bucket(llm).items() if n != by_bucket[name]}
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


def runs_by_bucket(llm) -> dict[str, int]:
    """Cached-chunk prefill steps counted in each bucket (any outcome), and outside every bucket."""
    manifest = llm.templates_manifest()
    rows = [*manifest["buckets"], {"bucket": OUTSIDE, **manifest["outside_buckets"]}]
    return {row["bucket"]: row["replayed"] + row["padded"] + row["eager"] for row in rows}


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


FILLS = {"boundary": boundary_shapes, "partial": partial_shapes}
ENGINE_CASES = [(b, "boundary") for b in BUCKETS] + [(b, "partial") for b in (BUCKETS[0], BUCKETS[-1])]
"""Every bucket filled to its limits in the engine; partial fills in the engine for the smallest and
the widest bucket only: on CPU every step runs vLLM's one dynamic-shape graph, so a partial fill
takes the boundary fill's path there, and which bucket holds each partial shape is checked for every
bucket on the host (``test_every_bucket_holds_its_boundary_and_partial_shapes``)."""


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("bucket", BUCKETS, ids=[b.name for b in BUCKETS])
def test_every_bucket_holds_its_boundary_and_partial_shapes(bucket, fill):
    shapes = FILLS[fill](bucket)
    assert GRID.bucket_for([as_request_shape(s) for s in shapes]) == bucket
    exact = sum(s.question for s in shapes) == bucket.num_tokens
    assert exact == (fill == "boundary")


@pytest.mark.parametrize(("bucket", "fill"), ENGINE_CASES, ids=[f"{b.name}-{fill}" for b, fill in ENGINE_CASES])
def test_every_bucket_counts_its_steps_on_vllms_graph_and_equals_the_oracle(bucket, fill, gc_llm, oracle, tokens):
    shapes = FILLS[fill](bucket)
    assert GRID.bucket_for([as_request_shape(s) for s in shapes]) == bucket
    _, _, outputs, segs, delta = run_question_step(gc_llm, tokens, shapes)
    assert delta == {**ON_VLLMS_GRAPH, "buckets": {bucket.name: 1}}
    for out, seg in zip(outputs, segs):
        assert_matches_oracle(out, seg, oracle, MAX_TOKENS)


@pytest.mark.parametrize("case", ["question_over", "chunk_over", "chunks_over", "sys_over", "batch_over", "mixed"])
def test_steps_outside_every_bucket_run_exactly_and_count_outside(case, gc_llm, oracle, tokens):
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
    assert delta == {**ON_VLLMS_GRAPH, "buckets": {OUTSIDE: 1}}
    for out, seg in zip(outputs, segs):
        assert_matches_oracle(out, seg, oracle, MAX_TOKENS)


def test_the_manifest_lists_the_grid_and_vllms_graphs_and_the_counters_are_published(gc_llm):
    manifest = gc_llm.templates_manifest()
    assert set(manifest) == {"grid", "backend", "vllm_graphs", "buckets", "outside_buckets"}
    assert (manifest["grid"], manifest["backend"]) == (str(GC_LLM_TEMPLATES), "vllm")
    assert manifest["vllm_graphs"]["compilation_mode"] == "DYNAMO_TRACE_ONCE"  # vLLM's own compilation stays on
    assert [row["bucket"] for row in manifest["buckets"]] == [b.name for b in GRID.buckets]
    stats, published = gc_llm.stats(), gc_llm.published_stats()
    assert {k: published[k] for k in COUNTERS} == {k: stats[k] for k in COUNTERS}
    assert stats["graph_replays"] + stats["graph_padded"] + stats["graph_eager"] == sum(runs_by_bucket(gc_llm).values())
