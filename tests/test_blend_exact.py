"""Blend mode through the engine against independent HF references (DESIGN.md §2, blend).

Recomputing every chunk token must equal HF's plain causal forward (full prefill), recomputing none
must equal naive reuse (HF prefilling each chunk alone at the positions where it lands, so no
rotation of ours is involved), both for first requests (misses), repeats and reordered chunks behind
a system prompt the chunks were never cached with. The same session engine as the isolated-mode
tests (``gc_llm``: 256 tokens per step, prefix caching on, templates) serves both modes at once.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from exactness import (BLEND_FULL, BLEND_NONE, FIRST_TOKEN_TOL, LIMITS, LOGPROB_TOL, MAX_TOKENS, Reference,
                       assert_matches_oracle, assert_matches_reference, blend_reference,
                       joined_sources, measured, sampling)  # noqa: F401
from graphchunk.blend.recompute import RecomputePolicy, cacheblend_tokens, select_tokens
from graphchunk.config import GraphChunkConfig
from graphchunk.device import consecutive_runs
from graphchunk.engine.request_args import BOUNDARIES_ARG
from graphchunk.llm import RagPrompt
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

ISOLATED = {"graphchunk_mode": "isolated"}
COUNTERS = ("lookups", "hits", "misses", "blend_lookups", "blend_hits", "blend_misses", "blend_tokens_recomputed",
            "blend_tokens_checked", "blend_tokens_scored", "blend_question_fallbacks")


@pytest.fixture(scope="module")
def text(paragraphs, tokenizer):
    return joined_sources(paragraphs, tokenizer, 14, 15)  # no other engine module reads sources 14 and 15


@pytest.fixture(scope="module")
def docs(text):
    """Chunks of 20-220 tokens: prompts of 3-4 of them exceed a step's 256 tokens (chunked prefill)."""
    return [text.text(n) for n in (60, 220, 35, 140, 90, 20, 180, 75, 50, 110, 30, 160)]


def generate(llm, prompts, extra):
    """(outputs, segmentations, counter deltas) for RagPrompts sent with ``extra`` args each."""
    prompts = [RagPrompt(p.sys, p.chunks, p.question, extra={**p.extra, **extra}) for p in prompts]
    before = llm.stats()
    outputs = llm.generate(prompts, sampling())
    after = llm.stats()
    segs = [split_at(*llm.encode(p), **LIMITS) for p in prompts]
    return outputs, segs, {name: after[name] - before[name] for name in COUNTERS}


def check(outputs, segs, oracle, kind):
    for output, seg in zip(outputs, segs):
        assert_matches_reference(output, blend_reference(oracle, seg, kind), f"{kind}: layout {seg.layout}")


def test_full_recompute_equals_causal_oracle(gc_llm, oracle, docs, text):
    """First requests (every chunk misses), then the same chunks reordered behind a sys prompt not
    seen before (every chunk hits: blend keys have no sys) — all equal full prefill."""
    prompts = [RagPrompt(text.text(12), docs[0:3], text.question(10)),
               RagPrompt("", docs[3:5], text.question(8))]
    outputs, segs, delta = generate(gc_llm, prompts, BLEND_FULL)
    check(outputs, segs, oracle, "causal")
    assert delta["blend_misses"] == 5 and delta["blend_hits"] == delta["lookups"] - 5
    reordered = [RagPrompt(text.text(20), [docs[4], docs[2], docs[0], docs[3]], text.question(9))]
    outputs, segs, delta = generate(gc_llm, reordered, BLEND_FULL)
    check(outputs, segs, oracle, "causal")
    assert delta["blend_misses"] == 0 and delta["blend_hits"] >= 4
    assert delta["blend_tokens_recomputed"] == sum(segs[0].layout.chunk_lens)


def test_no_recompute_equals_naive_reuse(gc_llm, oracle, docs, text):
    sys = text.text(15)
    first = [RagPrompt(sys, docs[5:8], text.question(10))]
    outputs, segs, delta = generate(gc_llm, first, BLEND_NONE)
    check(outputs, segs, oracle, "naive")
    assert delta["blend_misses"] == 3 and delta["blend_tokens_recomputed"] == 0
    reordered = [RagPrompt(text.text(7), [docs[7], docs[5], docs[6]], first[0].question)]
    outputs, segs, delta = generate(gc_llm, reordered, {**BLEND_NONE, "graphchunk_recompute": "cacheblend",
                                                        "graphchunk_recompute_ratio": 0.0})
    check(outputs, segs, oracle, "naive")
    assert delta["blend_misses"] == 0
    # The references differ, so the two checks above could not both pass with one wrong mode.
    causal, naive = (blend_reference(oracle, segs[0], kind) for kind in ("causal", "naive"))
    assert (causal.logprobs[0] - naive.logprobs[0]).abs().max() > 0.05


def test_legolink_covering_every_token_equals_causal(gc_llm, oracle, docs, text):
    """LegoLink with k at least every chunk's length recomputes every chunk token."""
    prompts = [RagPrompt(text.text(10), [docs[8], docs[9]], text.question(8))]
    outputs, segs, delta = generate(gc_llm, prompts, {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink",
                                                      "graphchunk_recompute_tokens": 512})
    check(outputs, segs, oracle, "causal")
    assert delta["blend_tokens_recomputed"] == sum(segs[0].layout.chunk_lens)


@pytest.mark.parametrize("k", [1, 4])
def test_legolink_equals_recomputing_chunk_starts_in_hf(gc_llm, oracle, docs, text, k):
    """LegoLink's first k tokens of every chunk, in one step and across chunked-prefill steps,
    against HF running exactly those tokens and the question over the reused KV (an explicit
    "earlier position" mask): the recomputed runs see each other's fresh KV as they must."""
    prompts = [RagPrompt(text.text(10), [docs[1], docs[3], docs[6]], text.question(7)),  # > 256 tokens
               RagPrompt("", [docs[5], docs[9], docs[10]], text.question(9))]
    outputs, segs, delta = generate(gc_llm, prompts, {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink",
                                                      "graphchunk_recompute_tokens": k})
    assert segs[0].layout.num_tokens > 256 >= segs[1].layout.num_tokens
    check(outputs, segs, oracle, f"legolink:{k}")
    assert delta["blend_tokens_recomputed"] == 6 * k


@pytest.mark.parametrize("refinement", [{}, {"graphchunk_recompute_sinks": 3, "graphchunk_recompute_spread": "chunk"},
                                        {"graphchunk_recompute_layers": 2, "graphchunk_recompute_block": 1}])
def test_question_policy_recomputes_what_the_question_attends_to_in_hf(gc_llm, oracle, docs, text, refinement):
    """The question-aware policy (r = 0.3 in the deployment's blocks of 4, plain and with 3 sinks
    per chunk and the ratio per chunk; in single tokens scored through the first 2 layers only)
    against HF: HF's own attention probabilities of the question over the naively reused context,
    summed over its tokens, heads and layers (the first 2), rank the chunk tokens; HF recomputing exactly the tokens the rule picks by that
    ranking gives the engine's tokens and logprobs. The chunks are hits (moved from other
    positions) and the prompt fits one step."""
    prompts = [RagPrompt(text.text(9), [docs[8], docs[2], docs[7]], text.question(9))]
    generate(gc_llm, [RagPrompt(text.text(6), [docs[7], docs[8], docs[2]], "Warm?")], BLEND_NONE)
    policy = {"graphchunk_mode": "blend", "graphchunk_recompute": "question", "graphchunk_recompute_ratio": 0.3,
              **refinement}
    outputs, segs, delta = generate(gc_llm, prompts, policy)
    seg, lay = segs[0], segs[0].layout
    assert lay.num_tokens <= 256 and delta["blend_hits"] == 3
    chunk_tokens = np.arange(lay.sys_len, lay.context_len)
    layers = refinement.get("graphchunk_recompute_layers", 0)
    scores = oracle.question_attention(list(seg.token_ids), lay, num_layers=layers or None)
    rule = RecomputePolicy("question", 0.3, sinks=refinement.get("graphchunk_recompute_sinks", 0),
                           spread=refinement.get("graphchunk_recompute_spread", "context"), layers=layers,
                           block=refinement.get("graphchunk_recompute_block", GraphChunkConfig().recompute_block))
    picked = select_tokens(chunk_tokens, scores[chunk_tokens], rule, seg.bounds[1:-1])
    scattered = cacheblend_tokens(chunk_tokens, scores[chunk_tokens], 0.3)
    if "graphchunk_recompute_sinks" in refinement:  # every chunk's first 3 tokens, and its own share
        assert all(set(range(b, b + 3)) <= set(picked.tolist()) for b, _ in seg.bounds[1:-1])
    elif rule.block > 1:  # as many tokens in fewer runs
        assert len(picked) == len(scattered) and len(consecutive_runs(picked)) < len(consecutive_runs(scattered))
    else:
        assert picked.tolist() == scattered.tolist()
    if layers:  # the shallow pass picks other tokens than the full one: the engine followed the depth
        deep = oracle.question_attention(list(seg.token_ids), lay)
        assert set(picked.tolist()) != set(cacheblend_tokens(chunk_tokens, deep[chunk_tokens], 0.3).tolist())
    tokens, logprobs = oracle.blend_generate(list(seg.token_ids), lay, picked, MAX_TOKENS)
    assert_matches_reference(outputs[0], Reference(tokens, logprobs), f"question r=0.3 {refinement}")
    assert (delta["blend_tokens_recomputed"], delta["blend_tokens_scored"], delta["blend_tokens_checked"]) == \
        (len(picked), lay.question_len, 0)
    assert len(picked) == (math.ceil(0.3 * len(chunk_tokens)) if "graphchunk_recompute_spread" not in refinement else
                           sum(math.ceil(0.3 * (e - b)) for b, e in seg.bounds[1:-1]))
    # The set decides the answer's distribution: recomputing the question's least-attended tokens instead differs.
    other = cacheblend_tokens(chunk_tokens, -scores[chunk_tokens], 0.3)
    _, other_logprobs = oracle.blend_generate(list(seg.token_ids), lay, other, 1)
    assert (other_logprobs[0] - logprobs[0]).abs().max() > 0.05


def test_siblings_of_an_n_request_each_blend_their_whole_context(gc_llm, docs):
    """n = 2 with the question policy, every chunk a hit: vLLM copies the annotated request into
    two children, salt included; the engine core gives each child's salt its own request id
    (``plugin._distinct_sibling_salts``), so neither takes a prefix hit on the other's blended
    blocks: each ranks and recomputes its whole context, the same tokens, and both see the same
    first-token distribution (sharing the salt, the second child took a hit up to its last full
    context block and ranked only the rest). vLLM samples n > 1 only at a temperature above 0."""
    from vllm import SamplingParams

    policy = {"graphchunk_mode": "blend", "graphchunk_recompute": "question", "graphchunk_recompute_ratio": 0.3}
    generate(gc_llm, [RagPrompt("Warm the documents.", [docs[0], docs[3]], "Warm?")], BLEND_NONE)
    prompt = RagPrompt("Answer from the documents.", [docs[3], docs[0]], "Question: what do they describe?\nAnswer:",
                       extra=policy)  # (no new text: the module's sources are budgeted, see ``text``)
    before = gc_llm.stats()
    [output] = gc_llm.generate([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=2, logprobs=5, seed=0))
    delta = {name: gc_llm.stats()[name] - before[name] for name in COUNTERS}
    lay = split_at(*gc_llm.encode(prompt), **LIMITS).layout
    assert delta["blend_hits"] == 4
    assert delta["blend_tokens_recomputed"] == 2 * math.ceil(0.3 * (lay.context_len - lay.sys_len)), delta
    first, second = ({t: p.logprob for t, p in child.logprobs[0].items() if p.rank <= 5} for child in output.outputs)
    assert first.keys() == second.keys() and all(abs(first[t] - second[t]) < FIRST_TOKEN_TOL for t in first)


def test_a_request_whose_misses_outweigh_its_prefill_is_full_prefill_then_its_chunks_are_reused(gc_llm, oracle,
                                                                                               docs, text):
    """The default question policy (r = 0.3) on documents never seen: their misses and recompute
    cost more than the prompt's prefill, so vLLM computes its full prefill, which equals HF's
    causal forward (blend's target, exactly; nothing recomputed or scored); its chunks are computed
    for later requests meanwhile, and the same documents behind another question are pool hits,
    blended."""
    question = {"graphchunk_mode": "blend", "graphchunk_recompute": "question", "graphchunk_recompute_ratio": 0.3}
    a, b, sys = docs[7].upper(), docs[10].upper(), "Answer from the documents."  # chunks no test cached
    first = [RagPrompt(sys, [a, b], "Question: what do they describe?\nAnswer:")]
    before = gc_llm.stats()["blend_full_prefills"]
    outputs, segs, delta = generate(gc_llm, first, question)
    check(outputs, segs, oracle, "causal")
    assert gc_llm.stats()["blend_full_prefills"] - before == 1
    assert (delta["blend_misses"], delta["blend_tokens_recomputed"], delta["blend_tokens_scored"]) == (2, 0, 0)
    again = [RagPrompt(sys, [b, a], "Question: which comes first?\nAnswer:")]
    outputs, segs, delta = generate(gc_llm, again, question)
    assert gc_llm.stats()["blend_full_prefills"] - before == 1
    assert (delta["blend_hits"], delta["blend_misses"]) == (2, 0) and delta["blend_tokens_recomputed"] > 0


def test_cacheblend_counts(gc_llm, docs, text):
    """A prompt filled in one step: every chunk token through the check layers, ceil(r n) recomputed.
    Its chunks are cached first (else its misses and recompute would outweigh its prefill: vLLM's
    full prefill instead, ``blend_misses``)."""
    prompts = [RagPrompt(text.text(5), [docs[10], docs[5]], text.question(6))]
    generate(gc_llm, [RagPrompt("", [docs[5], docs[10]], "Warm?")], BLEND_NONE)
    _, segs, delta = generate(gc_llm, prompts, {"graphchunk_mode": "blend", "graphchunk_recompute": "cacheblend",
                                                "graphchunk_recompute_ratio": 0.3})
    n = sum(segs[0].layout.chunk_lens)
    assert segs[0].layout.num_tokens <= 256
    assert delta["blend_tokens_checked"] == n
    assert delta["blend_tokens_recomputed"] == math.ceil(0.3 * n)


def test_modes_never_share_entries_or_prefix_cache(gc_llm, oracle, docs, text):
    """One token sequence in isolated mode, blend (full, none) and as an ordinary prompt, with
    vLLM's prefix cache on: each equals its own reference, and blend lookups never hit isolated
    entries (nor the reverse)."""
    prompt = RagPrompt(text.text(20), [text.text(80), text.text(45)], text.question(8))
    outputs, segs, delta = generate(gc_llm, [prompt], ISOLATED)
    assert_matches_oracle(outputs[0], segs[0], oracle)
    assert delta["blend_lookups"] == 0
    outputs, segs, delta = generate(gc_llm, [prompt], BLEND_FULL)
    check(outputs, segs, oracle, "causal")
    assert delta["blend_misses"] == 2  # the isolated entries of the same chunks do not count
    outputs, segs, delta = generate(gc_llm, [prompt], BLEND_NONE)
    check(outputs, segs, oracle, "naive")
    assert delta["blend_misses"] == 0
    ids, _ = gc_llm.encode(prompt)
    ordinary = gc_llm.generate([{"prompt_token_ids": ids}], sampling())
    assert_matches_reference(ordinary[0], blend_reference(oracle, split_at(ids, [0], **LIMITS), "causal"))
    outputs, segs, delta = generate(gc_llm, [prompt], ISOLATED)
    assert_matches_oracle(outputs[0], segs[0], oracle)
    assert delta["misses"] == 0 and delta["blend_lookups"] == 0


def test_mixed_batch_and_cache_salt(gc_llm, oracle, docs, text):
    """Blend, isolated and ordinary requests in one step; a chunk two blend requests share is
    computed once; another cache_salt shares nothing."""
    shared, first, second = text.text(70), text.text(40), text.text(55)
    sys = text.text(9)
    prompts = [RagPrompt(sys, [shared, first], text.question(6), extra=BLEND_FULL),
               RagPrompt(text.text(11), [second, shared], text.question(7), extra=BLEND_FULL),
               RagPrompt(sys, [shared, docs[3]], text.question(5), extra=ISOLATED)]
    before = gc_llm.stats()
    ordinary_ids = gc_llm.encode(RagPrompt(sys, [docs[4]], text.question(5)))[0]
    outputs = gc_llm.generate([*prompts, {"prompt_token_ids": ordinary_ids}], sampling())
    after = gc_llm.stats()
    segs = [split_at(*gc_llm.encode(p), **LIMITS) for p in prompts]
    check(outputs[:2], segs[:2], oracle, "causal")
    assert_matches_oracle(outputs[2], segs[2], oracle)
    assert_matches_reference(outputs[3], blend_reference(oracle, split_at(ordinary_ids, [0], **LIMITS), "causal"))
    assert after["blend_misses"] - before["blend_misses"] == 3  # `shared` computed once

    def salted(salt):
        ids, boundaries = gc_llm.encode(prompts[0])
        params = sampling()
        params.extra_args = {BOUNDARIES_ARG: boundaries, **BLEND_FULL}
        return {"prompt_token_ids": ids, "cache_salt": salt}, params

    for salt, misses in (("tenant-a", 2), ("tenant-b", 2), ("tenant-a", 0)):
        before = gc_llm.stats()
        prompt, params = salted(salt)
        output = gc_llm.llm.generate([prompt], params)[0]
        assert gc_llm.stats()["blend_misses"] - before["blend_misses"] == misses, salt
        assert_matches_reference(output, blend_reference(oracle, segs[0], "causal"))


def test_role_hazard_in_blend_mode(gc_llm, oracle, text):
    """S ## A ## Q, then S ## A ## Q ## B ## Q2 with nothing recomputed: Q was a question (causal
    KV over S and A), now it is a chunk (KV computed alone). vLLM's prefix cache must not hand the
    second request the first one's KV for Q (a blend salt covers the whole context)."""
    sys, a, q, b = text.text(40), text.text(50), text.question(30), text.text(30)
    outputs, segs, _ = generate(gc_llm, [RagPrompt(sys, [a], q)], BLEND_NONE)
    check(outputs, segs, oracle, "naive")
    outputs, segs, _ = generate(gc_llm, [RagPrompt(sys, [a, q, b], text.question(6))], BLEND_NONE)
    check(outputs, segs, oracle, "naive")


def test_report_measured(measured):
    """Prints the largest logprob differences measured in this module (run with -s)."""
    print(f"\nblend: logprob max-abs diff vs HF references: first token {measured['first token']:.2e}, "
          f"all tokens {measured['all tokens']:.2e} over {measured['compared']} generated tokens; "
          f"tolerances {FIRST_TOKEN_TOL:.0e} / {LOGPROB_TOL:.0e}")
