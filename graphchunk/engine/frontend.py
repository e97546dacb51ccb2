"""Request side of graphchunk, in the process that tokenizes (API server or ``LLM``).

Segmentation happens here, once per request, so that bad input becomes a 400 (or a
``ValueError`` from ``GraphChunkLLM``) before anything reaches the engine. The segment start
indices travel to the worker in ``SamplingParams.extra_args``, and the request's ``cache_salt``
gains a fingerprint of its layout: vLLM's prefix cache then never hands a segmented request KV
computed under other segment roles, nor hands its KV to an ordinary request (DESIGN.md §3).

A request is segmented only when it is marked: documents, explicit boundaries
(``BOUNDARIES_ARG``), a separator it asks for (``SEPARATOR_ARG``), or the deployment's separator
where an operator turned it on (``graphchunk.separator``, off by default). Any other request, and
one that sends ``graphchunk_mode: 'off'``, runs exactly as in vanilla vLLM.

The mode (``isolated`` or ``blend``, DESIGN.md §2) and blend's recompute policy are chosen per
request through extra_args (OpenAI: ``vllm_xargs``), defaulting to the deployment's settings.
They are validated here for every request, and a segmented request carries the *resolved*
values to the worker (``MODE_ARG`` always; for isolated also ``TEMPERATURE_ARG``, for blend
``POLICY_ARGS``); an ordinary request loses them (it runs as
vanilla vLLM).
"""
from __future__ import annotations

import functools
import importlib
import json
import secrets
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from graphchunk.blend.recompute import POLICIES, SPREADS, RecomputePolicy
from graphchunk.cache.context_plan import context_blocks
from graphchunk.config import MODES, GraphChunkConfig, valid_key_temperature
from graphchunk.documents import asks_for_documents
from graphchunk.segments import SegmentationError, SegmentedPrompt, SeparatorSplitter, split_at

BOUNDARIES_ARG = "graphchunk_boundaries"
"""extra_args / vllm_xargs key: start indices of each chunk and of the question."""
SALT_ARG = "graphchunk_salt"
"""extra_args key set here: what besides tokens and model sets a chunk's KV (the request's own
cache_salt, for tenant isolation, and its LoRA adapter); part of every chunk key."""
MODE_ARG = "graphchunk_mode"
"""extra_args / vllm_xargs key: 'isolated' or 'blend' (default: ``graphchunk.mode``, 'auto': blend where
the model can blend), or 'off': the request runs as in vanilla vLLM, whatever it holds."""
OFF = "off"
REQUEST_MODES = (*MODES, OFF)
"""What a request may send as ``MODE_ARG``."""
SEPARATOR_ARG = "graphchunk_separator"
"""extra_args / vllm_xargs key: the seeds' form for this request: its prompt split where this text
(e.g. '##') stands as a word of its own inside a line (default: ``graphchunk.separator``, off)."""
RECOMPUTE_ARG = "graphchunk_recompute"
"""blend: recompute policy, 'none', 'cacheblend', 'legolink' or 'question' (default: ``graphchunk.recompute``)."""
RATIO_ARG = "graphchunk_recompute_ratio"
"""blend, cacheblend and question: share of chunk tokens recomputed, in [0, 1] (default: ``graphchunk.recompute_ratio``)."""
TOKENS_ARG = "graphchunk_recompute_tokens"
"""blend, legolink: tokens recomputed at each chunk's start (default: ``graphchunk.recompute_tokens``)."""
SINKS_ARG = "graphchunk_recompute_sinks"
"""blend, cacheblend and question: the first tokens of each chunk recomputed within the ratio (default: ``graphchunk.recompute_sinks``)."""
SPREAD_ARG = "graphchunk_recompute_spread"
"""blend, cacheblend and question: the ratio over the context ('context') or per chunk ('chunk') (default: ``graphchunk.recompute_spread``)."""
LAYERS_ARG = "graphchunk_recompute_layers"
"""blend, question: the scoring pass's depth, the model's first layers (0: every layer; default: ``graphchunk.recompute_layers``)."""
BLOCK_ARG = "graphchunk_recompute_block"
"""blend, cacheblend and question: tokens picked in blocks of this many of a chunk, 1: single tokens (default: ``graphchunk.recompute_block``)."""
TEMPERATURE_ARG = "graphchunk_key_temperature"
"""isolated: the question's logits to chunk tokens divided by it, a number > 0 (default:
``graphchunk.key_temperature``)."""
UNCHUNKED_ARG = "graphchunk_documents_unchunked"
"""extra_args key set here: a documents request run as an ordinary prompt (``documents_fallback``),
counted by the worker."""
DOCUMENTS_KEY = "graphchunk_documents"
"""Key of a rendered prompt dict (and the engine input made of it) carrying a documents request's
``DocumentBoundaries`` from vLLM's renderer to ``annotate`` (``document_hooks``)."""
POLICY_ARGS = (RECOMPUTE_ARG, RATIO_ARG, TOKENS_ARG, SINKS_ARG, SPREAD_ARG, LAYERS_ARG, BLOCK_ARG)
MODE_ARGS = (MODE_ARG, TEMPERATURE_ARG, *POLICY_ARGS)
GRAPHCHUNK_ARGS = (BOUNDARIES_ARG, SEPARATOR_ARG, *MODE_ARGS)
"""The keys a client may send."""
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
        """``blend_refusal``: why this model cannot serve blend requests (``rope.hf_rope_refusal``);
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
        separator = _separator(extra_args, self.config)
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
            args.update({key: getattr(policy, field) for key, field in _POLICY_FIELDS.items()})
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


def _separator(extra_args: dict, config: GraphChunkConfig) -> str:
    """The separator a request is split at: its own (``SEPARATOR_ARG``, checked), else the
    deployment's; '' for none."""
    if SEPARATOR_ARG not in extra_args:
        return config.separator
    separator = extra_args[SEPARATOR_ARG]
    if not isinstance(separator, str) or not separator.strip():
        raise SegmentationError(f"{SEPARATOR_ARG} must be {_EXPECTED[SEPARATOR_ARG]} (e.g. '##'), got {separator!r}")
    return separator


def resolve_mode(extra_args: dict, config: GraphChunkConfig,
                 blend_refusal: str | None = None) -> tuple[str, RecomputePolicy | None]:
    """A request's mode and (blend) recompute policy, from its extra_args and the deployment's
    defaults (``config``). Raises SegmentationError naming the argument on bad input. The API
    process resolves every request with it and sends the resolved values; the worker reads them
    back with it (``chunk_request``)."""
    if MODE_ARG in extra_args:
        mode = extra_args[MODE_ARG]
        if not isinstance(mode, str) or mode not in MODES:  # 'off' never gets here (``annotate``)
            raise SegmentationError(f"{MODE_ARG} must be one of {REQUEST_MODES}, got {mode!r}")
    else:
        mode = config.default_mode(blend_refusal)
    given = [key for key in POLICY_ARGS if key in extra_args]
    if mode != "blend":
        if given:
            why = (f"{MODE_ARG} is {mode!r}" if MODE_ARG in extra_args
                   else f"the deployment's default mode (graphchunk.mode={config.mode!r}) is {mode!r}")
            raise SegmentationError(f"{', '.join(given)} only apply to blend mode, but {why}; "
                                    f"send {MODE_ARG}: 'blend' with them")
        return mode, None
    if blend_refusal:
        raise SegmentationError(f"blend mode is not available for this model: {blend_refusal}; "
                                f"send {MODE_ARG}: 'isolated'")
    default = config.policy
    fields = {field: extra_args.get(key, getattr(default, field)) for key, field in _POLICY_FIELDS.items()}
    try:
        policy = RecomputePolicy(**fields)
    except ValueError as combined:  # one argument at a time, so that the error names the one that is wrong
        for key, field in _POLICY_FIELDS.items():
            if key in extra_args:
                try:
                    RecomputePolicy(**{field: fields[field]})
                except ValueError as exc:
                    _, must, rest = str(exc).partition(" must ")
                    raise SegmentationError(f"{key} must {rest}" if must else f"{key}: {exc}") from None
        raise SegmentationError(str(combined)) from None
    # ratio as a float: 1 and 1.0 are one policy (one describe(), one cache_salt).
    return mode, policy if isinstance(policy.ratio, float) else replace(policy, ratio=float(policy.ratio))


_POLICY_FIELDS = {RECOMPUTE_ARG: "name", RATIO_ARG: "ratio", TOKENS_ARG: "tokens", SINKS_ARG: "sinks",
                  SPREAD_ARG: "spread", LAYERS_ARG: "layers", BLOCK_ARG: "block"}


def resolve_temperature(extra_args: dict, config: GraphChunkConfig, mode: str,
                        refusal: str | None = None) -> float:
    """An isolated request's key temperature (``TEMPERATURE_ARG``, default ``config.key_temperature``);
    1.0 for blend, where sending one is an error. ``refusal``: why the model cannot take one."""
    if TEMPERATURE_ARG not in extra_args:
        temperature = config.key_temperature if mode == "isolated" else 1.0
    elif mode != "isolated":
        raise SegmentationError(f"{TEMPERATURE_ARG} only applies to isolated mode, but the request's mode is {mode!r}")
    else:
        temperature = extra_args[TEMPERATURE_ARG]
        if not valid_key_temperature(temperature):
            raise SegmentationError(f"{TEMPERATURE_ARG} must be {_EXPECTED[TEMPERATURE_ARG]}, got {temperature!r}")
    if temperature != 1 and refusal:
        raise SegmentationError(f"{TEMPERATURE_ARG} is not available for this model: {refusal}")
    return float(temperature)


def temperature_refusal(hf_config) -> str | None:
    """Why a key temperature cannot scale this model's attention logits, from its HF config; None
    when it can. Dividing keys by T divides q.k by T only where the logits are plain dot products."""
    config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention logits are soft-capped (attn_logit_softcapping), so scaling keys is not a temperature"
    return None


@dataclass(frozen=True)
class ChunkRequest:
    """A segmented request as the worker holds it: what ``annotate`` sent, read back."""
    seg: SegmentedPrompt
    salt: str | None
    policy: RecomputePolicy | None
    """Blend's recompute policy; None: isolated mode."""
    key_temperature: float = 1.0
    """Isolated mode: the question's logits to chunk tokens divided by it."""


def chunk_request(token_ids: list[int], extra_args: dict, config: GraphChunkConfig) -> ChunkRequest | None:
    """In the worker: the segmented request ``annotate`` made of this one, or None for an
    ordinary prompt (no boundaries sent, or no chunks)."""
    boundaries = extra_args.get(BOUNDARIES_ARG)
    if boundaries is None:
        return None
    seg = split_at(token_ids, boundaries, max_chunks=config.max_chunks, max_chunk_len=config.max_chunk_len)
    if not seg.layout.num_chunks:
        return None
    mode, policy = resolve_mode(extra_args, config)
    return ChunkRequest(seg, extra_args.get(SALT_ARG), policy, resolve_temperature(extra_args, config, mode))


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


_EXPECTED = {
    BOUNDARIES_ARG: "a list of integer token indices",
    MODE_ARG: f"one of {REQUEST_MODES}",
    SEPARATOR_ARG: "a text with a non-whitespace character",
    RECOMPUTE_ARG: f"one of {POLICIES}",
    RATIO_ARG: "a number in [0, 1]",
    TOKENS_ARG: "an integer >= 0",
    SINKS_ARG: "an integer >= 0",
    SPREAD_ARG: f"one of {SPREADS}",
    LAYERS_ARG: "an integer >= 0 (0: every layer)",
    BLOCK_ARG: "an integer >= 1 (1: single tokens)",
    TEMPERATURE_ARG: "a number > 0",
}


def request_body_problem(body) -> tuple[str, str] | None:
    """(the error, the parameter it names) for a raw OpenAI request body that a graphchunk engine
    refuses before vLLM runs it, or None: JSON booleans among graphchunk's ``vllm_xargs``, beam
    search on a request whose chunks it would lose."""
    problem = json_boolean_problem(body)
    if problem is not None:
        return problem, "vllm_xargs"
    problem = beam_search_problem(body)
    return None if problem is None else (problem, "use_beam_search")


def beam_search_problem(body) -> str | None:
    """The error for beam search on a request graphchunk chunks by its documents or its
    ``vllm_xargs``, or None. vLLM's beam search runs every step as a new request of token ids
    alone (``BeamSearchSequence.get_prompt``, ``BeamSearchParams`` without ``vllm_xargs``): the
    request's documents, ``graphchunk_boundaries`` and mode would be dropped and it would run as
    another prompt. Separators in the prompt's text survive (they are in the tokens)."""
    if not isinstance(body, dict) or not _json_true(body.get("use_beam_search", False)):
        return None
    kwargs, xargs = (value if isinstance(value, dict) else {} for value in map(body.get, ("chat_template_kwargs",
                                                                                          "vllm_xargs")))
    if xargs.get(MODE_ARG) == OFF:  # runs as in vanilla vLLM: nothing to lose
        return None
    documents = asks_for_documents({**kwargs, "documents": body.get("documents") or kwargs.get("documents")},
                                   body.get("messages"))
    if not documents and not any(key in xargs for key in GRAPHCHUNK_ARGS):
        return None
    return ("use_beam_search cannot carry graphchunk's chunks: each beam step is a new request of token ids "
            "alone, without the request's documents and graphchunk_* arguments; send it without beam search")


def _json_true(value) -> bool:
    """As pydantic reads a JSON value as a bool (lax: 1, "true", "yes", ...)."""
    return value.strip().lower() in ("1", "true", "t", "yes", "y", "on") if isinstance(value, str) else bool(value)


def json_boolean_problem(body) -> str | None:
    """The error for a JSON true/false among a request body's graphchunk ``vllm_xargs``, or None.

    vLLM's OpenAI protocol types ``vllm_xargs`` as ``dict[str, str | int | float | list[...]]``
    and pydantic's lax union turns true/false into 1/0, so after validation
    ``"graphchunk_boundaries": [true, 5]`` is indistinguishable from [1, 5] (and
    ``"graphchunk_recompute_ratio": true`` from 1). The plugin checks the raw JSON with this."""
    xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
    if not isinstance(xargs, dict):
        return None
    for key in GRAPHCHUNK_ARGS:
        value = xargs.get(key)
        items = value if isinstance(value, list) else [value]
        if any(isinstance(item, bool) for item in items):
            return f"{key} must be {_EXPECTED[key]}, got {json.dumps(value)}: JSON booleans are not accepted"
    return None
