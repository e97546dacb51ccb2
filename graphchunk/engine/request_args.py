"""The request arguments graphchunk reads, and their validation: what a client may send, the 400s.

The mode (``isolated`` or ``blend``, DESIGN.md §2) and blend's recompute policy are chosen per
request through extra_args (OpenAI: ``vllm_xargs``), defaulting to the deployment's settings.
They are validated for every request in the process that tokenizes (``frontend.RequestAnnotator``),
and a segmented request carries the *resolved* values to the worker (``MODE_ARG`` always; for
isolated also ``TEMPERATURE_ARG``, for blend ``POLICY_ARGS``), which reads them back with the same
functions (``chunk_request``); an ordinary request loses them (it runs as vanilla vLLM). Bad input
raises ``SegmentationError`` naming the argument. A raw OpenAI request body is checked here too,
for what vLLM's request models would lose before graphchunk sees it (``request_body_problem``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from graphchunk.blend.recompute import POLICIES, SPREADS, RecomputePolicy
from graphchunk.config import MODES, GraphChunkConfig, valid_key_temperature
from graphchunk.documents import asks_for_documents
from graphchunk.segments import SegmentationError, SegmentedPrompt, split_at

BOUNDARIES_ARG = "graphchunk_boundaries"
"""extra_args / vllm_xargs key: start indices of each chunk and of the question."""
SALT_ARG = "graphchunk_salt"
"""extra_args key set by ``annotate`` (``frontend.py``): what besides tokens and model sets a chunk's
KV (the request's own cache_salt, for tenant isolation, and its LoRA adapter); part of every chunk key."""
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
"""extra_args key set by ``annotate``: a documents request run as an ordinary prompt
(``documents_fallback``), counted by the worker."""
POLICY_ARGS = (RECOMPUTE_ARG, RATIO_ARG, TOKENS_ARG, SINKS_ARG, SPREAD_ARG, LAYERS_ARG, BLOCK_ARG)
MODE_ARGS = (MODE_ARG, TEMPERATURE_ARG, *POLICY_ARGS)
GRAPHCHUNK_ARGS = (BOUNDARIES_ARG, SEPARATOR_ARG, *MODE_ARGS)
"""The keys a client may send."""


def resolve_separator(extra_args: dict, config: GraphChunkConfig) -> str:
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


def policy_args(policy: RecomputePolicy) -> dict:
    """A resolved recompute policy as the extra_args a segmented request carries (``POLICY_ARGS``)."""
    return {key: getattr(policy, field) for key, field in _POLICY_FIELDS.items()}


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
