"""Request annotation in the API process: boundaries into extra_args, layout into cache_salt."""
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from graphchunk.config import GraphChunkConfig
from graphchunk.frontend import BOUNDARIES_ARG, SALT_ARG, RequestAnnotator, is_graphchunk_worker
from graphchunk.segments import SegmentationError


@pytest.fixture(scope="module")
def annotator(tokenizer):
    return RequestAnnotator(GraphChunkConfig(max_chunks=4, max_chunk_len=64), tokenizer)


def request(tokenizer, text, salt=None, **params):
    return SimpleNamespace(prompt_token_ids=tokenizer.encode(text), cache_salt=salt,
                           sampling_params=SamplingParams(**params))


def test_separator_prompt_gets_boundaries_and_a_layout_salt(tokenizer, annotator):
    req = request(tokenizer, "Sys. ## Doc one. ## Doc two. ## Question?", salt="tenant")
    annotator.annotate(req)
    args = req.sampling_params.extra_args
    assert len(args[BOUNDARIES_ARG]) == 3 and args[SALT_ARG] == "tenant"
    assert req.cache_salt.startswith("tenant|graphchunk:")


def test_lora_adapter_is_part_of_the_chunk_salt(tokenizer, annotator):
    req = request(tokenizer, "Sys. ## Doc one. ## Question?", salt="tenant")
    req.lora_request = SimpleNamespace(lora_name="legal-v2")
    annotator.annotate(req)
    assert req.sampling_params.extra_args[SALT_ARG] == "tenant|lora:legal-v2"


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


def test_ordinary_prompt_is_untouched(tokenizer, annotator):
    req = request(tokenizer, "What is the capital of France?", salt="s")
    annotator.annotate(req)
    assert req.cache_salt == "s" and not req.sampling_params.extra_args


def test_explicit_boundaries(tokenizer, annotator):
    req = request(tokenizer, "a b c d e f g h", extra_args={BOUNDARIES_ARG: [2, 4, 6], SALT_ARG: "forged"})
    annotator.annotate(req)
    assert req.sampling_params.extra_args == {BOUNDARIES_ARG: [2, 4, 6], SALT_ARG: None}
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


def test_worker_detection():
    assert is_graphchunk_worker("graphchunk.Runner")
    assert not is_graphchunk_worker("auto") and not is_graphchunk_worker("vllm.v1.worker.cpu_worker.CPUWorker")
