"""Tensor parallelism through vLLM (TP=2 on CPU) on the tiny Llama-llama3 checkpoint, against the HF
oracle, in both modes.

vLLM's CPU worker binds each rank's OpenMP threads to cores; its default ('auto') binding wants a
NUMA node per rank ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" on this
one-node machine), so the test sets ``VLLM_CPU_OMP_THREADS_BIND`` as a user must (README, Limits):
one core per rank, ``0|1``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import numpy as np

import engines
from exactness import (LIMITS, MAX_TOKENS, Reference, assert_matches_oracle, assert_matches_reference,
                       blend_reference, reference, sampling)
from graphchunk.blend.recompute import cacheblend_tokens
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.reference.oracle import Oracle
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

DOCS = ["The assert statement is a convenient way to insert debugging assertions into a program.",
        "The pass statement is a null operation; nothing happens when it executes.",
        "The break statement may only occur syntactically nested in a for or while loop."]


def build_tp_llm():
    """An engine of its own (TP=2), started ahead (``engines``) with the binding in its processes'
    environment only."""
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(str(models.tiny_checkpoint("llama3")), dtype="float32", tensor_parallel_size=2,
                         max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 27, block_size=32,
                         graphchunk={"pool_tokens": 4096, "store_path": str(engines.scratch("tp-tier")),
                                     "mode": "isolated"})


tp_llm = engines.fixture(build_tp_llm, "tp_llm", environment={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


@pytest.fixture(scope="module")
def tp_store(tp_llm):
    return Path(tp_llm.config.store_path)


@pytest.fixture(scope="module")
def tiny_oracle():
    return Oracle(models.tiny_checkpoint("llama3"), dtype=torch.float32)


def test_both_modes_match_the_oracle_with_tp2(tp_llm, tiny_oracle):
    """Each mode: two prompts over the same documents in one batch (the second reuses the first's
    chunk KV; blend even behind another system prompt), every generated token against HF."""
    question = "Which statement does nothing?"
    cases = {"isolated": ({"graphchunk_mode": "isolated"}, ["Answer from the documents.", "Answer from the documents."]),
             "blend": ({"graphchunk_mode": "blend", "graphchunk_recompute": "legolink",
                        "graphchunk_recompute_tokens": 2}, ["Answer from the documents.", "Be brief."])}
    for mode, (extra, systems) in cases.items():
        batch = [RagPrompt(systems[0], DOCS, question, extra=extra),
                 RagPrompt(systems[1], DOCS[::-1], question, extra=extra)]
        before = tp_llm.stats()
        outputs = tp_llm.generate(batch, sampling())
        after = tp_llm.stats()
        for output, prompt in zip(outputs, batch):
            seg = split_at(*tp_llm.encode(prompt), **LIMITS)
            if mode == "isolated":
                assert_matches_oracle(output, seg, tiny_oracle)
            else:
                assert_matches_reference(output, blend_reference(tiny_oracle, seg, "legolink:2"), mode)
        assert after["hits"] - before["hits"] == len(DOCS), mode
        assert after["misses"] - before["misses"] == len(DOCS), mode


def test_key_temperature_and_question_policy_with_tp2(tp_llm, tiny_oracle):
    """Isolated mode at a key temperature (each rank divides its heads' keys) and the question-aware
    recompute policy (each rank scores with its heads; the scores are summed over ranks, so both
    recompute the same tokens) against HF."""
    question = "Which statement may only occur in a loop?"
    hot = RagPrompt("Answer from the documents.", DOCS[::-1], question,
                    extra={"graphchunk_mode": "isolated", "graphchunk_key_temperature": 0.7})
    asked = RagPrompt("Be brief.", DOCS, question, extra={"graphchunk_mode": "blend", "graphchunk_recompute": "question",
                                                          "graphchunk_recompute_ratio": 0.3, "graphchunk_recompute_block": 1})
    hot_out, asked_out = tp_llm.generate([hot, asked], sampling())
    seg = split_at(*tp_llm.encode(hot), **LIMITS)
    assert_matches_reference(hot_out, reference(tiny_oracle, seg, MAX_TOKENS, 0.7), "isolated T=0.7")
    seg = split_at(*tp_llm.encode(asked), **LIMITS)
    lay = seg.layout
    chunk_tokens = np.arange(lay.sys_len, lay.context_len)
    scores = tiny_oracle.question_attention(list(seg.token_ids), lay)[chunk_tokens]
    picked = cacheblend_tokens(chunk_tokens, scores, 0.3)
    ranked = np.sort(scores)[::-1]
    assert ranked[len(picked) - 1] - ranked[len(picked)] > 1e-3 * ranked[0], "no near-tie at the cut"
    tokens, logprobs = tiny_oracle.blend_generate(list(seg.token_ids), lay, picked, MAX_TOKENS)
    assert_matches_reference(asked_out, Reference(tokens, logprobs), "question r=0.3")


def test_tier_serves_an_entry_only_when_every_rank_has_its_file(tp_llm, tiny_oracle, tp_store):
    """Each rank stores its heads' share; a miss is computed by a forward both ranks join, so a
    file rank 1 cannot serve (corrupt) makes both compute that chunk — no hang, exact output."""
    sys_prompt, question = "Use the documents.", "Which statement is a null operation?"
    extra_docs = ["The continue statement continues with the next cycle of the nearest enclosing loop.",
                  "The del statement deletes names, attributes or items."]

    def ask(chunks):
        prompt = RagPrompt(sys_prompt, chunks, question)
        before = tp_llm.stats()
        (output,) = tp_llm.generate([prompt], sampling())
        assert_matches_oracle(output, split_at(*tp_llm.encode(prompt), **LIMITS), tiny_oracle)
        after = tp_llm.stats()
        return {name: after[name] - before[name] for name in ("misses", "hits", "tier_hits", "tier_writes")}

    ask([DOCS[0]])  # stores the sys prompt (and DOCS[0]) on both ranks
    before = set(tp_store.rglob("*.gckv"))
    assert ask(extra_docs[:1]) == {"misses": 1, "hits": 0, "tier_hits": 0, "tier_writes": 1}
    new = sorted(set(tp_store.rglob("*.gckv")) - before)
    assert [p.name[-8:] for p in new] == ["-r0.gckv", "-r1.gckv"]
    ask(extra_docs[1:])
    tp_llm.reset_pool()
    assert ask([DOCS[0], *extra_docs]) == {"misses": 0, "hits": 0, "tier_hits": 3, "tier_writes": 0}
    raw = bytearray(new[1].read_bytes())  # rank 1's file of extra_docs[0]
    raw[len(raw) // 2] ^= 0xFF
    new[1].write_bytes(bytes(raw))
    tp_llm.reset_pool()
    assert ask([extra_docs[1], extra_docs[0], DOCS[0]]) == {"misses": 1, "hits": 0, "tier_hits": 2, "tier_writes": 1}
    assert all(p.exists() for p in new)  # rank 1 removed its corrupt file and both wrote theirs again
