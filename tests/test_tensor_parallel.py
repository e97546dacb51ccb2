"""Tensor parallelism through vLLM (TP=2 on CPU) on the tiny Llama-llama3 checkpoint, against the HF
oracle, in both modes.

vLLM's CPU worker binds each rank's OpenMP threads to cores; its default ('auto') binding wants a
NUMA node per rank ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" on this
one-node machine), so the test sets ``VLLM_CPU_OMP_THREADS_BIND`` as a user must (README, Limits):
one core per rank, ``0|1``.
"""
from __future__ import annotations

import os

import pytest
import torch

from exactness import LIMITS, assert_matches_oracle, assert_matches_reference, blend_reference, sampling
from graphchunk import models
from graphchunk.llm import RagPrompt
from graphchunk.oracle import Oracle
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_oracle_thread")]

DOCS = ["The assert statement is a convenient way to insert debugging assertions into a program.",
        "The pass statement is a null operation; nothing happens when it executes.",
        "The break statement may only occur syntactically nested in a for or while loop."]


@pytest.fixture(scope="module")
def tp_llm():
    from graphchunk import GraphChunkLLM

    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        llm = GraphChunkLLM(str(models.tiny_checkpoint("llama3")), dtype="float32", tensor_parallel_size=2,
                            max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 27,
                            block_size=32, graphchunk={"pool_tokens": 4096})
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    try:
        yield llm
    finally:
        llm.shutdown()


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
