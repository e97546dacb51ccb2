"""APE's merge in the HF oracle (graphchunk.reference.ape): the merge against its formula written
out in float64, and on SmolLM2-135M fp32 that it leaves isolated mode exactly where it should
(T = S = 1; sys and chunk tokens always), equals the key temperature where S·T = 1, moves the answer
otherwise, and that the oracle's two forms (whole masked forward, question over a context computed
once) agree with it on. Also blend's teacher-forced form: recomputing every chunk token is the
causal forward."""
import numpy as np
import pytest
import torch
from pydoc_data.topics import topics

from graphchunk.layout import Layout
from graphchunk.reference.ape import Ape, merged_attention

LOGITS_TOL = 5e-4  # test_oracle's: the oracle's forms agree to ~5e-5 in fp32
EFFECT_MIN = 1e-2  # APE at T = S = 0.9 moves the question's logits by far more (measured ~1)


def formula(logits, values, allowed, tempered, t, s):
    """APE's merge as its definition reads, float64, one row at a time."""
    out = np.zeros(logits.shape[:-1] + values.shape[-1:])
    for idx in np.ndindex(*logits.shape[:-1]):
        row, ok, temp = logits[idx], allowed[idx], tempered[idx]
        a, b = ok & temp, ok & ~temp
        ea, eb = np.exp(row[a] / t), np.exp(row[b])
        if not a.any():
            out[idx] = eb @ values[idx[:-1]][b] / eb.sum()
            continue
        mass_a, mass_b = ea.sum() ** (s * t), eb.sum()
        part_a = ea @ values[idx[:-1]][a] / ea.sum()
        part_b = eb @ values[idx[:-1]][b] / eb.sum() if b.any() else 0.0
        out[idx] = (mass_a * part_a + mass_b * part_b) / (mass_a + (mass_b if b.any() else 0.0))
    return out


@pytest.mark.parametrize("t,s", [(1.0, 1.0), (0.9, 0.9), (0.8, 1.25), (1.3, 0.6)])
def test_merge_is_its_formula(t, s):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64) * 3
    values = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    allowed = torch.rand(1, 1, 5, 7, generator=g) < 0.8
    allowed[..., 0] = True  # every row attends something
    tempered = (torch.rand(1, 1, 5, 7, generator=g) < 0.5).expand(2, 3, 5, 7).clone()
    tempered[:, :, 1] = False  # a row with no tempered key: plain attention
    got = merged_attention(logits, values, allowed.expand(2, 3, 5, 7), tempered, t, s).double()
    want = formula(logits.numpy(), values.numpy(), allowed.expand(2, 3, 5, 7).numpy(), tempered.numpy(), t, s)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    if t == s == 1:
        plain = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ values
        np.testing.assert_allclose(got.numpy(), plain.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="temperature > 0"):
        Ape(0.0, 1.0)
    with pytest.raises(ValueError, match="side"):
        Ape(0.9, 0.9, "question")


@pytest.fixture(scope="module")
def prompt(tokenizer):
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731
    sys_ids = encode("You answer questions about Python using only the documents below.\n")
    chunks = [encode(topics[name])[:n] for name, n in (("assert", 61), ("break", 24), ("pass", 40))]
    question = encode("\nQuestion: Which statement inserts debugging assertions into a program?\nAnswer:")
    ids = sys_ids + [t for c in chunks for t in c] + question
    return ids, Layout(len(sys_ids), tuple(len(c) for c in chunks), len(question))


def max_abs(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("side", ["documents", "prefix"])
def test_t_s_1_is_isolated_mode_and_context_tokens_never_change(oracle, prompt, side):
    ids, layout = prompt
    plain = oracle.prefill_logits(ids, layout)
    assert max_abs(oracle.prefill_logits(ids, layout, ape=Ape(1.0, 1.0, side)), plain) <= LOGITS_TOL
    moved = oracle.prefill_logits(ids, layout, ape=Ape(0.9, 0.9, side))
    assert max_abs(moved[:layout.context_len], plain[:layout.context_len]) <= LOGITS_TOL
    assert max_abs(moved[layout.context_len:], plain[layout.context_len:]) > EFFECT_MIN


@pytest.mark.slow
def test_documents_side_with_s_times_t_1_is_the_key_temperature(oracle, prompt):
    ids, layout = prompt
    ape = oracle.prefill_logits(ids, layout, ape=Ape(0.8, 1 / 0.8, "documents"))
    assert max_abs(ape, oracle.prefill_logits(ids, layout, key_temperature=0.8)) <= LOGITS_TOL


SETTINGS = [None, Ape(0.9, 0.9), Ape(0.8, 0.8, "prefix")]


@pytest.mark.slow
def test_question_over_a_cached_context_is_the_masked_forward(oracle, prompt):
    """One batch row per setting over a context computed once (the benchmark's form) equals each
    setting's own whole masked forward."""
    ids, layout = prompt
    cache = oracle.isolated_cache(ids, layout)
    batched = oracle.question_generate(cache, ids, layout, 8, apes=SETTINGS)
    wholes = [oracle.generate(ids, layout, max_new_tokens=8, ignore_eos=True, ape=ape) for ape in SETTINGS]
    forced = oracle.question_logprobs(cache, ids, layout, wholes[1].tokens, apes=SETTINGS)
    assert forced.shape[:2] == (3, 8)
    for i, whole in enumerate(wholes):
        assert batched[i] == whole.tokens[:len(batched[i])] and len(batched[i]) >= 1, i
    assert forced[1].argmax(-1).tolist() == wholes[1].tokens
    assert max_abs(forced[1, -1], wholes[1].last_logits.log_softmax(-1)) <= LOGITS_TOL
    assert len({tuple(b) for b in batched}) > 1 or max_abs(forced[0], forced[1]) > EFFECT_MIN
    assert cache.get_seq_length() == layout.context_len  # not changed: the next setting reuses it


@pytest.mark.slow
def test_blend_recomputing_every_chunk_token_is_the_causal_forward(oracle, prompt):
    ids, layout = prompt
    tokens, logprobs = oracle.causal_generate(ids, 6)
    everything = range(layout.sys_len, layout.context_len)
    forced = oracle.blend_logprobs(ids, layout, everything, tokens)
    assert max_abs(forced, torch.stack(logprobs)) <= LOGITS_TOL
    naive = oracle.blend_logprobs(ids, layout, (), tokens)
    assert max_abs(naive, torch.stack(logprobs)) > EFFECT_MIN
