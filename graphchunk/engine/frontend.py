"""Request side of graphchunk, in the process that tokenizes (API server or ``LLM``): the request
annotator.

Segmentation happens here, once per request, so that bad input becomes a 400 (or a
``ValueError`` from ``GraphChunkLLM``) before anything reaches the engine. The segment start
indices travel to the worker in ``SamplingParams.extra_args``, and the request's ``cache_salt``
gains a fingerprint of its layout: vLLM's prefix cache then never hands a segmented request KV
computed under other segment roles, nor hands its KV to an ordinary request (DESIGN.md §3).

A request is segmented only when it is marked: documents, explicit boundaries
(``BOUNDARIES_ARG``), a separator it asks for (``SEPARATOR_ARG``), or the deployment's separator
where an operator turned it on (``graphchunk.separator``, off by default). Any other request, and
one that sends ``graphchunk_mode: 'off'``, runs exactly as in vanilla vLLM.

The request arguments read here, their validation and what a segmented request carries to the
worker (the *resolved* mode and policy, read back there by ``chunk_request``) are
``request_args.py``.
"""
from __future__ import annotations

import functools
import importlib
import json
import secrets
from dataclasses import dataclass

import numpy as np
import xxhash

from graphchunk.blend.recompute import RecomputePolicy
from graphchunk.cache.context_plan import context_blocks
from graphchunk.config import GraphChunkConfig
from graphchunk.engine.request_args import (BOUNDARIES_ARG, GRAPHCHUNK_ARGS, MODE_ARG, MODE_ARGS, OFF, POLICY_ARGS,
                                            SALT_ARG, SEPARATOR_ARG, TEMPERATURE_ARG, UNCHUNKED_ARG, policy_args,
                                            resolve_mode, resolve_separator, resolve_temperature)
from graphchunk.segments import SegmentationError, SegmentedPrompt, SeparatorSplitter, split_at

DOCUMENTS_KEY = "graphchunk_documents"
"""Key of a rendered prompt dict (and the engine input made of it) carrying a documents request's
``DocumentBoundaries`` from vLLM's renderer to ``annotate`` (``document_hooks``)."""
NONCE_MARK = ":nonce-"
"""Marks a ranking blend policy's salt nonce (``blend_salt``): the engine core appends the request's
own id after it, so that the children of an ``n > 1`` request, which vLLM copies from one
annotated request, never share it."""
SALT_MARK = "|graphchunk:"
"""What ``annotate`` appends to a segmented request's ``cache_salt``; refused in a client's own salt,
which could otherwise claim another layout's KV in vLLM's prefix cache, or plant causal KV there."""


def is_graphchunk_worker(worker_cls) -> bool:
    """Whether vLLM's ``worker_cls`` (a qualified name, or the class) is graphchunk's worker or a
    subclass of it (a deployment's own worker built on ``graphchunk.Runner``)."""
    if isinstance(worker_cls, str):
        return _names_graphchunk_worker(worker_cls)
    return any(f"{cls.__module__}.{cls.__qualname__}".startswith("graphchunk.") for cls in worker_cls.__mro__)


@functools.cache
def _names_graphchunk_worker(name: str) -> bool:
    if name.startswith("graphchunk."):
        return True
    if name == "auto" or name.startswith("vllm.") or "." not in name:
        return False
    module, _, attr = name.rpartition(".")
    return is_graphchunk_worker(getattr(importlib.import_module(module), attr))  # as vLLM resolves it


@dataclass(frozen=True)
class DocumentBoundaries:
    """Where a documents request's chunks start (and its question), and how many tokens its
    prompt had when they were found."""
    boundaries: tuple[int, ...]
    num_tokens: int


class RequestAnnotator:
    def __init__(self, config: GraphChunkConfig, tokenizer, blend_refusal: str | None = None,
                 temperature_refusal: str | None = None, pool_size=None):
        """``blend_refusal``: why this model cannot serve blend requests (``rope.blend_refusal``);
        ``temperature_refusal``: why it cannot take a key temperature (``temperature_refusal``);
        ``pool_size()``: the chunk pool's (blocks, block size, blend prefix tokens), None while
        unknown (``plugin.published_pool``)."""
        self.config = config
        self.blend_refusal = blend_refusal
        self.temperature_refusal = temperature_refusal
        self.tokenizer = tokenizer
        self.pool_size = pool_size

    @functools.cached_property
    def splitter(self) -> SeparatorSplitter:
        """Separator detection over the tokenizer's pieces (built at the first request that asks)."""
        if self.tokenizer is None:
            raise SegmentationError("a separator is found in the prompt's text, and this engine has no tokenizer "
                                    f"(skip_tokenizer_init): send {BOUNDARIES_ARG}")
        return SeparatorSplitter(self.tokenizer, self.config.separator or "##", max_chunks=self.config.max_chunks,
                                 max_chunk_len=self.config.max_chunk_len)

    def segment(self, token_ids: list[int], extra_args: dict,
                documents: DocumentBoundaries | None = None) -> SegmentedPrompt | None:
        """The request's segmentation; None for an ordinary prompt. Raises ValueError on bad input.
        A documents request (``documents``) is split where its documents are; it never runs
        separator detection and cannot also send boundaries or a separator; one without
        boundaries runs as an ordinary prompt (``documents_fallback``). Otherwise explicit
        boundaries, or the request's separator (``SEPARATOR_ARG``), or the deployment's."""
        separator = resolve_separator(extra_args, self.config)
        if documents is not None:
            for key in (BOUNDARIES_ARG, SEPARATOR_ARG):
                if key in extra_args:
                    raise SegmentationError(f"a request with documents cannot also send {key}: "
                                            "the documents are its chunks")
            if not documents.boundaries:
                return None
            if len(token_ids) != documents.num_tokens:
                raise SegmentationError("a documents request's prompt cannot be truncated "
                                        "(truncate_prompt_tokens): its chunks would move")
            return split_at(token_ids, list(documents.boundaries), max_chunks=self.config.max_chunks,
                            max_chunk_len=self.config.max_chunk_len)
        if BOUNDARIES_ARG in extra_args:
            if SEPARATOR_ARG in extra_args:
                raise SegmentationError(f"send {BOUNDARIES_ARG} or {SEPARATOR_ARG}, not both: each marks the chunks")
            boundaries = extra_args[BOUNDARIES_ARG]
            if not isinstance(boundaries, list):
                raise SegmentationError(f"{BOUNDARIES_ARG} must be a list of token indices, got {boundaries!r}")
            return split_at(token_ids, boundaries, max_chunks=self.config.max_chunks,
                            max_chunk_len=self.config.max_chunk_len)
        return self.splitter.split(token_ids, separator) if separator else None

    def annotate(self, request, documents: DocumentBoundaries | None = None) -> None:
        """Adds the segmentation to an EngineCoreRequest (in place), or leaves it ordinary;
        ``documents``: where a documents request's chunks are (``document_hooks``)."""
        params = request.sampling_params
        if params is None or request.prompt_token_ids is None:
            return
        if SALT_MARK in (request.cache_salt or ""):
            raise SegmentationError(f"cache_salt must not contain {SALT_MARK!r}: graphchunk marks the salt of its "
                                    f"segmented requests with it, so that vLLM's prefix cache keeps their KV apart")
        args = dict(params.extra_args or {})
        args.pop(SALT_ARG, None)
        args.pop(UNCHUNKED_ARG, None)
        if args.get(MODE_ARG) == OFF:
            others = [key for key in GRAPHCHUNK_ARGS if key in args and key != MODE_ARG]
            if others:
                raise SegmentationError(f"{MODE_ARG} 'off' runs the request as in vanilla vLLM; it takes no "
                                        f"{', '.join(others)}")
            args.pop(MODE_ARG)
            if documents is not None:  # placed by graphchunk's renderer; run as an ordinary prompt
                args[UNCHUNKED_ARG] = True
            params.extra_args = args or None
            return
        mode, policy = resolve_mode(args, self.config, self.blend_refusal)
        temperature = resolve_temperature(args, self.config, mode, self.temperature_refusal)
        seg = self.segment(request.prompt_token_ids, args, documents)
        args.pop(SEPARATOR_ARG, None)
        if seg is None or seg.layout.num_chunks == 0:
            for key in (BOUNDARIES_ARG, *MODE_ARGS):  # no chunks: exactly an ordinary causal prompt
                args.pop(key, None)
            if documents is not None:
                args[UNCHUNKED_ARG] = True
            params.extra_args = args or None
            return
        if params.prompt_logprobs is not None:
            raise SegmentationError("prompt_logprobs are not available for segmented prompts")
        if params.skip_reading_prefix_cache:
            raise SegmentationError("skip_reading_prefix_cache is not available for segmented prompts: vLLM then "
                                    "skips KV connectors too, and graphchunk loads their context through one")
        if getattr(request, "mm_features", None):
            raise SegmentationError("segmented prompts cannot carry multimodal inputs")
        self.check_fits(seg, mode, policy)
        args[BOUNDARIES_ARG] = [b for b, _ in seg.bounds[1:]]
        args[SALT_ARG] = kv_salt(request)
        for key in (TEMPERATURE_ARG, *POLICY_ARGS):
            args.pop(key, None)
        args[MODE_ARG] = mode
        if policy is None:
            args[TEMPERATURE_ARG] = temperature
            fingerprint = layout_fingerprint(seg, temperature)
        else:
            args.update(policy_args(policy))
            fingerprint = blend_fingerprint(seg, policy)
        params.extra_args = args
        request.cache_salt = f"{request.cache_salt or ''}{SALT_MARK}{fingerprint}"

    def check_fits(self, seg: SegmentedPrompt, mode: str, policy: RecomputePolicy | None) -> None:
        """Refuses, before it is queued, a context that can never fit the chunk pool
        (``context_plan.context_blocks``), once the pool's size is known; not a blend request of a
        ranking policy, which then runs as vLLM's full prefill (``ContextScheduler.matched``)."""
        size = self.pool_size() if self.pool_size is not None else None
        if size is None or policy is not None and policy.needs_check:
            return
        num_blocks, block_size, prefix_len = size
        needed = context_blocks(seg, mode, block_size, prefix_len)
        if needed > num_blocks:
            raise SegmentationError(
                f"this request's context ({seg.layout.context_len} tokens: a system prompt and "
                f"{seg.layout.num_chunks} chunks) needs {needed} blocks of graphchunk's chunk pool, which holds "
                f"{num_blocks} blocks of {block_size} tokens; raise graphchunk.pool_tokens to at least "
                f"{needed * block_size}, or send fewer or shorter chunks (each {mode} chunk's entry takes whole "
                f"blocks)")


def temperature_refusal(hf_config) -> str | None:
    """Why a key temperature cannot scale this model's attention logits, from its HF config; None
    when it can. Dividing keys by T divides q.k by T only where the logits are plain dot products."""
    config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention logits are soft-capped (attn_logit_softcapping), so scaling keys is not a temperature"
    return None


def kv_salt(request) -> str | None:
    """What besides tokens and model sets a chunk's KV: the request's cache_salt and LoRA adapter,
    written so that no salt a client sends reads as another salt and adapter."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None if request.cache_salt is None else json.dumps([request.cache_salt])
    return json.dumps([request.cache_salt, lora.lora_name])


def one_tenant(salt: str | None) -> bool:
    """Whether a chunk-key salt (``kv_salt``) carries a client's non-empty ``cache_salt``: one trust
    domain, the only place where a request's own prefill may become the blend entry another
    request's answer is computed from (``blend_entries`` 'context', DESIGN.md §2)."""
    return salt is not None and bool(json.loads(salt)[0])


def layout_fingerprint(seg: SegmentedPrompt, key_temperature: float = 1.0) -> str:
    """Isolated mode: a segment's KV depends on its own tokens and the tokens before it in the
    sys-then-own-chunk order, and on the roles of the segments (the layout). vLLM's prefix cache
    hashes every block together with all tokens before it, so adding the layout suffices; and
    the key temperature the request's copied chunk keys were divided by, where it is not 1."""
    lay = seg.layout
    what = (lay.sys_len, lay.chunk_lens, lay.question_len) + ((key_temperature,) if key_temperature != 1 else ())
    return xxhash.xxh3_64_hexdigest(repr(what).encode())


def blend_fingerprint(seg: SegmentedPrompt, policy: RecomputePolicy) -> str:
    """Blend mode: never equal to an isolated fingerprint (its own prefix, another length).

    A blend request's context KV is not a function of the tokens up to a block, which is all
    vLLM's prefix-cache key covers (a block's hash chains the tokens before it and the salt):
    CacheBlend recomputes the top ``ratio`` share of the chunk tokens a step fills, ranked
    together, so whether a token of block b got fresh or reused KV depends on the deviations of
    chunk tokens *after* b. Two requests that agree up to b but differ later would get different
    KV for b. So the salt carries the policy (``describe()``: the policy and its parameter),
    the context layout (the segment roles), and a hash of *all* context tokens: vLLM's prefix
    cache then shares blend KV only between requests with identical context, layout and policy
    (and request salt). The question is left out (its length too): its tokens are ordinary
    causal tokens after the whole context, and a new question over the same documents should
    still find the whole context in vLLM's prefix cache. ``none`` and ``legolink`` do not look
    ahead, but keying them the same way keeps the rule simple and costs them nothing in the
    common case (identical documents). The ``question`` policy picks by the question's attention:
    its context KV depends on the question, so its salt hashes the whole prompt.

    That still leaves one way to differ: vLLM's prefix cache hands out whole blocks, so a request
    that shares the context of another (or the whole prompt) gets a hit ending at the last full
    block before its question, and recomputes only the rest. Where a policy ranks the context
    (cacheblend and question with a ratio strictly between 0 and 1: ``needs_check``), a ranking of
    that rest alone picks other tokens than the ranking of the whole context, over KV that the
    other request's recompute has already changed. So their salt also carries a nonce
    (``NONCE_MARK``): vLLM's prefix cache never shares their KV between requests (the chunks still
    come from the pool; the system prompt is copied from it too). vLLM copies a request with
    ``n > 1`` into its children after this, salt included, so the engine core appends each
    child's request id to such a salt (``plugin._distinct_sibling_salts``). Policies that pick by
    position (legolink, none, ratio 0 or 1) pick the same tokens of a block whatever follows it
    and share."""
    lay = seg.layout
    digest = xxhash.xxh3_128()
    digest.update(repr(("blend", policy.describe(), lay.sys_len, lay.chunk_lens)).encode())
    hashed = lay.num_tokens if policy.name == "question" else lay.context_len
    digest.update(np.asarray(seg.token_ids[:hashed], dtype=np.int64).tobytes())
    nonce = f"{NONCE_MARK}{secrets.token_hex(8)}" if policy.needs_check else ""
    return f"blend:{policy.describe()}:{digest.hexdigest()}{nonce}"
