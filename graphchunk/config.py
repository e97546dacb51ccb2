"""graphchunk's configuration, validated once at start-up.

Given to vLLM as ``--additional-config '{"graphchunk": {...}}'`` (or ``additional_config=`` in
Python); every key is optional.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from graphchunk.blend.recompute import RecomputePolicy
from graphchunk.cache.eviction import DEFAULT_POLICY, POLICIES
from graphchunk.cache.pool import cdiv

MODES = ("isolated", "blend")
"""A request's modes (DESIGN.md §2)."""
MODE_SETTINGS = ("auto", *MODES)
"""The deployment's default mode: a request's mode, or 'auto' (``GraphChunkConfig.default_mode``)."""
DOCUMENTS_FALLBACKS = ("refuse", "ordinary")
BLEND_MISSES = ("prefill", "blend")
BLEND_ENTRIES = ("alone", "context", "precompute")


class ConfigError(ValueError):
    """A graphchunk setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class GraphChunkConfig:
    separator: str = ""
    """The seeds' form, turned on knowingly: text (e.g. '##') that splits every prompt into sys /
    chunks / question where it stands as a word of its own inside a line (``segments``: never a
    Markdown heading). Code comments (``x = 1  ## note``) and chat text that carry it are split too,
    and change their answers. '' (the default): only marked requests are touched (documents,
    ``graphchunk_boundaries``, or ``graphchunk_separator`` on the request itself)."""
    max_chunks: int = 32
    """Most chunks one prompt may have."""
    max_chunk_len: int = 2048
    """Most tokens one chunk may have (separator tokens included)."""
    pool_tokens: int = 0
    """Chunk-pool budget in tokens of KV (rounded up to whole blocks), carved out of vLLM's KV cache.
    0: sized at start-up to half of the KV-cache budget vLLM resolved (``--kv-cache-memory-bytes`` or
    ``--gpu-memory-utilization``; a quarter with host memory below it, ``host_bytes``), at least a sys
    prompt of max_model_len tokens and one chunk of max_chunk_len, and logged; a set value that does
    not fit the budget is refused. A request's whole context is held in the pool at once (isolated
    chunks each from their sys prompt's partial last block): one that cannot fit the empty pool
    fails with an error naming this setting."""
    eviction: str = DEFAULT_POLICY
    """Which unused pool entry is evicted first: 'gdsf' (hits x tokens per block, with aging), 'lfu'
    (hits, with aging) or 'lru' (``eviction.py``; measured in perf/results/eviction.json)."""
    mode: str = "auto"
    """Default mode of segmented requests: 'blend' (approximate reuse of full prefill behind any sys
    prompt at any offset, with the ``recompute`` policy), 'isolated' (exact to its own semantics,
    DESIGN.md §2: it equals the isolated reference, not full prefill, and answers far less often
    than full prefill: docs/quality.md) or 'auto': blend where the model's keys can be moved (RoPE
    of a fixed rotation per position), isolated where they cannot, said in the start-up log. Blend
    by measurement: among the settings at no more than half of full prefill's time to first token
    it kept the most answers (perf/results/rag_quality_150.json). A request may override it
    (``graphchunk_mode``)."""
    key_temperature: float = 1.0
    """Isolated mode: the question's and generated tokens' attention logits to chunk tokens are divided
    by it (APE's attention temperature, with its scale S = 1/T: one softmax); applied to the chunk keys
    as they are copied into a request, so the pool keeps plain keys; 1 is plain isolated mode. A
    request may override it (``graphchunk_key_temperature``). Measured in perf/results/blend_quality.json:
    0.85 and 1.15 raise KL against full prefill over 1, so 1 is the default."""
    recompute: str = "question"
    """Blend mode's default recompute policy: 'none', 'cacheblend', 'legolink' or 'question' (``blend/recompute.py``).
    'question' at ratio 0.3 kept the most answers at no more than half of full prefill's time to first
    token, and the lowest KL against full prefill, at ~150- and ~400-token documents
    (perf/results/rag_quality_150.json, rag_quality_400.json; docs/quality.md)."""
    recompute_ratio: float = 0.3
    """cacheblend, question: share of chunk tokens recomputed through every layer, in [0, 1]."""
    recompute_tokens: int = 15
    """legolink: tokens recomputed at the start of every chunk."""
    recompute_sinks: int = 0
    """cacheblend, question: the first tokens of every chunk, recomputed first within the ratio's share
    (LegoLink's sinks mixed with the ranking)."""
    recompute_spread: str = "context"
    """cacheblend, question: the ratio taken over a step's chunk tokens together ('context') or over
    each chunk on its own ('chunk')."""
    recompute_layers: int = 0
    """question: the scoring pass runs the question through the model's first ``recompute_layers``
    layers and ranks by their attention (0: every layer)."""
    recompute_block: int = 4
    """cacheblend, question: the ratio's tokens picked in blocks of ``recompute_block`` consecutive
    tokens of a chunk, ranked by their summed scores: fewer, longer recompute runs (1: single tokens).
    Blocks of 4 kept single tokens' answers at ~150- and ~400-token documents (KL -0.003 at both,
    paired intervals holding 0) in a quarter of the runs (perf/results/blend_blocks_small_150.json,
    blend_blocks_400.json, host_scale_blocks.json; docs/quality.md); blocks of 16 moved KL +0.010."""
    check_layer: int = 1
    """cacheblend: layers [0, check_layer] are recomputed for every chunk token, and K at this layer
    ranks the tokens."""
    templates: str = ""
    """Bucket grid of cached-chunk prefills (``graphs/buckets.py``): a name in graph_templates/ ('cpu')
    or a .toml path. Its token counts join vLLM's graph capture sizes (CUDA, Ascend) and each
    question step is counted by bucket; '' adds nothing and counts nothing."""
    store_path: str = ""
    """Directory of the persistent chunk tier below the pool (``cache/store.py``), which servers may
    share; '' keeps chunk KV in the pool only."""
    store_bytes: int = 16 << 30
    """The tier's budget in bytes of files; the least recently used files go first."""
    store_key_file: str = ""
    """A file holding the tier's secret (at least 16 bytes): files are then signed with a keyed
    BLAKE2b MAC and only files made with that secret are served, so that no one without it shapes
    what requests read (docs/tier.md, trust model). '': unkeyed files (xxh3: corruption, not forgery)."""
    host_bytes: int = 0
    """Budget of the tier's host-memory level (``cache/host_tier.py``; pinned on CUDA): every entry
    computed into the pool (or loaded from ``store_path``) is kept there too, least recently used
    dropped first, and a chunk missing from the pool that it holds is copied into the request in
    one copy (no pool block) instead of computed. Alone (no
    ``store_path``) nothing leaves the process, and the pool (``pool_tokens``) is the device's hot
    set in front of it. 0: none."""
    miss_budget: int = 512
    """Chunk-miss tokens graphchunk computes per step beside what vLLM schedules (vLLM's token
    budget does not see them): a request waits (vLLM's asynchronous KV load) while its misses are
    computed a budget at a time, so that running requests' decode steps are never held up by more
    than this (in a step that schedules nothing else, at least max_num_batched_tokens); the
    misses of a blend request are computed the same way before it is admitted."""
    recompute_budget: int = 512
    """Tokens of blend recompute a step admits beside what vLLM schedules (vLLM's token budget does
    not see them either): the recompute and question scoring (``RecomputePolicy.cost``) of the
    all-hit blend requests the step schedules, one request at least; the others wait for a later
    step (``blend_requests_pending``, ``blend_recompute_deferrals``). A step's recompute then
    costs at most this, or one request's own when that is more."""
    blend_misses: str = "prefill"
    """A blend request whose missing entries (chunks and sys prompt the pool holds neither ready nor
    in flight) and recompute (``RecomputePolicy.cost``) add up to at least its context: 'prefill'
    runs it as vLLM's full prefill (blend's target, exactly; ``blend_full_prefills``) and computes
    those entries for later requests from the next step on, never in its way; 'blend' makes it
    wait for its misses and blends it like any other. Applies to the policies whose KV vLLM's
    prefix cache never shares between requests (question and cacheblend at a ratio strictly
    between 0 and 1); not with a tier (``store_path`` or ``host_bytes``), which may serve a miss for the
    price of a copy."""
    blend_entries: str = "alone"
    """Where the pool entries of chunks a full-prefilled blend request (``blend_misses`` 'prefill')
    lacked come from: 'alone' (each chunk computed alone at [0, L), DESIGN.md §2, from the next step
    on; where ``store_path``'s tier holds the operator's contextualized entry of a document,
    ``graphchunk-precompute --context``, requests without a salt load that instead) or 'context' (taken from that full prefill itself, after its forward: each chunk's KV as it
    was computed there, attending to the system prompt and documents before it, keys rotated back
    to [0, L); FusionRAG's contextualized chunk KV, online). 'context' costs no chunk forward at
    all and, measured on the oracle, blended requests over such entries answer closer to full
    prefill (docs/quality.md); but an entry then depends on the request that first brought its
    chunk, not on the chunk alone, so it is taken only from a request with a ``cache_salt`` and
    read only by requests with the same salt (one tenant; DESIGN.md §2): requests without a salt
    use entries computed alone. 'precompute' is ``graphchunk-precompute --context``'s engine
    (FusionRAG's offline contextualization over the operator's corpus, docs/tier.md): every blend
    request is computed as vLLM's full prefill and its last chunk's KV, computed behind the system
    prompt and the documents before it, becomes that chunk's entry in the tier (``store_path``),
    where every request without a salt reads it; an engine serving clients (``vllm serve``,
    ``AsyncLLM``) refuses it, since its clients would choose that context."""
    blend_prefix: str = ""
    """Text computed before every blend chunk (DESIGN.md §2's fixed model-level prefix, the same
    tokens before every chunk; '': each chunk alone, from position 0): a chunk's entry holds the
    KV of ``prefix ‖ chunk``, and blend reuses its tokens after the prefix (keys rotated to where
    the chunk lands). Tokenized once by the model's tokenizer; part of every blend entry's key.
    Measured through vLLM ('Here is a document.\\n\\n', 150-token tasks, paired with chunks alone
    at 30 %): 30 % after it KL -0.011 [-0.018, -0.006], exact match -0.04 [-0.10, +0.00]; 15 %
    after it KL +0.008, exact match -0.08 (docs/quality.md). Opt-in."""
    documents_fallback: str = "refuse"
    """A documents request graphchunk cannot chunk (a template that puts the documents after the
    question or hides them, a renderer without an HF template, more than ``max_chunks`` documents,
    one over ``max_chunk_len``): 'refuse' (a 400 naming the problem) or 'ordinary' (it runs as an
    ordinary prompt, counted in ``vllm:graphchunk_documents_unchunked_total``). Malformed documents are
    refused either way."""

    def __post_init__(self):
        for name, kind in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                what = "a number" if isinstance(kind, tuple) else kind.__name__
                raise ConfigError(f"graphchunk.{name} must be {what}, got {value!r}")
        for name in ("recompute_ratio", "key_temperature"):  # 1 and 1.0 are one setting
            object.__setattr__(self, name, float(getattr(self, name)))
        if not valid_key_temperature(self.key_temperature):
            raise ConfigError(f"graphchunk.key_temperature must be a number > 0, got {self.key_temperature!r}")
        for name in ("max_chunks", "max_chunk_len", "store_bytes", "miss_budget", "recompute_budget"):
            if getattr(self, name) < 1:
                raise ConfigError(f"graphchunk.{name} must be >= 1, got {getattr(self, name)}")
        if self.pool_tokens < 0:
            raise ConfigError(f"graphchunk.pool_tokens must be >= 0 (0: sized from the KV-cache budget), "
                              f"got {self.pool_tokens}")
        if self.separator and not self.separator.strip():
            raise ConfigError(f"graphchunk.separator must hold a non-whitespace character (or be '' for none), "
                              f"got {self.separator!r}")
        if self.eviction not in POLICIES:
            raise ConfigError(f"graphchunk.eviction must be one of {POLICIES}, got {self.eviction!r}")
        if self.host_bytes < 0:
            raise ConfigError(f"graphchunk.host_bytes must be >= 0, got {self.host_bytes}")
        if self.store_key_file and not self.store_path:
            raise ConfigError("graphchunk.store_key_file signs the persistent tier's files: set graphchunk.store_path too")
        if self.mode not in MODE_SETTINGS:
            raise ConfigError(f"graphchunk.mode must be one of {MODE_SETTINGS}, got {self.mode!r}")
        if self.blend_entries not in BLEND_ENTRIES:
            raise ConfigError(f"graphchunk.blend_entries must be one of {BLEND_ENTRIES}, got {self.blend_entries!r}")
        if self.blend_entries == "precompute" and not self.store_path:
            raise ConfigError("graphchunk.blend_entries 'precompute' writes the entries it computes to the tier: "
                              "set graphchunk.store_path too")
        if self.blend_misses not in BLEND_MISSES:
            raise ConfigError(f"graphchunk.blend_misses must be one of {BLEND_MISSES}, got {self.blend_misses!r}")
        if self.documents_fallback not in DOCUMENTS_FALLBACKS:
            raise ConfigError(f"graphchunk.documents_fallback must be one of {DOCUMENTS_FALLBACKS}, "
                              f"got {self.documents_fallback!r}")
        if self.check_layer < 0:
            raise ConfigError(f"graphchunk.check_layer must be >= 0, got {self.check_layer}")
        try:
            self.policy
        except ValueError as exc:
            raise ConfigError(f"graphchunk.recompute*: {exc}") from None

    @property
    def tiered(self) -> bool:
        """Whether a tier below the pool may serve a pool miss: host memory (``host_bytes``), the
        directory (``store_path``), or both."""
        return bool(self.host_bytes or self.store_path)

    def pool_blocks(self, block_size: int) -> int:
        """KV-cache blocks of ``block_size`` tokens that hold ``pool_tokens`` (0 until sized)."""
        return cdiv(self.pool_tokens, block_size)

    def default_mode(self, blend_refusal: str | None) -> str:
        """The mode of a segmented request that names none: ``mode``; for 'auto', blend unless
        ``blend_refusal`` says why this model cannot blend (``rope.blend_refusal``)."""
        if self.mode != "auto":
            return self.mode
        return "isolated" if blend_refusal else "blend"

    @cached_property
    def policy(self) -> RecomputePolicy:
        """The deployment's default recompute policy of blend requests (made once: every request reads it)."""
        return RecomputePolicy(self.recompute, self.recompute_ratio, self.recompute_tokens, self.recompute_sinks,
                               self.recompute_spread, self.recompute_layers, self.recompute_block)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "GraphChunkConfig":
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown graphchunk setting(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_additional_config(cls, additional_config: dict[str, Any] | None) -> "GraphChunkConfig":
        """Reads the ``graphchunk`` section of vLLM's ``additional_config``."""
        section = (additional_config or {}).get("graphchunk", {})
        if not isinstance(section, dict):
            raise ConfigError(f"additional_config['graphchunk'] must be a dict, got {section!r}")
        return cls.from_dict(section)


def valid_key_temperature(value) -> bool:
    """A key temperature is a number > 0 (finite; a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


_TYPES = {"separator": str, "max_chunks": int, "max_chunk_len": int, "pool_tokens": int, "eviction": str,
          "mode": str, "key_temperature": (int, float), "templates": str, "recompute": str, "recompute_ratio": (int, float), "recompute_tokens": int,
          "recompute_sinks": int, "recompute_spread": str, "recompute_layers": int, "recompute_block": int,
          "check_layer": int, "store_path": str, "store_bytes": int, "store_key_file": str,
          "host_bytes": int, "documents_fallback": str, "miss_budget": int,
          "recompute_budget": int, "blend_misses": str, "blend_entries": str, "blend_prefix": str}
