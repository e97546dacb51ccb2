"""Host memory alone below the pool (``host_bytes``, no ``store_path``) in a real engine: a pool
that holds one context at a time evicts a request's chunks, and the next request over them finds
them in host memory (tier hits, nothing computed but the question), copied from there into its own
slots without a pool block, its answer equal to the HF oracle's (isolated: the masked reference;
blend: LegoLink's, the chunks' keys moved to where they land on the way).

Tiny Llama-llama3 checkpoint in fp32, one ``GraphChunkLLM``; short prompts whose chunk entries take
two pool blocks each (the sys prompt fills most of its block), so that the pool's seven blocks hold
the sys entry and three chunks: the second request's three chunks evict both of the first's.
"""
from __future__ import annotations

import pytest
import torch

import engines
from exactness import LIMITS, assert_matches_oracle, assert_matches_reference, blend_reference, sampling
from graphchunk.config import GraphChunkConfig
from graphchunk.cache.context_plan import context_blocks
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.reference.oracle import Oracle
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

BLOCK = 32
POOL_BLOCKS = 7
"""The least a pool may be at max_model_len 128 and max_chunk_len 64 (``worker.min_pool_blocks``)."""
SYS = ("Answer the question from the documents below. Be brief, quote the document you use, and say so when "
       "none of the documents holds the answer.")
DOCS = ["The river flows north past the old mill and the bridge.",
        "Copper wire carries current with little loss over short runs.",
        "The library opens at nine and closes at six on weekdays.",
        "Bees build wax combs of hexagonal cells to store honey.",
        "A glacier moves a few meters each year down the valley."]
QUESTION = "Which document is about water?"


def build_host_llm():
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(str(models.tiny_checkpoint("llama3")),
                         graphchunk={"pool_tokens": POOL_BLOCKS * BLOCK, "host_bytes": 16 << 20, "mode": "isolated",
                                     "max_chunk_len": 64},
                         dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory_bytes=1 << 26,
                         block_size=BLOCK)


host_llm = engines.fixture(build_host_llm, "host_llm")


@pytest.fixture(scope="module")
def tiny_oracle():
    return Oracle(str(models.tiny_checkpoint("llama3")), dtype=torch.float32)


LEGOLINK = {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink"}


def run(llm, oracle, prompt: RagPrompt, blocks: int) -> dict[str, float]:
    """Generates ``prompt`` (its context taking ``blocks`` pool blocks), checks it against the
    oracle (isolated: the masked reference; blend: LegoLink's at the default token count), returns
    how the counters moved."""
    ids, boundaries = llm.encode(prompt)
    seg = split_at(ids, boundaries, **LIMITS)
    blend = prompt.extra.get("graphchunk_mode") == "blend"
    assert context_blocks(seg, "blend" if blend else "isolated", BLOCK) == blocks, \
        "the prompts no longer take the blocks planned"
    params = sampling()
    params.extra_args = {**prompt.extra, "graphchunk_boundaries": boundaries}
    before = llm.stats()
    (output,) = llm.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    after = llm.stats()
    if blend:
        k = GraphChunkConfig().recompute_tokens
        assert_matches_reference(output, blend_reference(oracle, seg, f"legolink:{k}"), "blend")
    else:
        assert_matches_oracle(output, seg, oracle)
    return {name: after[name] - before[name] for name in after}


def test_chunks_evicted_from_the_pool_come_back_from_host_memory(host_llm, tiny_oracle):
    first = run(host_llm, tiny_oracle, RagPrompt(SYS, DOCS[:2], QUESTION), blocks=5)
    assert (first["misses"], first["tier_hits"]) == (2, 0)
    assert host_llm.stats()["tier_host_bytes"] > 0  # written through as computed
    second = run(host_llm, tiny_oracle, RagPrompt(SYS, DOCS[2:], QUESTION), blocks=POOL_BLOCKS)
    assert second["misses"] == 3 and second["evictions"] >= 2
    again = run(host_llm, tiny_oracle, RagPrompt(SYS, DOCS[1::-1], QUESTION), blocks=5)
    assert (again["tier_hits"], again["hits"], again["misses"]) == (2, 0, 0)
    assert again["tier_host_hits"] == again["tier_loads"] == 2
    assert again["tokens_computed"] < 20  # only the question: the chunks were copied from host memory


def test_blend_chunks_come_back_from_host_memory_moved_where_they_land(host_llm, tiny_oracle):
    """Blend chunks gone from the pool (reset: host memory keeps its entries) are copied from host
    memory into the request's slots, their keys rotated to where they land (not where the first
    request had them), taking no pool block."""
    first = run(host_llm, tiny_oracle, RagPrompt(SYS, DOCS[3:], QUESTION, extra=LEGOLINK), blocks=3)
    assert first["blend_misses"] == 2
    host_llm.reset_pool()  # every entry unused: the pool is empty
    again = run(host_llm, tiny_oracle, RagPrompt(SYS, DOCS[:2:-1], QUESTION, extra=LEGOLINK), blocks=3)
    assert (again["blend_tier_hits"], again["blend_hits"], again["misses"]) == (2, 0, 0)
    assert again["tier_host_hits"] == 3  # the two chunks, and the sys prompt (into the pool: chunk jobs read it there)
    assert host_llm.stats()["pool_blocks_used"] == 1  # the sys prompt's block; the chunks took none
