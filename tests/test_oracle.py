"""The oracle computes DESIGN.md §2 isolated-mode semantics: checked on SmolLM2-135M, fp32, real text."""
import itertools

import numpy as np
import pytest
import torch
import transformers
from pydoc_data.topics import topics

from graphchunk.layout import Layout

# fp32 logits of SmolLM2 are O(10); reordering the chunks reorders the softmax sums over keys in
# 30 layers, measured at ~4e-5 max-abs (DESIGN.md: 6e-5), and the incremental form differs from the
# masked forward by ~3e-5 (DESIGN.md: 5e-5). 5e-4 leaves 10x headroom and is still ~1000x below
# what a wrong mask or wrong positions do (the sanity test below asserts > 0.5).
LOGITS_TOL = 5e-4
MASK_EFFECT_MIN = 0.5

SYS_TEXT = "You answer questions about Python using only the documents below.\n"
# Documents from CPython's own help topics, cut to different token lengths so that M != L_i.
DOC_TOPICS = (("assert", 61), ("break", 24), ("pass", 40))
QUESTION_TEXT = "\nQuestion: Which statement inserts debugging assertions into a program?\nAnswer:"


@pytest.fixture(scope="module")
def segments(tokenizer):
    """(sys, [chunk_1, chunk_2, chunk_3], question) token ids."""
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731
    chunks = [encode(topics[topic])[:length] for topic, length in DOC_TOPICS]
    return encode(SYS_TEXT), chunks, encode(QUESTION_TEXT)


@pytest.fixture(scope="module")
def vanilla_model(smollm2_path):
    """Plain HF model with its default attention implementation, used without masks or positions."""
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def build(sys_ids, chunks, question) -> tuple[list[int], Layout]:
    token_ids = sys_ids + [t for chunk in chunks for t in chunk] + question
    return token_ids, Layout(len(sys_ids), tuple(len(c) for c in chunks), len(question))


@torch.inference_mode()
def hf_logits(model, token_ids, position_ids=None) -> torch.Tensor:
    """Ordinary causal forward; HF builds the mask itself."""
    positions = None if position_ids is None else torch.from_numpy(position_ids)[None]
    return model(torch.tensor([token_ids]), position_ids=positions).logits[0].float()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_chunk_order_does_not_change_question_logits(oracle, segments):
    sys_ids, chunks, question = segments
    token_ids, layout = build(sys_ids, chunks, question)
    reference = oracle.prefill_logits(token_ids, layout)[layout.context_len:]
    for order in list(itertools.permutations(range(len(chunks))))[1:]:
        permuted_ids, permuted = build(sys_ids, [chunks[i] for i in order], question)
        logits = oracle.prefill_logits(permuted_ids, permuted)[permuted.context_len:]
        assert max_abs(logits, reference) <= LOGITS_TOL, order


def test_chunk_order_does_not_change_greedy_continuation(oracle, segments):
    sys_ids, chunks, question = segments
    forward = oracle.generate(*build(sys_ids, chunks, question), max_new_tokens=16, ignore_eos=True)
    reverse = oracle.generate(*build(sys_ids, chunks[::-1], question), max_new_tokens=16, ignore_eos=True)
    assert len(forward.tokens) == 16
    assert forward.tokens == reverse.tokens
    assert max_abs(forward.last_logits, reverse.last_logits) <= LOGITS_TOL


@pytest.mark.parametrize("with_sys", [True, False], ids=["sys", "no-sys"])
def test_incremental_form_matches_masked_forward(oracle, segments, with_sys):
    sys_ids, chunks, question = segments
    token_ids, layout = build(sys_ids if with_sys else [], chunks, question)
    masked = oracle.prefill_logits(token_ids, layout)[-1]
    incremental = oracle.incremental_last_logits(token_ids, layout)
    assert max_abs(incremental, masked) <= LOGITS_TOL


def test_single_chunk_is_plain_causal_attention(oracle, vanilla_model, segments):
    """With k=1 the isolated mask is the causal mask and M == L, so positions are just arange."""
    sys_ids, chunks, question = segments
    token_ids, layout = build(sys_ids, chunks[:1], question)
    assert np.array_equal(layout.positions(), np.arange(layout.num_tokens))
    assert np.array_equal(layout.attention_allowed(), np.tril(np.ones((layout.num_tokens,) * 2, bool)))
    logits = oracle.prefill_logits(token_ids, layout)
    assert torch.equal(logits, hf_logits(oracle.model, token_ids))  # same eager model: bit-exact
    assert max_abs(logits, hf_logits(vanilla_model, token_ids)) <= LOGITS_TOL


def test_isolated_mask_and_positions_change_the_result(oracle, segments):
    """Guards the tests above against a mask or positions that are silently ignored."""
    sys_ids, chunks, question = segments
    token_ids, layout = build(sys_ids, chunks, question)
    isolated = oracle.prefill_logits(token_ids, layout)[-1]
    causal = hf_logits(oracle.model, token_ids)[-1]
    causal_shifted = hf_logits(oracle.model, token_ids, layout.positions())[-1]
    assert max_abs(isolated, causal) > MASK_EFFECT_MIN
    assert max_abs(isolated, causal_shifted) > MASK_EFFECT_MIN  # the 4D mask itself is applied


def test_generated_tokens_continue_after_question(oracle, segments):
    """Decode token n sits at S+M+Q+n and sees everything: exactly an (n+1)-longer question, so
    each cached decode step must agree with a full masked forward over prompt + earlier tokens."""
    sys_ids, chunks, question = segments
    token_ids, layout = build(sys_ids, chunks, question)
    steps = 4
    generated = oracle.generate(token_ids, layout, max_new_tokens=steps, ignore_eos=True)
    start = layout.question_position + layout.question_len
    assert np.array_equal(layout.positions(steps)[-steps:], np.arange(start, start + steps))
    for n in range(steps):
        longer = Layout(layout.sys_len, layout.chunk_lens, layout.question_len + n)
        assert np.array_equal(longer.positions(), layout.positions(n))
        logits = oracle.prefill_logits(token_ids + generated.tokens[:n], longer)[-1]
        assert int(logits.argmax()) == generated.tokens[n]
    assert max_abs(logits, generated.last_logits) <= LOGITS_TOL


def test_generation_without_chunks_matches_hf_generate(oracle, tokenizer):
    """No chunks: an ordinary prompt; greedy decoding stops at EOS exactly like HF's own loop."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    token_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    result = oracle.generate(token_ids, Layout(0, (), len(token_ids)), max_new_tokens=32)
    with torch.inference_mode():
        expected = oracle.model.generate(torch.tensor([token_ids]), max_new_tokens=32, do_sample=False)
    assert result.tokens == expected[0, len(token_ids):].tolist()
    assert result.tokens[-1] in oracle.eos_token_ids


# --- blend mode's references -----------------------------------------------------------------------

def test_blend_reference_recomputing_every_chunk_token_is_the_causal_forward(oracle, segments, vanilla_model):
    """blend_generate with every chunk token recomputed is full prefill: the explicit-mask,
    reused-KV construction reduces to HF's own causal forward (vanilla_model, no mask at all)."""
    token_ids, layout = build(*segments)
    every = range(layout.sys_len, layout.context_len)
    tokens, logprobs = oracle.blend_generate(token_ids, layout, every, 4)
    causal_tokens, causal_logprobs = oracle.causal_generate(token_ids, 4)
    with torch.inference_mode():
        plain = vanilla_model(torch.tensor([token_ids])).logits[0, -1].float().log_softmax(-1)
    assert tokens == causal_tokens
    assert (logprobs[0] - plain).abs().max() < LOGITS_TOL
    assert max((a - b).abs().max() for a, b in zip(logprobs, causal_logprobs)) < LOGITS_TOL


def test_blend_reference_partial_recompute_lies_between(oracle, segments):
    """Naive reuse differs from full prefill; recomputing the first tokens of every chunk moves
    the first generated token's distribution towards it (and differs from both)."""
    token_ids, layout = build(*segments)
    firsts = [s + i for s in layout.chunk_starts() for i in range(4)]
    full = oracle.causal_generate(token_ids, 1)[1][0]
    naive = oracle.naive_reuse_generate(token_ids, layout, 1)[1][0]
    partial = oracle.blend_generate(token_ids, layout, firsts, 1)[1][0]
    kl = lambda p, q: float((p.exp() * (p - q)).sum())  # noqa: E731
    assert kl(full, naive) > 1e-2  # measured 0.16
    assert (partial - naive).abs().max() > LOGITS_TOL and (partial - full).abs().max() > LOGITS_TOL
    print(f"\nKL(full || naive) {kl(full, naive):.3e}, KL(full || legolink 4) {kl(full, partial):.3e}")


def test_blend_reference_with_a_fixed_prefix_before_every_chunk(oracle, segments, tokenizer):
    """``prefixed_kv``: with no prefix it is the chunks-alone context; with one, each chunk token's
    KV is HF's causal forward of ``prefix ‖ chunk`` at that token, keys moved to where the chunk
    lands (compared at the chunk's own positions in a forward of ``prefix ‖ chunk`` placed so that
    the chunk starts there); recomputing every chunk token over it is still full prefill."""
    token_ids, layout = build(*segments)
    alone = oracle._alone_kv(token_ids, layout)
    for (k0, v0), (k1, v1) in zip(alone, oracle.prefixed_kv(token_ids, layout, [])):
        assert max_abs(k0, k1) < 1e-4 and max_abs(v0, v1) < 1e-4  # RoPE moves, float rounding: ~1e-5
    prefix = tokenizer("Here is a document.\n\n").input_ids
    prefixed = oracle.prefixed_kv(token_ids, layout, prefix)
    begin, n = layout.chunk_starts()[1], layout.chunk_lens[1]
    placed = oracle._causal_kv(prefix + token_ids[begin:begin + n], first_position=begin - len(prefix))
    for (k, v), (pk, pv), (ak, _) in zip(prefixed, placed, alone):
        assert max_abs(k[:, :, begin:begin + n], pk[:, :, len(prefix):]) < 1e-3
        assert max_abs(v[:, :, begin:begin + n], pv[:, :, len(prefix):]) < 1e-4
    assert max_abs(prefixed[-1][0], alone[-1][0]) > MASK_EFFECT_MIN
    every = range(layout.sys_len, layout.context_len)
    full = oracle.causal_generate(token_ids, 2)[1]
    recomputed = oracle.blend_generate(token_ids, layout, every, 2, context_kv=prefixed)[1]
    assert max((a - b).abs().max() for a, b in zip(full, recomputed)) < LOGITS_TOL
    forced = oracle.blend_logprobs(token_ids, layout, every, [int(full[0].argmax()), 0], context_kv=prefixed)
    assert max_abs(forced[0], full[0]) < LOGITS_TOL
