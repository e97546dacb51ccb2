"""Blend entries taken from a full prefill (``blend_entries`` 'context') through an engine, against HF.

A blend request whose misses outweigh its prefill runs as vLLM's full prefill; with 'context' its
missing entries are filled from that prefill's own KV after its forward (``EntryCapture``): each
chunk as it was computed there, attending to the system prompt and documents before it, moved
back to [0, L). The oracle builds the same context independently (``Oracle.contextual_kv``: HF's
causal forward of the first prompt, each chunk's keys moved by HF's own rotary embedding), ranks
by the question's attention over it and recomputes what the policy picks.
"""
from __future__ import annotations

import numpy as np
import pytest

import engines
from exactness import LIMITS, MAX_TOKENS, Reference, assert_matches_reference, blend_reference, joined_sources, \
    measured, sampling  # noqa: F401
from graphchunk.blend.recompute import cacheblend_tokens
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

QUESTION = {"graphchunk_mode": "blend", "graphchunk_recompute": "question", "graphchunk_recompute_ratio": 0.3,
            "graphchunk_recompute_block": 1}  # single tokens: the oracle picks them (``cacheblend_tokens``)


def build_context_llm():
    """An engine of its own (blend_entries is a deployment setting), eager to start fast."""
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(str(models.smollm2_path()), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=1 << 29,
                         enforce_eager=True, max_num_batched_tokens=512, enable_prefix_caching=True,
                         graphchunk={"pool_tokens": 8192, "mode": "blend", "blend_entries": "context"})


context_llm = engines.fixture(build_context_llm, "context_llm")


def test_the_oracle_s_contextual_kv_moves_keys_as_hf_computes_them(oracle, paragraphs, tokenizer):
    """Its own check: a prompt's chunks taken from the prompt itself are its causal forward (nothing
    moves); taken from a prompt with them in another order, moved, they are not (the documents
    before each differ), but close."""
    text = joined_sources(paragraphs, tokenizer, 13)
    docs = [text.text(n) for n in (40, 60, 30)]
    seg = split_at(*_encode(tokenizer, RagPrompt(text.text(10), docs, text.question(3))), **LIMITS)
    other = split_at(*_encode(tokenizer, RagPrompt(text.text(10), docs[::-1], text.question(3))), **LIMITS)
    ids, lay = list(seg.token_ids), seg.layout
    causal = oracle.causal_generate(ids, 2)[1]
    same = oracle.blend_generate(ids, lay, (), 2, context_kv=oracle.contextual_kv(ids, lay, ids, lay))[1]
    moved = oracle.blend_generate(ids, lay, (), 2, context_kv=oracle.contextual_kv(ids, lay, list(other.token_ids),
                                                                                   other.layout))[1]
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(causal, same))
    assert 1e-3 < (moved[0] - causal[0]).abs().max() < 5


def test_a_full_prefill_s_chunks_are_captured_and_blended_from_as_hf_does(context_llm, oracle, paragraphs, tokenizer):
    """First request (misses, under one tenant's cache_salt): vLLM's full prefill, equal to HF's
    causal forward, its sys prompt and two chunks captured (nothing computed alone). The same documents reordered behind another
    question: pool hits, blended over the captured KV exactly as HF blends over the first prompt's
    KV moved, the question policy's 30 % picked by HF's attention over it; the chunks-alone
    reference gives other logprobs."""
    text = joined_sources(paragraphs, tokenizer, 13)
    a, b, sys = text.text(120), text.text(90), "Answer from the documents."
    first = RagPrompt(sys, [a, b], "Question: what do they describe?\nAnswer:", extra=QUESTION, cache_salt="tenant")
    before = context_llm.stats()
    outputs = context_llm.generate([first], sampling())
    seg1 = split_at(*context_llm.encode(first), **LIMITS)
    assert_matches_reference(outputs[0], blend_reference(oracle, seg1, "causal"), "full prefill")
    after = context_llm.stats()
    assert after["blend_full_prefills"] - before["blend_full_prefills"] == 1
    assert [after[k] - before[k] for k in ("blend_entries_captured", "blend_misses", "blend_tokens_recomputed")] == \
        [3, 2, 0]
    again = RagPrompt(sys, [b, a], "Question: which comes first?\nAnswer:", extra=QUESTION, cache_salt="tenant")
    outputs = context_llm.generate([again], sampling())
    seg = split_at(*context_llm.encode(again), **LIMITS)
    ids, lay = list(seg.token_ids), seg.layout
    done = context_llm.stats()
    assert (done["blend_hits"] - after["blend_hits"], done["blend_misses"] - after["blend_misses"]) == (2, 0)
    context = oracle.contextual_kv(ids, lay, list(seg1.token_ids), seg1.layout)
    chunk_tokens = np.arange(lay.sys_len, lay.context_len)
    scores = oracle.question_attention(ids, lay, context_kv=context)
    picked = cacheblend_tokens(chunk_tokens, scores[chunk_tokens], 0.3)
    assert done["blend_tokens_recomputed"] - after["blend_tokens_recomputed"] == len(picked)
    tokens, logprobs = oracle.blend_generate(ids, lay, picked, MAX_TOKENS, context_kv=context)
    assert_matches_reference(outputs[0], Reference(tokens, logprobs), "blend over captured entries")
    _, alone = oracle.blend_generate(ids, lay, picked, 1)
    assert (alone[0] - logprobs[0]).abs().max() > 0.05


def test_no_request_shapes_another_tenant_s_blend_entries(context_llm, paragraphs, tokenizer):
    """DESIGN.md §2 (the attacker/victim scenario of issue 46): a victim asks twice over two
    documents (its first request a full prefill, its second blended over the pool's entries). An
    attacker sent the same documents first behind a document of its own; under another cache_salt,
    or with neither request salted, the victim's second answer is what it is with no attacker at
    all (entries are captured only inside one salt; unsalted requests use entries computed alone).
    Inside one salt the attacker's context does reach the victim: the check can fail."""
    text = joined_sources(paragraphs, tokenizer, 31)
    a, b, planted, sys = text.text(100), text.text(80), text.text(90), "Answer from the documents."
    first, second = "Question: what do they describe?\nAnswer:", "Question: which comes first?\nAnswer:"

    def victim(salt, attacker_salt=..., tokens: int = 4):
        context_llm.reset_pool()
        if attacker_salt is not ...:
            context_llm.generate([RagPrompt(sys, [planted, a, b], first, extra=QUESTION, cache_salt=attacker_salt)],
                                 sampling(1))
        context_llm.generate([RagPrompt(sys, [a, b], first, extra=QUESTION, cache_salt=salt)], sampling(1))
        out = context_llm.generate([RagPrompt(sys, [b, a], second, extra=QUESTION, cache_salt=salt)],
                                   sampling(tokens))[0].outputs[0]
        return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]

    def assert_same(got, alone, what):
        assert got[0] == alone[0], what
        assert max(abs(x - y) for x, y in zip(got[1], alone[1])) < 1e-4, (what, got, alone)

    assert_same(victim("victim", "attacker"), victim("victim"), "under distinct salts")
    assert_same(victim(None, None), victim(None), "with no salt")
    shared = victim("victim", "victim")  # one tenant: its own requests shape each other's entries
    assert max(abs(x - y) for x, y in zip(shared[1], victim("victim")[1])) > 1e-3


def _encode(tokenizer, prompt):
    from graphchunk.llm import encode_prompt

    return encode_prompt(tokenizer, prompt)
