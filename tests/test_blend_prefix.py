"""Blend chunks computed after a fixed prefix (``blend_prefix``) through an engine, against HF.

Every blend chunk's entry holds ``prefix ‖ chunk`` computed from position 0 (DESIGN.md §2's fixed
model-level prefix); a request reuses the chunk's tokens, keys moved from where they sat after the
prefix to where the chunk lands. The oracle builds the same context independently
(``Oracle.prefixed_kv``: HF's causal forward of ``prefix ‖ chunk``, keys moved by HF's own rotary
embedding), ranks by the question's attention over it and recomputes what the policy picks.
"""
from __future__ import annotations

import numpy as np
import pytest

import engines
from exactness import LIMITS, MAX_TOKENS, Reference, assert_matches_reference, joined_sources, sampling
from graphchunk.blend.recompute import cacheblend_tokens
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

PREFIX = "Here is a document.\n\n"
QUESTION = {"graphchunk_mode": "blend", "graphchunk_recompute": "question", "graphchunk_recompute_ratio": 0.3,
            "graphchunk_recompute_block": 1}  # single tokens: the oracle picks them (``cacheblend_tokens``)


def build_prefix_llm():
    """An engine of its own (blend_prefix is a deployment setting), eager to start fast; its blend
    requests wait for their misses (blend_misses 'blend'), so a first request blends too."""
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(str(models.smollm2_path()), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=1 << 29,
                         enforce_eager=True, max_num_batched_tokens=512, enable_prefix_caching=True,
                         graphchunk={"pool_tokens": 8192, "mode": "blend", "blend_misses": "blend",
                                     "blend_prefix": PREFIX})


prefix_llm = engines.fixture(build_prefix_llm, "prefix_llm")


def test_chunks_computed_after_the_prefix_are_blended_as_hf_does(prefix_llm, oracle, paragraphs, tokenizer):
    """A first request (every chunk a miss, computed after the prefix) and the same documents
    reordered behind another sys prompt (hits, moved elsewhere): each equals HF blending over
    ``prefixed_kv`` with the question policy's 30 % picked by HF's attention over it; the
    chunks-alone reference gives other logprobs."""
    text = joined_sources(paragraphs, tokenizer, 12)
    a, b = text.text(110), text.text(80)
    prefix_ids = tokenizer(PREFIX, add_special_tokens=False)["input_ids"]
    prompts = [RagPrompt("Answer from the documents.", [a, b], "Question: what do they describe?\nAnswer:",
                         extra=QUESTION),
               RagPrompt("Use only these.", [b, a], "Question: which comes first?\nAnswer:", extra=QUESTION)]
    for n, prompt in enumerate(prompts):
        before = prefix_llm.stats()
        outputs = prefix_llm.generate([prompt], sampling())
        after = prefix_llm.stats()
        seg = split_at(*prefix_llm.encode(prompt), **LIMITS)
        ids, lay = list(seg.token_ids), seg.layout
        assert (after["blend_hits"] - before["blend_hits"], after["blend_misses"] - before["blend_misses"]) == \
            ((0, 2) if n == 0 else (2, 0))
        context = oracle.prefixed_kv(ids, lay, prefix_ids)
        chunk_tokens = np.arange(lay.sys_len, lay.context_len)
        scores = oracle.question_attention(ids, lay, context_kv=context)
        picked = cacheblend_tokens(chunk_tokens, scores[chunk_tokens], 0.3)
        assert after["blend_tokens_recomputed"] - before["blend_tokens_recomputed"] == len(picked)
        tokens, logprobs = oracle.blend_generate(ids, lay, picked, MAX_TOKENS, context_kv=context)
        assert_matches_reference(outputs[0], Reference(tokens, logprobs), f"request {n} over prefixed entries")
        _, alone = oracle.blend_generate(ids, lay, picked, 1)
        assert (alone[0] - logprobs[0]).abs().max() > 0.05
