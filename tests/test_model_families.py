"""Model families through a real vLLM engine, against the HF oracle (docs/models.md's table).

One tiny random-weight checkpoint per family (``graphchunk.reference.models.TINY_ARCHS``: 2 layers,
the SmolLM2 tokenizer), one engine per family (fp32, eager, a persistent tier), each checked:

* isolated mode equals the oracle's masked forward, a miss and then the chunks reordered (hits);
* blend: chunks cached behind one system prompt, then moved behind a longer one (keys re-rotated
  by ``KeyRotation`` from the family's own rotary module) with LegoLink's first 2 tokens of each
  chunk recomputed, equals HF computing every chunk alone where it lands and recomputing the same
  tokens (no rotation of ours involved); every chunk token recomputed equals HF's causal prefill;
* the tier: entries written, the pool emptied, the same chunks served from the tier's files.

A family whose keys cannot move refuses blend requests (isolated still served); sliding-window
families are refused at start-up unless served with vLLM's ``--disable-sliding-window``. vLLM 0.32
serves OLMo-2 through its Transformers modeling backend, whose rotary module (HF's) the worker's key
rotation does not read: its blend requests are refused where they are processed, and blend as the
deployment's default at start-up (``rope.blend_refusal``).
"""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import engines
from exactness import BLEND_FULL, BLEND_NONE, LIMITS, assert_matches_oracle, assert_matches_reference, \
    blend_reference, clear_references, measured, sampling  # noqa: F401
from graphchunk.blend.rope import hf_rope_refusal
from graphchunk.config import ConfigError
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.reference.oracle import Oracle
from graphchunk.segments import split_at

pytestmark = [pytest.mark.slow]

ENGINE = dict(dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=1 << 27, block_size=32)
NO_WINDOW = {"disable_sliding_window": True}
TWO_ROPES = "use different rotary embeddings"
HF_MODULES = "Transformers modeling backend"
FAMILIES = {
    # tiny checkpoint: (engine settings beyond ENGINE, blend: "moves" keys, or its refusal)
    "qwen2": ({}, "moves"),
    "qwen3": ({}, "moves"),
    "mistral": ({}, "moves"),
    "phi3": ({}, "moves"),
    "granite": ({}, "moves"),
    "olmo2": ({}, HF_MODULES),
    "glm4": ({}, "moves"),
    "gemma2": (NO_WINDOW, "moves"),
    "gemma3": (NO_WINDOW, TWO_ROPES),
    "qwen3_moe": ({}, "moves"),
    "mixtral": ({}, "moves"),
}
SLIDING = {"gemma2": 4096, "gemma3": 512}
"""Families with sliding-window layers, and their windows."""

DOCS = ["The assert statement is a convenient way to insert debugging assertions into a program.",
        "The pass statement is a null operation; nothing happens when it executes.",
        "The break statement may only occur syntactically nested in a for or while loop.",
        "The continue statement continues with the next cycle of the nearest enclosing loop.",
        "The del statement deletes names, attributes or items.",
        "The return statement leaves the current function call with an expression list or None."]
SYS = "Answer from the documents."
LONGER_SYS = "You answer questions about Python statements from the documents below, briefly and exactly."
QUESTION = "Which statement does nothing?"
ISOLATED = {"graphchunk_mode": "isolated"}
LEGOLINK_2 = {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink", "graphchunk_recompute_tokens": 2}
COUNTERS = ("lookups", "hits", "misses", "tier_hits", "tier_writes", "blend_hits", "blend_misses",
            "blend_tokens_recomputed")


class Family(NamedTuple):
    arch: str
    llm: object
    oracle: Oracle
    blend: str


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """One engine per family, closed before the next family's starts."""
    from graphchunk import GraphChunkLLM

    arch = request.param
    settings, blend = FAMILIES[arch]
    path = str(models.tiny_checkpoint(arch))
    llm = GraphChunkLLM(path, **ENGINE, **settings, graphchunk={
        "pool_tokens": 4096, "mode": "isolated", "store_path": str(engines.scratch(f"family-{arch}"))})
    try:
        yield Family(arch, llm, Oracle(path, dtype=torch.float32), blend)
    finally:
        clear_references()
        llm.shutdown()


def ask(llm, prompt: RagPrompt):
    """(output, segmentation, counter deltas) of one request."""
    before = llm.stats()
    (output,) = llm.generate([prompt], sampling())
    after = llm.stats()
    return output, split_at(*llm.encode(prompt), **LIMITS), {name: after[name] - before[name] for name in COUNTERS}


def test_isolated_equals_the_oracle(family):
    """Two chunks missed, then the same two reordered behind the same system prompt (pool hits)."""
    output, seg, delta = ask(family.llm, RagPrompt(SYS, DOCS[:2], QUESTION, extra=ISOLATED))
    assert_matches_oracle(output, seg, family.oracle)
    assert (delta["misses"], delta["hits"]) == (2, 0), delta
    output, seg, delta = ask(family.llm, RagPrompt(SYS, DOCS[1::-1], "Which statement is for debugging?",
                                                   extra=ISOLATED))
    assert_matches_oracle(output, seg, family.oracle)
    assert (delta["misses"], delta["hits"]) == (0, 2), delta


def test_blend_moves_keys_as_hf_computes_them(family):
    """Chunks cached behind SYS, then moved behind LONGER_SYS (other offsets, other order) with
    LegoLink recomputing 2 tokens of each, then all of their tokens recomputed behind SYS again."""
    llm, oracle = family.llm, family.oracle
    if family.blend != "moves":  # refused where the request is processed (a ValueError for LLM callers)
        with pytest.raises(ValueError, match=f"blend mode is not available for this model: .*{family.blend}"):
            llm.generate([RagPrompt(SYS, DOCS[:2], QUESTION, extra=LEGOLINK_2)], sampling())
        return
    _, cached, delta = ask(llm, RagPrompt(SYS, DOCS[2:4], QUESTION, extra=BLEND_NONE))
    assert delta["blend_misses"] == 2, delta
    output, seg, delta = ask(llm, RagPrompt(LONGER_SYS, DOCS[3:1:-1], QUESTION, extra=LEGOLINK_2))
    assert seg.layout.sys_len > cached.layout.sys_len  # both chunks land elsewhere: their keys move
    assert_matches_reference(output, blend_reference(oracle, seg, "legolink:2"), f"legolink:2 {seg.layout}")
    assert (delta["blend_hits"], delta["blend_misses"], delta["blend_tokens_recomputed"]) == (2, 0, 4), delta
    output, seg, delta = ask(llm, RagPrompt(SYS + " Be brief.", DOCS[2:4], QUESTION, extra=BLEND_FULL))
    assert_matches_reference(output, blend_reference(oracle, seg, "causal"), f"causal {seg.layout}")
    assert delta["blend_hits"] == 2 and delta["blend_tokens_recomputed"] == sum(seg.layout.chunk_lens), delta


def test_tier_round_trip(family):
    """Two chunks computed and written to the tier; the pool emptied; the same chunks, reordered,
    served from the tier's files, still equal to the oracle."""
    llm = family.llm
    output, seg, delta = ask(llm, RagPrompt(SYS, DOCS[4:6], QUESTION, extra=ISOLATED))
    assert_matches_oracle(output, seg, family.oracle)
    assert (delta["misses"], delta["tier_writes"]) == (2, 2), delta
    assert llm.reset_pool()
    output, seg, delta = ask(llm, RagPrompt(SYS, DOCS[5:3:-1], QUESTION, extra=ISOLATED))
    assert_matches_oracle(output, seg, family.oracle)
    assert (delta["misses"], delta["hits"], delta["tier_hits"]) == (0, 0, 2), delta


# --- refusals at start-up (the config is built and checked in this process; no engine starts) ------

@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_sliding_window_is_refused_at_start_up(arch):
    from graphchunk import GraphChunkLLM

    window = SLIDING[arch]
    with pytest.raises(ConfigError, match=rf"sliding-window attention \(the model's sliding_window={window}\).*"
                                          rf"--disable-sliding-window"):
        GraphChunkLLM(str(models.tiny_checkpoint(arch)), **ENGINE, graphchunk={"pool_tokens": 4096})


@pytest.mark.parametrize("arch", ["gemma3", "olmo2"])
def test_blend_default_is_refused_where_keys_cannot_move(arch):
    """Gemma-3's local and global layers rotate by different bases, and OLMo-2 runs HF's own modules
    in vLLM 0.32 (its Transformers backend): blend cannot be their default."""
    from graphchunk import GraphChunkLLM

    settings, refusal = FAMILIES[arch]
    with pytest.raises(ConfigError, match=rf"graphchunk.mode='blend' is not available for this model: .*{refusal}"):
        GraphChunkLLM(str(models.tiny_checkpoint(arch)), **ENGINE, **settings,
                      graphchunk={"pool_tokens": 4096, "mode": "blend"})


def test_phi3_longrope_refuses_blend():
    """Phi-3's 128k variants and Phi-4-mini scale by LongRoPE, which switches frequencies at a length."""
    import transformers

    config = transformers.Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096,
                                     hidden_size=128, num_attention_heads=4,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "short_factor": [1.0] * 16, "long_factor": [2.0] * 16})
    assert "rope_type 'longrope' is not known to be a fixed rotation" in hf_rope_refusal(config)
