"""Request side of graphchunk, in the process that tokenizes (API server or ``LLM``).

Segmentation happens here, once per request, so that bad input becomes a 400 (or a
``ValueError`` from ``GraphChunkLLM``) before anything reaches the engine. The segment start
indices travel to the worker in ``SamplingParams.extra_args``, and the request's ``cache_salt``
gains a fingerprint of its layout: vLLM's prefix cache then never hands a segmented request KV
computed under other segment roles, nor hands its KV to an ordinary request (DESIGN.md §3).
"""
from __future__ import annotations

import xxhash

from graphchunk.config import GraphChunkConfig
from graphchunk.segments import SegmentationError, SegmentedPrompt, SeparatorSplitter, split_at

BOUNDARIES_ARG = "graphchunk_boundaries"
"""extra_args / vllm_xargs key: start indices of each chunk and of the question."""
SALT_ARG = "graphchunk_salt"
"""extra_args key set here: what besides tokens and model sets a chunk's KV (the request's own
cache_salt, for tenant isolation, and its LoRA adapter); part of every chunk key."""


def is_graphchunk_worker(worker_cls) -> bool:
    name = worker_cls if isinstance(worker_cls, str) else f"{worker_cls.__module__}.{worker_cls.__qualname__}"
    return name.startswith("graphchunk.")


class RequestAnnotator:
    def __init__(self, config: GraphChunkConfig, tokenizer):
        self.config = config
        self.splitter = SeparatorSplitter(tokenizer, config.separator, max_chunks=config.max_chunks,
                                          max_chunk_len=config.max_chunk_len) if config.separator else None

    def segment(self, token_ids: list[int], extra_args: dict) -> SegmentedPrompt | None:
        """The request's segmentation; None for an ordinary prompt. Raises ValueError on bad input."""
        if BOUNDARIES_ARG in extra_args:
            boundaries = extra_args[BOUNDARIES_ARG]
            if not isinstance(boundaries, list):
                raise SegmentationError(f"{BOUNDARIES_ARG} must be a list of token indices, got {boundaries!r}")
            return split_at(token_ids, boundaries, max_chunks=self.config.max_chunks,
                            max_chunk_len=self.config.max_chunk_len)
        return self.splitter.split(token_ids) if self.splitter else None

    def annotate(self, request) -> None:
        """Adds the segmentation to an EngineCoreRequest (in place), or leaves it ordinary."""
        params = request.sampling_params
        if params is None or request.prompt_token_ids is None:
            return
        args = dict(params.extra_args or {})
        args.pop(SALT_ARG, None)
        seg = self.segment(request.prompt_token_ids, args)
        if seg is None or seg.layout.num_chunks == 0:
            args.pop(BOUNDARIES_ARG, None)  # no chunks: exactly an ordinary causal prompt
            params.extra_args = args or None
            return
        if params.prompt_logprobs is not None:
            raise SegmentationError("prompt_logprobs are not available for segmented prompts")
        if getattr(request, "mm_features", None):
            raise SegmentationError("segmented prompts cannot carry multimodal inputs")
        args[BOUNDARIES_ARG] = [b for b, _ in seg.bounds[1:]]
        args[SALT_ARG] = kv_salt(request)
        params.extra_args = args
        request.cache_salt = f"{request.cache_salt or ''}|graphchunk:{layout_fingerprint(seg)}"


def kv_salt(request) -> str | None:
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return request.cache_salt
    return f"{request.cache_salt or ''}|lora:{lora.lora_name}"


def layout_fingerprint(seg: SegmentedPrompt) -> str:
    lay = seg.layout
    return xxhash.xxh3_64_hexdigest(repr((lay.sys_len, lay.chunk_lens, lay.question_len)).encode())
