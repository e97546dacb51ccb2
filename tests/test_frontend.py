"""Request annotation in the API process: boundaries into extra_args, layout into cache_salt."""
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from graphchunk.blend.recompute import RecomputePolicy
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.frontend import (NONCE_MARK, DocumentBoundaries, RequestAnnotator, is_graphchunk_worker,
                                        layout_fingerprint, temperature_refusal)
from graphchunk.engine.request_args import (BLOCK_ARG, BOUNDARIES_ARG, GRAPHCHUNK_ARGS, MODE_ARG, RATIO_ARG,
                                            RECOMPUTE_ARG, SALT_ARG, SEPARATOR_ARG, SINKS_ARG, SPREAD_ARG,
                                            TEMPERATURE_ARG, TOKENS_ARG, UNCHUNKED_ARG, beam_search_problem,
                                            chunk_request, json_boolean_problem, resolve_mode)
from graphchunk.segments import SegmentationError


ISOLATED_CONFIG = GraphChunkConfig(max_chunks=4, max_chunk_len=64, mode="isolated", separator="##")
"""Most tests here are about isolated requests that name no mode: the deployment's default says isolated."""


@pytest.fixture(scope="module")
def annotator(tokenizer):
    return RequestAnnotator(ISOLATED_CONFIG, tokenizer)


def request(tokenizer, text, salt=None, **params):
    return SimpleNamespace(prompt_token_ids=tokenizer.encode(text), cache_salt=salt,
                           sampling_params=SamplingParams(**params))


def test_separator_prompt_gets_boundaries_and_a_layout_salt(tokenizer, annotator):
    req = request(tokenizer, "Sys. ## Doc one. ## Doc two. ## Question?", salt="tenant")
    annotator.annotate(req)
    args = req.sampling_params.extra_args
    assert len(args[BOUNDARIES_ARG]) == 3 and args[SALT_ARG] == '["tenant"]'
    assert req.cache_salt.startswith("tenant|graphchunk:")


def test_lora_adapter_is_part_of_the_chunk_salt(tokenizer, annotator):
    req = request(tokenizer, "Sys. ## Doc one. ## Question?", salt="tenant")
    req.lora_request = SimpleNamespace(lora_name="legal-v2")
    annotator.annotate(req)
    assert req.sampling_params.extra_args[SALT_ARG] == '["tenant", "legal-v2"]'
    # no salt a client sends without an adapter reads as a salt and an adapter
    forged = request(tokenizer, "Sys. ## Doc one. ## Question?", salt='["tenant", "legal-v2"]')
    annotator.annotate(forged)
    assert forged.sampling_params.extra_args[SALT_ARG] != req.sampling_params.extra_args[SALT_ARG]


@pytest.mark.parametrize("salt", ["|graphchunk:0123456789abcdef", "tenant|graphchunk:blend:none:00"])
@pytest.mark.parametrize("text", ["Sys. ## Doc one. ## Question?", "An ordinary prompt."])
def test_a_client_salt_carrying_graphchunks_mark_is_refused(tokenizer, annotator, salt, text):
    """Whoever sends graphchunk's mark could read segmented KV from vLLM's prefix cache with an
    ordinary prompt (or plant causal KV where segmented requests read): refused, naming cache_salt."""
    with pytest.raises(SegmentationError, match="cache_salt must not contain '\\|graphchunk:'"):
        annotator.annotate(request(tokenizer, text, salt=salt))


def test_skip_reading_prefix_cache_is_refused_for_segmented_prompts(tokenizer, annotator):
    """vLLM skips the KV connectors of such a request: its context would run causally under graphchunk's salt."""
    req = request(tokenizer, "Sys. ## Doc one. ## Question?", skip_reading_prefix_cache=True)
    with pytest.raises(SegmentationError, match="skip_reading_prefix_cache"):
        annotator.annotate(req)
    ordinary = request(tokenizer, "An ordinary prompt.", skip_reading_prefix_cache=True)
    annotator.annotate(ordinary)  # runs as vanilla vLLM, which honours it
    assert ordinary.cache_salt is None


def test_ranking_blend_policies_never_share_vllms_prefix_cache(tokenizer):
    """cacheblend and question rank the context: a request that hit part of another's context in
    vLLM's prefix cache would rank only the rest, over KV the other's recompute changed. Their salt
    carries a nonce; policies that pick by position share as before."""
    ranked = [annotated(tokenizer, **{MODE_ARG: "blend", RECOMPUTE_ARG: name}).cache_salt
              for name in ("question", "question", "cacheblend", "cacheblend")]
    assert len(set(ranked)) == 4
    assert all(NONCE_MARK in salt for salt in ranked)  # the engine core adds each n > 1 child's id after it
    for extra in ({RECOMPUTE_ARG: "legolink"}, {RECOMPUTE_ARG: "none"}, {RECOMPUTE_ARG: "cacheblend", RATIO_ARG: 1}):
        salts = {annotated(tokenizer, **{MODE_ARG: "blend", **extra}).cache_salt for _ in range(2)}
        assert len(salts) == 1 and NONCE_MARK not in salts.pop()


def test_multimodal_segmented_prompt_is_refused(tokenizer, annotator):
    req = request(tokenizer, "Sys. ## Doc one. ## Question?")
    req.mm_features = [object()]
    with pytest.raises(SegmentationError, match="multimodal"):
        annotator.annotate(req)


def test_role_change_changes_the_salt(tokenizer, annotator):
    """S ## A ## Q and S ## A ## Q ## B ## Q2 share a token prefix but not their roles."""
    short = request(tokenizer, "Sys. ## Doc A. ## Question Q?")
    long = request(tokenizer, "Sys. ## Doc A. ## Question Q? ## Doc B. ## Question two?")
    annotator.annotate(short)
    annotator.annotate(long)
    assert long.prompt_token_ids[: len(short.prompt_token_ids)] == short.prompt_token_ids
    assert short.cache_salt != long.cache_salt


def test_an_unchunked_documents_request_is_ordinary_never_separator_split_and_marked(tokenizer, annotator):
    """documents_fallback='ordinary': a documents request graphchunk could not chunk arrives with
    UNCHUNKED; no separator detection runs (its text has one), the worker is told to count it,
    and a client cannot send that mark itself."""
    from graphchunk.engine.document_hooks import UNCHUNKED
    from graphchunk.engine.request_args import UNCHUNKED_ARG

    req = request(tokenizer, "Sys. ## Doc one. ## Question?", salt="s", extra_args={MODE_ARG: "blend"})
    annotator.annotate(req, UNCHUNKED)
    assert req.cache_salt == "s" and req.sampling_params.extra_args == {UNCHUNKED_ARG: True}
    forged = request(tokenizer, "What is the capital of France?", extra_args={UNCHUNKED_ARG: True})
    annotator.annotate(forged)
    assert not forged.sampling_params.extra_args
    with pytest.raises(SegmentationError, match="cannot also send graphchunk_boundaries"):
        annotator.annotate(request(tokenizer, "a b c", extra_args={BOUNDARIES_ARG: [1, 2]}), UNCHUNKED)


def test_ordinary_prompt_is_untouched(tokenizer, annotator):
    req = request(tokenizer, "What is the capital of France?", salt="s")
    annotator.annotate(req)
    assert req.cache_salt == "s" and not req.sampling_params.extra_args


def test_explicit_boundaries(tokenizer, annotator):
    req = request(tokenizer, "a b c d e f g h", extra_args={BOUNDARIES_ARG: [2, 4, 6], SALT_ARG: "forged"})
    annotator.annotate(req)
    assert req.sampling_params.extra_args == {BOUNDARIES_ARG: [2, 4, 6], SALT_ARG: None, MODE_ARG: "isolated",
                                              TEMPERATURE_ARG: 1.0}
    zero_chunks = request(tokenizer, "a b c d", extra_args={BOUNDARIES_ARG: [2]})
    annotator.annotate(zero_chunks)
    assert zero_chunks.cache_salt is None and not zero_chunks.sampling_params.extra_args


@pytest.mark.parametrize("text, params, message", [
    ("S ## a ## b ## c ## d ## e ## Q", {}, "5 chunks, more than max_chunks=4"),
    ("S ## " + "word " * 80 + "## Q", {}, "more than max_chunk_len=64"),
    ("S ## doc ##", {}, "question .* is empty"),
    ("S ## doc ## Q", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("a b c d", {"extra_args": {BOUNDARIES_ARG: 3}}, "must be a list"),
    ("a b c d", {"extra_args": {BOUNDARIES_ARG: [3, 1]}}, "non-decreasing"),
    ("a b c d", {"extra_args": {BOUNDARIES_ARG: [1, 99]}}, "within"),
    ("a b c d", {"extra_args": {BOUNDARIES_ARG: ["x"]}}, "integers"),
])
def test_bad_input_is_a_value_error_naming_the_problem(tokenizer, annotator, text, params, message):
    with pytest.raises(SegmentationError, match=message):
        annotator.annotate(request(tokenizer, text, **params))


# --- mode and recompute policy (blend) -----------------------------------------------------------

RAG = "Sys. ## Doc one. ## Doc two. ## Question?"


def annotated(tokenizer, config=None, text=RAG, **extra):
    ann = RequestAnnotator(config or ISOLATED_CONFIG, tokenizer)
    req = request(tokenizer, text, salt="tenant", extra_args=extra or None)
    ann.annotate(req)
    return req


def resolved(req) -> dict:
    args = req.sampling_params.extra_args
    return {key: args[key] for key in (MODE_ARG, TEMPERATURE_ARG, RECOMPUTE_ARG, RATIO_ARG, TOKENS_ARG) if key in args}


BLEND_CONFIG = GraphChunkConfig(max_chunks=4, max_chunk_len=64, mode="blend", recompute="legolink",
                                recompute_ratio=0.3, recompute_tokens=7, separator="##")
COOL_CONFIG = GraphChunkConfig(max_chunks=4, max_chunk_len=64, key_temperature=0.8, mode="isolated", separator="##")


@pytest.mark.parametrize("config, extra, expected", [
    (None, {}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 1.0}),
    (None, {MODE_ARG: "isolated"}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 1.0}),
    (None, {TEMPERATURE_ARG: 0.5}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 0.5}),
    (None, {TEMPERATURE_ARG: 2}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 2.0}),
    (COOL_CONFIG, {}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 0.8}),
    (COOL_CONFIG, {TEMPERATURE_ARG: 1}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 1.0}),
    (None, {MODE_ARG: "blend"},
     {MODE_ARG: "blend", RECOMPUTE_ARG: "question", RATIO_ARG: 0.3, TOKENS_ARG: 15}),
    (None, {MODE_ARG: "blend", RECOMPUTE_ARG: "cacheblend", RATIO_ARG: 1},
     {MODE_ARG: "blend", RECOMPUTE_ARG: "cacheblend", RATIO_ARG: 1.0, TOKENS_ARG: 15}),
    (None, {MODE_ARG: "blend", RECOMPUTE_ARG: "legolink", TOKENS_ARG: 2},
     {MODE_ARG: "blend", RECOMPUTE_ARG: "legolink", RATIO_ARG: 0.3, TOKENS_ARG: 2}),
    (BLEND_CONFIG, {}, {MODE_ARG: "blend", RECOMPUTE_ARG: "legolink", RATIO_ARG: 0.3, TOKENS_ARG: 7}),
    (BLEND_CONFIG, {RECOMPUTE_ARG: "none"}, {MODE_ARG: "blend", RECOMPUTE_ARG: "none", RATIO_ARG: 0.3, TOKENS_ARG: 7}),
    (BLEND_CONFIG, {RECOMPUTE_ARG: "cacheblend", RATIO_ARG: 0.5},
     {MODE_ARG: "blend", RECOMPUTE_ARG: "cacheblend", RATIO_ARG: 0.5, TOKENS_ARG: 7}),
    (BLEND_CONFIG, {MODE_ARG: "isolated"}, {MODE_ARG: "isolated", TEMPERATURE_ARG: 1.0}),
])
def test_segmented_request_carries_the_resolved_mode_and_policy(tokenizer, config, extra, expected):
    got = resolved(annotated(tokenizer, config, **extra))
    assert got == expected
    assert all(type(got[k]) is type(expected[k]) for k in got)  # ratio a float, tokens an int


@pytest.mark.parametrize("config, extra, message", [
    (None, {MODE_ARG: "bogus"}, r"graphchunk_mode must be one of \('isolated', 'blend', 'off'\), got 'bogus'"),
    (None, {SEPARATOR_ARG: " "}, r"graphchunk_separator must be a text with a non-whitespace character \(e.g. '##'\), got ' '"),
    (None, {SEPARATOR_ARG: 5}, "graphchunk_separator must be a text with a non-whitespace character"),
    (None, {SEPARATOR_ARG: "##", BOUNDARIES_ARG: [1, 2]}, "send graphchunk_boundaries or graphchunk_separator, not both"),
    (None, {MODE_ARG: "off", SEPARATOR_ARG: "##"},
     "graphchunk_mode 'off' runs the request as in vanilla vLLM; it takes no graphchunk_separator"),
    (None, {MODE_ARG: "off", BOUNDARIES_ARG: [1], RATIO_ARG: 0.5},
     "graphchunk_mode 'off' .* it takes no graphchunk_boundaries, graphchunk_recompute_ratio"),
    (None, {MODE_ARG: 1}, "graphchunk_mode must be one of"),
    (None, {MODE_ARG: "blend", RECOMPUTE_ARG: "x"}, "graphchunk_recompute must be one of .*, got 'x'"),
    (None, {MODE_ARG: "blend", RATIO_ARG: 1.5}, r"graphchunk_recompute_ratio must be a number in \[0, 1\], got 1.5"),
    (None, {MODE_ARG: "blend", RATIO_ARG: 2}, r"graphchunk_recompute_ratio must be a number in \[0, 1\], got 2$"),
    (None, {MODE_ARG: "blend", RATIO_ARG: -0.1}, "graphchunk_recompute_ratio must be a number"),
    (None, {MODE_ARG: "blend", RATIO_ARG: "0.1"}, "graphchunk_recompute_ratio must be a number .*, got '0.1'"),
    (None, {MODE_ARG: "blend", RATIO_ARG: True}, "graphchunk_recompute_ratio must be a number .*, got True"),
    (None, {MODE_ARG: "blend", TOKENS_ARG: -1}, "graphchunk_recompute_tokens must be an integer >= 0, got -1"),
    (None, {MODE_ARG: "blend", TOKENS_ARG: 2.5}, "graphchunk_recompute_tokens must be an integer >= 0, got 2.5"),
    (None, {MODE_ARG: "blend", TOKENS_ARG: False}, "graphchunk_recompute_tokens must be an integer"),
    (None, {MODE_ARG: "blend", SINKS_ARG: -2}, "graphchunk_recompute_sinks must be an integer >= 0, got -2"),
    (None, {MODE_ARG: "blend", SPREAD_ARG: "doc"},
     r"graphchunk_recompute_spread must be one of \('context', 'chunk'\), got 'doc'"),
    (None, {SPREAD_ARG: "chunk"}, "graphchunk_recompute_spread only apply to blend mode"),
    (None, {MODE_ARG: "blend", BLOCK_ARG: 0}, r"graphchunk_recompute_block must be an integer >= 1 \(1: single tokens\), got 0"),
    (None, {MODE_ARG: "blend", BLOCK_ARG: 16.0}, "graphchunk_recompute_block must be an integer >= 1"),
    (None, {RECOMPUTE_ARG: "legolink"},
     r"graphchunk_recompute only apply to blend mode, but the deployment's default mode \(graphchunk.mode='isolated'\) is 'isolated'"),
    (None, {MODE_ARG: "isolated", RATIO_ARG: 0.5, TOKENS_ARG: 3},
     "graphchunk_recompute_ratio, graphchunk_recompute_tokens only apply to blend mode, but graphchunk_mode is"),
    (BLEND_CONFIG, {MODE_ARG: "isolated", RECOMPUTE_ARG: "none"}, "graphchunk_recompute only apply to blend mode"),
    (BLEND_CONFIG, {RATIO_ARG: 7}, "graphchunk_recompute_ratio must be a number"),
    (None, {TEMPERATURE_ARG: 0}, "graphchunk_key_temperature must be a number > 0, got 0"),
    (None, {TEMPERATURE_ARG: -1.5}, "graphchunk_key_temperature must be a number > 0"),
    (None, {TEMPERATURE_ARG: float("inf")}, "graphchunk_key_temperature must be a number > 0"),
    (None, {TEMPERATURE_ARG: "0.5"}, "graphchunk_key_temperature must be a number > 0, got '0.5'"),
    (None, {TEMPERATURE_ARG: True}, "graphchunk_key_temperature must be a number > 0, got True"),
    (None, {MODE_ARG: "blend", TEMPERATURE_ARG: 0.5},
     "graphchunk_key_temperature only applies to isolated mode, but the request's mode is 'blend'"),
    (BLEND_CONFIG, {TEMPERATURE_ARG: 1.0}, "graphchunk_key_temperature only applies to isolated mode"),
])
@pytest.mark.parametrize("text", [RAG, "An ordinary prompt without separators."])
def test_bad_mode_arguments_are_value_errors_naming_the_argument(tokenizer, config, extra, message, text):
    """Checked for every request, segmented or not."""
    with pytest.raises(SegmentationError, match=message):
        annotated(tokenizer, config, text=text, **extra)


@pytest.mark.parametrize("config, extra", [
    (None, {MODE_ARG: "blend", RECOMPUTE_ARG: "legolink", RATIO_ARG: 0.5, TOKENS_ARG: 3}),
    (None, {MODE_ARG: "isolated"}),
    (BLEND_CONFIG, {RATIO_ARG: 0.5}),
])
def test_ordinary_request_loses_the_mode_arguments(tokenizer, config, extra):
    req = annotated(tokenizer, config, text="What is the capital of France?", **extra, other=1)
    assert req.sampling_params.extra_args == {"other": 1} and req.cache_salt == "tenant"


def test_sinks_spread_and_block_are_resolved_and_change_the_salt(tokenizer):
    """A blend request carries its sinks, spread and block (defaults: none, 'context', 1), and a
    refined policy gets another fingerprint than the plain one (other recomputed tokens: other KV)."""
    plain = annotated(tokenizer, **{MODE_ARG: "blend", BLOCK_ARG: 1})
    assert {k: plain.sampling_params.extra_args[k] for k in (SINKS_ARG, SPREAD_ARG, BLOCK_ARG)} == \
        {SINKS_ARG: 0, SPREAD_ARG: "context", BLOCK_ARG: 1}
    salts = {plain.cache_salt}
    for extra in ({SINKS_ARG: 4}, {SPREAD_ARG: "chunk"}, {SINKS_ARG: 4, SPREAD_ARG: "chunk"}, {BLOCK_ARG: 16}):
        req = annotated(tokenizer, **{MODE_ARG: "blend", **extra})
        assert {k: req.sampling_params.extra_args[k] for k in extra} == extra
        salts.add(req.cache_salt)
    assert len(salts) == 5
    config = GraphChunkConfig(max_chunks=4, max_chunk_len=64, recompute_sinks=2, recompute_spread="chunk",
                              recompute_block=8, separator="##")
    assert resolve_mode({MODE_ARG: "blend"}, config)[1] == RecomputePolicy("question", 0.3, 15, 2, "chunk", block=8)


def test_isolated_salt_is_unchanged(tokenizer):
    for extra in ({}, {MODE_ARG: "isolated"}):
        req = annotated(tokenizer, **extra)
        seg = RequestAnnotator(ISOLATED_CONFIG, tokenizer).segment(req.prompt_token_ids, {})
        assert req.cache_salt == f"tenant|graphchunk:{layout_fingerprint(seg)}"
    assert annotated(tokenizer, BLEND_CONFIG, **{MODE_ARG: "isolated"}).cache_salt == req.cache_salt


def test_key_temperature_joins_the_salt_and_reaches_the_worker(tokenizer):
    """vLLM's prefix cache must never hand KV copied at one temperature to a request at another;
    T = 1 keeps today's salt. The worker reads back the temperature the API process resolved."""
    plain, one, hot = (annotated(tokenizer, **extra) for extra in ({}, {TEMPERATURE_ARG: 1}, {TEMPERATURE_ARG: 0.7}))
    assert plain.cache_salt == one.cache_salt != hot.cache_salt
    request = chunk_request(hot.prompt_token_ids, hot.sampling_params.extra_args, ISOLATED_CONFIG)
    assert request.key_temperature == 0.7 and request.policy is None
    blend = annotated(tokenizer, COOL_CONFIG, **{MODE_ARG: "blend"})
    assert chunk_request(blend.prompt_token_ids, blend.sampling_params.extra_args, COOL_CONFIG).key_temperature == 1


def test_key_temperature_refused_where_keys_do_not_scale_logits(tokenizer):
    capped = SimpleNamespace(attn_logit_softcapping=50.0)
    assert "soft-capped" in temperature_refusal(capped) and temperature_refusal(SimpleNamespace()) is None
    annotator = RequestAnnotator(ISOLATED_CONFIG, tokenizer, temperature_refusal=temperature_refusal(capped))
    with pytest.raises(SegmentationError, match="graphchunk_key_temperature is not available for this model"):
        annotator.annotate(request(tokenizer, RAG, extra_args={TEMPERATURE_ARG: 0.5}))
    annotator.annotate(request(tokenizer, RAG, extra_args={TEMPERATURE_ARG: 1.0}))  # T = 1 is plain isolated


def test_blend_salt_follows_context_and_policy(tokenizer):
    isolated = annotated(tokenizer).cache_salt
    lego = {MODE_ARG: "blend", RECOMPUTE_ARG: "legolink"}  # a policy whose salt leaves the question out
    blend = annotated(tokenizer, **lego).cache_salt
    assert blend.startswith("tenant|graphchunk:") and blend != isolated
    # Identical requests (defaults resolved or spelled out) share it: prefix-cache hits stay possible.
    assert annotated(tokenizer, **lego).cache_salt == blend
    assert annotated(tokenizer, **lego, **{TOKENS_ARG: 15}).cache_salt == blend
    # (ranking policies carry a nonce: never shared, test_ranking_blend_policies_never_share_vllms_prefix_cache)
    assert annotated(tokenizer, **{MODE_ARG: "blend"}).cache_salt.rsplit(":", 1)[0] == \
        annotated(tokenizer, **{MODE_ARG: "blend", RECOMPUTE_ARG: "question", RATIO_ARG: 0.3}).cache_salt.rsplit(":", 1)[0]
    cacheblend = {MODE_ARG: "blend", RECOMPUTE_ARG: "cacheblend"}
    assert annotated(tokenizer, **cacheblend, **{RATIO_ARG: 1}).cache_salt == \
        annotated(tokenizer, **cacheblend, **{RATIO_ARG: 1.0}).cache_salt
    # Another policy, or another parameter of the policy in use.
    others = [annotated(tokenizer, **{MODE_ARG: "blend", **extra}).cache_salt for extra in (
        {RECOMPUTE_ARG: "cacheblend"}, {RECOMPUTE_ARG: "cacheblend", RATIO_ARG: 0.5}, {RECOMPUTE_ARG: "none"},
        {RECOMPUTE_ARG: "legolink", TOKENS_ARG: 8})]
    assert len({blend, isolated, *others}) == 6
    # One context token changed, anywhere in the context (here: the last chunk, after sys and
    # the first chunk, whose blocks a CacheBlend step's selection still depends on).
    base = request(tokenizer, RAG, salt="tenant", extra_args=dict(lego))
    ann = RequestAnnotator(ISOLATED_CONFIG, tokenizer)
    seg = ann.segment(base.prompt_token_ids, {})
    changed = request(tokenizer, RAG, salt="tenant", extra_args=dict(lego))
    at = seg.layout.context_len - 1
    changed.prompt_token_ids[at] += 1
    assert ann.segment(changed.prompt_token_ids, {}).layout == seg.layout
    ann.annotate(base)
    ann.annotate(changed)
    assert base.cache_salt == blend and changed.cache_salt != blend
    # The question is not part of it: another question over the same context may reuse it.
    longer = annotated(tokenizer, text=RAG.replace("Question?", "Another, longer question?"), **lego)
    assert longer.cache_salt == blend
    # The request's own salt still separates tenants.
    other_tenant = request(tokenizer, RAG, salt="other", extra_args=dict(lego))
    ann.annotate(other_tenant)
    assert other_tenant.cache_salt != blend and other_tenant.sampling_params.extra_args[SALT_ARG] == '["other"]'


def test_resolved_arguments_resolve_to_themselves(tokenizer):
    req = annotated(tokenizer, BLEND_CONFIG, **{RATIO_ARG: 0.5})
    first = resolved(req)
    req.cache_salt = "tenant"  # (the marked salt is graphchunk's own: a client sending it is refused)
    RequestAnnotator(ISOLATED_CONFIG, tokenizer).annotate(req)  # another default mode
    assert resolved(req) == first


@pytest.mark.parametrize("xargs, problem", [
    ({BOUNDARIES_ARG: [True, 5]}, "graphchunk_boundaries must be a list of integer token indices, got [true, 5]: "
                                  "JSON booleans are not accepted"),
    ({BOUNDARIES_ARG: False}, "graphchunk_boundaries must be"),
    ({MODE_ARG: True}, "graphchunk_mode must be one of"),
    ({RECOMPUTE_ARG: False}, "graphchunk_recompute must be one of"),
    ({RATIO_ARG: True}, "graphchunk_recompute_ratio must be a number in [0, 1], got true"),
    ({TOKENS_ARG: True}, "graphchunk_recompute_tokens must be an integer >= 0, got true"),
    *(({key: True}, f"{key} must be ") for key in GRAPHCHUNK_ARGS),  # every key a client may send
    ({BOUNDARIES_ARG: [1, 5], RATIO_ARG: 1, TOKENS_ARG: 0}, None),
    ({"other_plugin_flag": True}, None),
    (None, None),
    ("not a dict", None),
])
def test_json_booleans_in_graphchunk_xargs(xargs, problem):
    """The OpenAI server's pydantic validation turns them into 1/0; the plugin checks the raw JSON."""
    got = json_boolean_problem({"prompt": [1, 2], "vllm_xargs": xargs})
    assert got == problem if problem is None else got.startswith(problem)
    assert json_boolean_problem([1, 2]) is None


@pytest.mark.parametrize("worker_cls, rejected", [("graphchunk.Runner", True), ("auto", False)])
def test_server_hook_rejects_json_booleans_for_graphchunk_engines_only(worker_cls, rejected):
    """plugin.py's wrapper of the OpenAI servings' common entry (the server test sends it through HTTP)."""
    import asyncio
    import json

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    from graphchunk.engine import plugin

    plugin._guard_request_bodies()
    plugin._guard_request_bodies()  # idempotent: wrapped once
    method = GenerateBaseServing._with_kv_transfer_rejection_cleanup
    assert method._graphchunk and not getattr(method, "__wrapped__", None)

    class RawRequest:
        def __init__(self, body):
            self.body = body

        async def json(self):
            return json.loads(self.body)

    serving = SimpleNamespace(
        has_kv_connector=False, create_error_response=GenerateBaseServing.create_error_response,
        engine_client=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(worker_cls=worker_cls))))
    ran = []

    async def create():
        ran.append(True)
        return "created"

    def call(body):
        return asyncio.run(method(serving, create(), SimpleNamespace(kv_transfer_params=None), RawRequest(body)))

    result = call('{"prompt": [1, 2], "vllm_xargs": {"graphchunk_boundaries": [true, 5]}}')
    if rejected:
        assert not ran and result.error.code == 400 and result.error.param == "vllm_xargs"
        assert result.error.message.startswith("graphchunk_boundaries must be a list of integer token indices")
    else:
        assert ran and result == "created"
    ran.clear()
    assert call('{"prompt": [1, 2], "vllm_xargs": {"graphchunk_boundaries": [1, 5]}}') == "created" and ran
    ran.clear()
    result = call('{"prompt": [1, 2], "use_beam_search": true, "vllm_xargs": {"graphchunk_boundaries": [1]}}')
    if rejected:
        assert not ran and result.error.code == 400 and result.error.param == "use_beam_search"
    else:
        assert ran and result == "created"


@pytest.mark.parametrize("body, refused", [
    ({"messages": [], "documents": [{"text": "a"}], "use_beam_search": True}, True),
    ({"messages": [], "chat_template_kwargs": {"documents": [{"text": "a"}]}, "use_beam_search": "yes"}, True),
    ({"messages": [], "chat_template_kwargs": {"graphchunk_document_parts": True}, "use_beam_search": 1}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "graphchunk_document": True},
                                                {"type": "text", "text": "q"}]}], "use_beam_search": True}, True),
    ({"prompt": [1, 2], "vllm_xargs": {MODE_ARG: "blend"}, "use_beam_search": True}, True),
    ({"prompt": "a ## b ## c", "vllm_xargs": {SEPARATOR_ARG: "##"}, "use_beam_search": True}, True),
    ({"messages": [], "documents": [{"text": "a"}], "vllm_xargs": {MODE_ARG: "off"}, "use_beam_search": True}, False),
    ({"prompt": [1, 2], "vllm_xargs": {BOUNDARIES_ARG: [1]}, "use_beam_search": "false"}, False),
    ({"prompt": "sys ## doc ## question", "use_beam_search": True}, False),  # the separators are in the tokens
    ({"messages": [], "documents": [], "chat_template_kwargs": {"graphchunk_document_parts": False},
      "use_beam_search": True}, False),
    ({"prompt": [1, 2], "vllm_xargs": {"other_plugin_flag": 1}, "use_beam_search": True}, False),
])
def test_beam_search_is_refused_where_it_would_drop_the_chunks(body, refused):
    """vLLM's beam search runs each step as token ids alone: documents and graphchunk_* vllm_xargs
    would be lost, so those requests are refused by name; a separator prompt keeps its chunks."""
    problem = beam_search_problem(body)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("use_beam_search cannot carry graphchunk's chunks")


def test_generate_keywords_and_precedence(tokenizer):
    """GraphChunkLLM.generate: sampling params < the call's keywords < a RagPrompt's extra."""
    from graphchunk.llm import GraphChunkLLM, RagPrompt

    llm = object.__new__(GraphChunkLLM)
    llm.tokenizer = tokenizer
    calls = []
    llm.llm = SimpleNamespace(generate=lambda inputs, params, use_tqdm: calls.append((inputs, params)) or [])
    shared = SamplingParams(extra_args={MODE_ARG: "isolated", "other": 1})
    prompts = ["plain text", RagPrompt("S", ["a", "b"], "q?"),
               RagPrompt("S", ["a"], "q?", extra={RECOMPUTE_ARG: "legolink", BOUNDARIES_ARG: [9]})]
    llm.generate(prompts, shared, mode="blend", recompute="cacheblend", recompute_ratio=0.5)
    (inputs, params), = calls
    assert [p.extra_args.get(MODE_ARG) for p in params] == ["blend"] * 3
    assert [p.extra_args.get(RECOMPUTE_ARG) for p in params] == ["cacheblend", "cacheblend", "legolink"]
    assert all(p.extra_args[RATIO_ARG] == 0.5 and p.extra_args["other"] == 1 for p in params)
    assert all(TOKENS_ARG not in p.extra_args for p in params)
    assert params[2].extra_args[BOUNDARIES_ARG] != [9]  # the boundaries are always the encoded ones
    assert shared.extra_args == {MODE_ARG: "isolated", "other": 1}  # cloned, never changed
    calls.clear()
    llm.generate("plain text", shared)
    assert calls[0][1][0] is shared  # no keywords: the params go through as given


def test_a_context_that_can_never_fit_the_pool_is_refused_once_its_size_is_known(tokenizer):
    """Issue 63, point 3, in the API process: once the scheduler has published the chunk pool's
    size, a context needing more blocks than the pool holds is a bad request naming the pool, the
    context and the setting; a blend request of a ranking policy is not (it runs as vLLM's full
    prefill); before the size is known nothing is refused."""
    sizes = [None]
    annotator = RequestAnnotator(GraphChunkConfig(max_chunks=8, max_chunk_len=64, mode="isolated"), tokenizer,
                                 pool_size=lambda: sizes[0])
    ids = list(range(1000, 1031)) + list(range(2000, 2016)) + [3000, 3001]  # sys 31, 8 chunks of 2, question

    def req(**extra):
        return SimpleNamespace(prompt_token_ids=ids, cache_salt=None, sampling_params=SamplingParams(
            extra_args={BOUNDARIES_ARG: [31 + 2 * i for i in range(9)], **extra}))

    annotator.annotate(req())  # the pool's size unknown yet: planned as usual
    sizes[0] = (16, 32, 0)  # 1 + 8 x 2 = 17 blocks of 32 tokens needed
    with pytest.raises(ValueError, match=r"this request's context \(47 tokens: a system prompt and 8 chunks\) needs "
                                         r"17 blocks of graphchunk's chunk pool, which holds 16 blocks of 32 tokens; "
                                         r"raise graphchunk.pool_tokens to at least 544"):
        annotator.annotate(req())
    annotator.annotate(req(**{MODE_ARG: "blend", RECOMPUTE_ARG: "question"}))  # full prefill instead
    sizes[0] = (8, 32, 0)  # blend: 1 + 8 chunks computed after no prefix, a block each
    with pytest.raises(ValueError, match="needs 9 blocks"):
        annotator.annotate(req(**{MODE_ARG: "blend", RECOMPUTE_ARG: "legolink"}))
    sizes[0] = (17, 32, 0)
    annotator.annotate(req())


def test_an_engines_annotator_reads_its_own_pools_size(tmp_path, monkeypatch):
    """``published_pool`` reads the metrics file it was bound to (``GraphChunkLLM`` binds its own at
    start-up), not the one a later engine of the same program names; nothing before a size is
    published."""
    from graphchunk.engine.plugin import published_pool
    from graphchunk.metrics import METRICS_FILE_ENV, CacheMetrics, MetricsPublisher

    ours, later = str(tmp_path / "ours.bin"), str(tmp_path / "later.bin")
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=32), model_config=None)
    pool_size = published_pool(config, GraphChunkConfig(), ours)
    assert pool_size() is None
    for path, blocks in ((ours, 33), (later, 1)):
        MetricsPublisher(path).publish(CacheMetrics(pool_blocks_total=blocks))
    monkeypatch.setenv(METRICS_FILE_ENV, later)
    assert pool_size() == (33, 32, 0)


def test_a_failed_request_raises_holding_every_output(tokenizer):
    """GraphChunkLLM.generate and chat raise RequestFailed when a request finished with vLLM's
    finish reason 'error', naming it; the call's outputs ride on the exception."""
    from graphchunk.llm import GraphChunkLLM, RequestFailed

    def output(req_id, reason):
        return SimpleNamespace(request_id=req_id, outputs=[SimpleNamespace(finish_reason=reason)])

    outputs = [output("0", "length"), output("1", "error")]
    llm = object.__new__(GraphChunkLLM)
    llm.tokenizer = tokenizer
    llm.llm = SimpleNamespace(generate=lambda *args, **kwargs: outputs, chat=lambda *args, **kwargs: outputs)
    for call in (lambda: llm.generate(["a", "b"]), lambda: llm.chat([{"role": "user", "content": "a"}])):
        with pytest.raises(RequestFailed, match=r"1 of 2 requests failed \(finish reason 'error'\): \['1'\]") as info:
            call()
        assert info.value.outputs is outputs
    outputs[1] = output("1", "stop")
    assert llm.generate(["a", "b"]) is outputs


DEFAULT_CONFIG = GraphChunkConfig(max_chunks=4, max_chunk_len=64)
"""As installed: no separator."""
UNMARKED = ["x = load()  ## read the input\ny = parse(x)  ## then parse it\nWhat does this code do?",
            "# Notes\n\n## Setup\nRun it ## twice, then ## once more.\n### Done",
            "How do I write a LINQ query in C#? ## In C# ## or in F#?",
            RAG]


@pytest.mark.parametrize("text", UNMARKED)
def test_unmarked_requests_are_left_as_they_came(tokenizer, text):
    """A deployment with the default settings touches no request that is not marked, whatever its
    text holds (code comments, Markdown, C#, the seeds' form itself): no arguments added, the salt
    as sent, nothing segmented. The mode arguments of an unmarked request are checked and dropped."""
    for extra in ({}, {MODE_ARG: "blend", RATIO_ARG: 0.5}, {"other": 1}):
        req = annotated(tokenizer, DEFAULT_CONFIG, text=text, **extra)
        assert req.sampling_params.extra_args == ({"other": 1} if "other" in extra else None)
        assert req.cache_salt == "tenant"


def test_a_request_asks_for_the_seeds_form_with_its_separator(tokenizer):
    """graphchunk_separator splits this request's prompt where the text stands as a word inside a
    line, as the deployment's separator would; the argument does not reach the worker."""
    per_request = annotated(tokenizer, DEFAULT_CONFIG, **{SEPARATOR_ARG: "##"})
    deployment = annotated(tokenizer, ISOLATED_CONFIG)
    assert per_request.sampling_params.extra_args[BOUNDARIES_ARG] == deployment.sampling_params.extra_args[BOUNDARIES_ARG]
    assert SEPARATOR_ARG not in per_request.sampling_params.extra_args
    other = annotated(tokenizer, DEFAULT_CONFIG, text=RAG.replace("##", "@@"), **{SEPARATOR_ARG: " @@ "})
    assert len(other.sampling_params.extra_args[BOUNDARIES_ARG]) == 3  # sys, two documents, the question
    untokenized = RequestAnnotator(DEFAULT_CONFIG, None)  # an engine started with skip_tokenizer_init
    with pytest.raises(SegmentationError, match="this engine has no tokenizer .*: send graphchunk_boundaries"):
        untokenized.annotate(request(tokenizer, RAG, extra_args={SEPARATOR_ARG: "##"}))


def test_mode_off_runs_any_request_as_vanilla(tokenizer):
    """graphchunk_mode 'off' leaves a request as vanilla vLLM gets it, on a deployment whose
    separator would split it too; a documents request runs as an ordinary prompt (counted)."""
    for config in (ISOLATED_CONFIG, BLEND_CONFIG, DEFAULT_CONFIG):
        req = annotated(tokenizer, config, **{MODE_ARG: "off"}, other=1)
        assert req.sampling_params.extra_args == {"other": 1} and req.cache_salt == "tenant"
    ann = RequestAnnotator(ISOLATED_CONFIG, tokenizer)
    req = request(tokenizer, RAG, salt="tenant", extra_args={MODE_ARG: "off"})
    ann.annotate(req, documents=DocumentBoundaries((3, 9), len(req.prompt_token_ids)))
    assert req.sampling_params.extra_args == {UNCHUNKED_ARG: True} and req.cache_salt == "tenant"


class _GraphChunkWorker:
    """Stands for ``graphchunk.Runner`` (``make_worker_class`` names it ``graphchunk.Worker``)."""


_GraphChunkWorker.__module__, _GraphChunkWorker.__qualname__ = "graphchunk", "Worker"


class OwnWorker(_GraphChunkWorker):
    """A deployment's worker built on graphchunk's."""


class OtherWorker:
    pass


def test_worker_detection():
    assert is_graphchunk_worker("graphchunk.Runner")
    assert not is_graphchunk_worker("auto") and not is_graphchunk_worker("vllm.v1.worker.cpu_worker.CPUWorker")
    # A subclass of graphchunk's worker is graphchunk's worker, by class or by the name vLLM resolves.
    assert is_graphchunk_worker(OwnWorker) and is_graphchunk_worker(f"{__name__}.OwnWorker")
    assert not is_graphchunk_worker(OtherWorker) and not is_graphchunk_worker(f"{__name__}.OtherWorker")


def test_blend_requests_refused_for_a_model_whose_keys_cannot_move(tokenizer):
    """The default mode 'auto' is isolated there (and says so when a blend argument comes alone)."""
    ann = RequestAnnotator(GraphChunkConfig(), tokenizer, blend_refusal="dynamic NTK scaling changes ...")
    with pytest.raises(SegmentationError, match="blend mode is not available for this model: dynamic NTK"):
        resolve_mode({MODE_ARG: "blend"}, ann.config, ann.blend_refusal)
    assert resolve_mode({}, ann.config, ann.blend_refusal) == ("isolated", None)
    with pytest.raises(SegmentationError, match=r"default mode \(graphchunk.mode='auto'\) is 'isolated'"):
        resolve_mode({RECOMPUTE_ARG: "none"}, ann.config, ann.blend_refusal)


def test_the_default_mode_is_blend_where_the_model_can_blend(tokenizer):
    """'auto' (the default): a segmented request naming no mode runs as blend with the default
    policy; one naming isolated runs isolated; an explicit default mode is kept."""
    auto = GraphChunkConfig(max_chunks=4, max_chunk_len=64, separator="##")
    assert auto.mode == "auto" and auto.default_mode(None) == "blend" and auto.default_mode("no RoPE") == "isolated"
    assert resolved(annotated(tokenizer, auto)) == {MODE_ARG: "blend", RECOMPUTE_ARG: "question", RATIO_ARG: 0.3,
                                                   TOKENS_ARG: 15}
    assert resolved(annotated(tokenizer, auto, **{MODE_ARG: "isolated"})) == {MODE_ARG: "isolated",
                                                                             TEMPERATURE_ARG: 1.0}
    assert resolve_mode({}, ISOLATED_CONFIG)[0] == "isolated"
