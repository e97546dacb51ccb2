"""The serving benchmark's server kinds (``bench_serve.py``): a kind's name -> graphchunk's settings.

* ``vanilla``: ``vllm serve MODEL`` (vLLM's own worker);
* ``isolated``: ``--worker-cls graphchunk.Runner`` with ``{"graphchunk": {"mode": "isolated"}}``;
* ``blend``: ``--worker-cls graphchunk.Runner`` with ``{"graphchunk": {"mode": "blend"}}`` (its
  default recompute policy), named so that the row is blend whatever graphchunk's default mode;
  ``blend:POLICY`` with that policy as the deployment's default; ``blend-context`` and
  ``blend-context:POLICY`` the same with ``blend_entries: context`` (entries taken from full prefills;
  every request carries one tenant's ``cache_salt``, ``TENANT``: graphchunk takes none without one);
  ``blend-prefix`` and ``blend-prefix:POLICY`` with ``blend_prefix: BLEND_PREFIX`` (every chunk
  computed after that fixed text); ``blend-corpus`` and ``blend-corpus:POLICY`` blend mode on a
  ``store_path`` tier that ``graphchunk-precompute --context bm25 --format documents`` filled first
  with every level's documents, each computed behind its ``--context-size`` most related ones
  (the operator's corpus, contextualized offline: its cold pass is then tier hits, its warm pass
  pool hits over those entries; requests carry no salt);
* any graphchunk kind with ``/pool=SHARE`` (``blend/pool=0.25``): its chunk pool set to that share
  of the KV-cache budget (``pool_tokens``) instead of half: what the pool takes from the requests'
  KV, against what it saves (docs/sizing.md); with ``/host=BYTES`` (``blend/pool=0.25/host=1073741824``)
  a host-memory tier of BYTES below the pool (``host_bytes``, no directory): a small device pool
  whose evicted entries come back from host memory.
"""
from __future__ import annotations

from pathlib import Path

from perf.answers.blend_task import one_setting
from perf.common import harness as H

KINDS = {"vanilla": None, "isolated": {"mode": "isolated"}, "blend": {"mode": "blend"}}
"""Server kind -> graphchunk's settings (None: vanilla vLLM, its own worker). Besides these,
``blend:POLICY`` (a bench_blend setting: ``blend:question:0.15@2``, ``blend:legolink:15``) is blend
mode with that recompute policy as the deployment's default."""


BLEND_PREFIX = "Here is a document.\n\n"
"""The fixed text of the ``blend-prefix`` kinds (measured on the HF oracle: docs/quality.md)."""


OPTIONS = {"pool": "a share of the KV-cache budget in (0, 1)", "host": "a positive number of bytes"}
"""A graphchunk kind's ``/NAME=VALUE`` options (``kind_options``) and what each takes."""


def _option(name: str, text: str) -> float | int | None:
    """An option's value, or None when it is not one ``OPTIONS`` allows."""
    try:
        value = float(text) if name == "pool" else int(text)
    except ValueError:
        return None
    return value if (0 < value < 1 if name == "pool" else value > 0) else None


def kind_options(kind: str) -> tuple[str, dict]:
    """``KIND/pool=SHARE/host=BYTES`` (either option, any order): graphchunk server ``KIND`` with its
    chunk pool set (``pool_tokens``) to SHARE of the KV-cache budget instead of graphchunk's default
    (``worker.pool_share``: half, a quarter with host memory; the sizing guide's runs), and a host-memory tier of BYTES below it (``host_bytes``, no
    directory). Returns ``KIND`` and ``{"pool": SHARE, "host": BYTES}`` (the options given)."""
    base, *parts = kind.split("/")
    options = {}
    for part in parts:
        name, _, text = part.partition("=")
        value = _option(name, text) if name in OPTIONS and name not in options else None
        if value is None or settings_of(base) is None:
            raise ValueError(f"{kind!r}: after a graphchunk kind, each of " + ", ".join(
                f"/{n}= takes {what}" for n, what in OPTIONS.items()) + ", once")
        options[name] = value
    return base, options


def settings_of(kind: str) -> dict | None:
    """graphchunk's settings of server ``kind`` (``KINDS``, or ``blend:POLICY``; either with
    ``/pool=SHARE``, whose ``pool_tokens`` ``server_settings`` sets, and ``/host=BYTES``: ``host_bytes``)."""
    kind, options = kind_options(kind)
    if "host" in options:
        return {**settings_of(kind), "host_bytes": options["host"]}
    if kind in KINDS:
        return KINDS[kind]
    name, _, spec = kind.partition(":")
    entries = {"blend-context": {"mode": "blend", "blend_entries": "context"},
               "blend-prefix": {"mode": "blend", "blend_prefix": BLEND_PREFIX},
               "blend-corpus": {"mode": "blend"}}.get(name)
    if entries is not None and not spec:
        return entries
    setting = one_setting(spec) if name in ("blend", "blend-context", "blend-prefix", "blend-corpus") and spec else None
    if setting is None or not setting.blend:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}, blend-context, blend-prefix, "
                         "blend-corpus, and each of the blend ones with :POLICY (e.g. blend:question:0.15@2)")
    return {**(entries or {}), **{key.removeprefix("graphchunk_"): value for key, value in setting.extra.items()}}


def on_corpus(kind: str) -> bool:
    """Whether server ``kind`` runs on the contextualized corpus tier (``blend-corpus``)."""
    return kind_options(kind)[0].partition(":")[0] == "blend-corpus"


TENANT = "bench-serve"
"""The cache_salt of every request to a ``blend-context`` server: one tenant, whose requests' full
prefills become the blend entries its other requests read (graphchunk captures none without a salt)."""


def tenant_of(kind: str) -> str | None:
    """The cache_salt the requests of server ``kind`` carry (None: none)."""
    return TENANT if (settings_of(kind) or {}).get("blend_entries") == "context" else None


def pool_tokens_at(args, model: Path, share: float) -> int:
    """The pool's tokens at ``share`` of the KV-cache budget, in whole blocks (the worker's own
    sizing rule, ``worker.pool_blocks_in``)."""
    block_bytes = args.block_size * H.kv_bytes_per_token(model, args.dtype)
    return int(args.kv_cache_bytes * share) // block_bytes * args.block_size
