"""Serving benchmark: how much more one server serves, and how soon its users see a first token,
under RAG traffic, measured by vLLM's own load generator (``vllm bench serve``) against vanilla vLLM.

    python -m perf.serving.bench_serve [--model smollm2] [--concurrency 1,8,32] [--num-prompts 24,48,96]
                               [--format chat|completions] [--out perf/results/serve.json] [--quick]

Servers, one at a time, on the same ``vllm serve`` flags (``server_flags``; vLLM's compilation on
unless ``--enforce-eager``, prefix caching on, ``--kv-cache-memory-bytes`` of which graphchunk's
chunk pool takes half, sized to hold each level's working set, said in the JSON):

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

Traffic (``serve_trace.py``): per concurrency level its own slice of a corpus of CPython help-topic
documents (so cold on a level is first sight for that server), Zipf popularity, ``--docs-per-prompt``
documents per request behind one of three system prompts, a question; greedy, ``--ignore-eos``,
``--output-len`` tokens. ``--format chat``: chat completions whose documents travel in the body's
``documents`` field; vanilla gets the same tokens as ordinary messages (the documents written into
the user message as graphchunk places them: ``documents.inlined``; the prompt token counts the
servers report are compared request by request). ``--format completions``: ``sys ## doc ## ... ##
question`` prompts on /v1/completions, the same text for every server.

Passes, per server kind and level (``--max-concurrency c --request-rate inf``, each pass one run
of vLLM's bench over a JSONL file, its ``--save-result`` JSON read back):

* ``cold``: the level's cold trace, documents never seen by this server;
* ``warm``: the level's warm trace (same documents, popularity, other combinations and orders),
  after the cold pass warmed the server on them;
* ``ceiling`` (vanilla): the warm trace again, every prompt a full prefix-cache hit: the most any
  KV reuse can give on this trace, so ``gain_fraction`` = (graphchunk − vanilla warm) /
  (ceiling − vanilla warm), for request throughput and p50 TTFT;
* ``precomputed`` (graphchunk, chat form): the cold trace on a fresh server whose ``store_path``
  tier was filled beforehand by ``graphchunk-precompute --format documents`` (every system prompt
  for isolated mode) with the server's model, dtype and block size. Not in the completions form:
  a separator-text request's chunks are tokenized in context (the separator's tokens start each
  chunk), no precompute format tokenizes them so, and its tier went unused (0 tier hits).

Each row: vLLM's numbers (request and output-token throughput, TTFT/TPOT/ITL/E2EL p50 and p99),
the server's /metrics deltas over the pass (graphchunk's chunk lookups, hits, tier hits, tokens
computed; vLLM's prefix-cache queries and hits), the load sampled from /metrics every 0.5 s while
the pass ran (median and max of vLLM's running and waiting requests, of the device KV blocks they
hold, of graphchunk's pool blocks in use), ratios against vanilla's same phase and level
(precomputed: against vanilla cold) and the gain fraction. Writes ``--out`` and ``--plot``.

The shim (``vllm_bench_serve``): vLLM's ``custom`` dataset sends one ``prompt`` per JSONL row and
no public option sets per-request body fields (``--extra-body`` is the same for every request),
so a documents request cannot be expressed. vLLM's ``SampleRequest`` has ``chat_messages`` and
``request_overrides`` for that (its BFCL dataset sets them); the shim copies each row's
``messages`` and ``documents`` into them and otherwise runs ``vllm bench serve`` unchanged.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perf.common import harness as H
from perf.serving import serve_trace as T
from perf.answers.blend_task import one_setting
from perf.common.server import KV_USAGE, GaugeSampler, label_of, scrape, spread, total
from graphchunk.tools.serve_demo import VllmServer

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
    half (the sizing guide's runs), and a host-memory tier of BYTES below it (``host_bytes``, no
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


COUNTERS = ("vllm:graphchunk_lookups_total", "vllm:graphchunk_hits_total", "vllm:graphchunk_misses_total",
            "vllm:graphchunk_tier_hits_total", "vllm:graphchunk_tier_host_hits_total",
            "vllm:graphchunk_evictions_total", "vllm:graphchunk_tokens_reused_total",
            "vllm:graphchunk_tokens_computed_total", "vllm:graphchunk_blend_tokens_recomputed_total",
            "vllm:graphchunk_blend_full_prefills_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", KV_USAGE, "vllm:graphchunk_pool_blocks_used")
"""The /metrics gauges sampled while a pass runs (``GaugeSampler``, every ``SAMPLE_INTERVAL`` s)."""
SAMPLE_INTERVAL = 0.5


# --- the shim -----------------------------------------------------------------------------------

def vllm_bench_serve(argv: list[str]) -> dict:
    """``vllm bench serve *argv`` in this process (vLLM's own parser and ``main``), with one change:
    ``CustomDataset.sample`` also copies each JSONL row's ``messages`` into its request's
    ``SampleRequest.chat_messages`` (sent as the chat request's messages) and its ``documents``
    into ``request_overrides`` (merged into that request's body), the two fields vLLM's own BFCL
    dataset sets. No option does it: ``--dataset-name custom`` carries one prompt per row and
    ``--extra-body`` is the same for every request. Needs ``--disable-shuffle --no-oversample``
    (requests in row order, one per row). Arrival, concurrency, timing, metrics and the result
    file are vLLM's. Returns vLLM's result dict."""
    from vllm.benchmarks import serve
    from vllm.benchmarks.datasets import datasets
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    original = datasets.CustomDataset.sample

    def sample(self, *a, **kw):
        requests = original(self, *a, **kw)
        for request, row in zip(requests, self.data):
            if "messages" in row:
                request.chat_messages = row["messages"]
            if "documents" in row:
                request.request_overrides = {"documents": row["documents"]}
        return requests

    datasets.CustomDataset.sample = sample
    try:
        return serve.main(args)
    finally:
        datasets.CustomDataset.sample = original


def bench_argv(args, url: str, model: str, jsonl: Path, n: int, c: int, result: Path, label: str,
               salt: str | None = None) -> list[str]:
    """The ``vllm bench serve`` arguments of one pass; ``salt``: every request's cache_salt."""
    chat = args.format == "chat"
    salted = ["--extra-body", json.dumps({"cache_salt": salt})] if salt else []
    return ["--backend", "openai-chat" if chat else "openai", "--base-url", url,
            "--endpoint", "/v1/chat/completions" if chat else "/v1/completions", "--model", model,
            "--dataset-name", "custom", "--dataset-path", str(jsonl), "--skip-chat-template", "--disable-shuffle",
            "--no-oversample", "--num-prompts", str(n), "--custom-output-len", str(args.output_len),
            "--max-concurrency", str(c), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--ready-check-timeout-sec", "0", "--disable-tqdm", "--request-id-prefix", label + "-",
            "--seed", str(args.seed), "--save-result", "--save-detailed", "--result-filename", str(result), *salted]


# --- servers ------------------------------------------------------------------------------------

def server_flags(args) -> list[str]:
    """``vllm serve`` flags of every server of the run."""
    flags = ["--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--block-size", str(args.block_size),
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(max(128, 2 * max(args.concurrency))),
             "--enable-prefix-caching", "--disable-uvicorn-access-log", "--seed", str(args.seed)]
    budget = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []
    return flags + budget + ["--enforce-eager"] * args.enforce_eager


def server_name(kind: str, store: Path | None) -> str:
    """A server's name in logs and the result: its kind, marked when it serves a precomputed tier
    (``blend-corpus`` kinds always do: their name says so)."""
    return kind + ("-precomputed" if store and not on_corpus(kind) else "")


def pool_tokens_at(args, model: Path, share: float) -> int:
    """The pool's tokens at ``share`` of the KV-cache budget, in whole blocks (the worker's own
    sizing rule, ``worker.pool_blocks_in``)."""
    block_bytes = args.block_size * H.kv_bytes_per_token(model, args.dtype)
    return int(args.kv_cache_bytes * share) // block_bytes * args.block_size


def file_stem(name: str) -> str:
    """``name`` (a server's or a pass's) as a file name: a ``/pool=`` or ``/host=`` kind's slashes replaced."""
    return name.replace("/", "_")


def server_settings(args, model: Path, kind: str, store: Path | None = None) -> dict | None:
    """The ``--additional-config`` graphchunk section of server ``kind`` (None: vanilla): its
    settings, ``store``'s tier, and a ``/pool=SHARE`` kind's pool in tokens."""
    settings = settings_of(kind)
    settings = settings and {**settings, **({"store_path": str(store)} if store else {})}
    share = kind_options(kind)[1].get("pool")
    if share is not None:
        settings["pool_tokens"] = pool_tokens_at(args, model, share)
    return settings


def start_server(args, model: Path, kind: str, work: Path, store: Path | None = None, log=print) -> VllmServer:
    settings = server_settings(args, model, kind, store)
    name = server_name(kind, store)
    server = VllmServer(model, dtype=args.dtype, graphchunk=settings, flags=server_flags(args),
                        worker_cls="graphchunk.Runner" if settings else None, log_path=work / f"{file_stem(name)}.log")
    log(f"[serve] starting {name}: vllm {' '.join(server.args)}")
    server.start()
    try:
        took = server.wait_healthy(args.startup_timeout, lambda s, line: log(f"[serve]   {s:4.0f} s  {line[:100]}"))
    except Exception:
        server.stop()
        raise
    log(f"[serve] {name} healthy after {took:.0f} s")
    server.startup_s = took
    return server


def counters(url: str) -> dict[str, float]:
    """``COUNTERS`` from /metrics once two reads 0.5 s apart agree (the worker publishes its
    counters after each step); a counter the server does not export is absent."""
    def read():
        samples = scrape(url)
        return {name: value for name in COUNTERS if (value := total(samples, name)) is not None}
    last, deadline = read(), time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = read()
        if now == last:
            break
        last = now
    return last


def device_blocks(url: str) -> int | None:
    """vLLM's device KV blocks for requests (``num_gpu_blocks`` of ``vllm:cache_config_info``: what is
    left after graphchunk's pool), or None where /metrics does not say."""
    value = label_of(scrape(url), "vllm:cache_config_info", "num_gpu_blocks")
    return int(value) if value and value.isdigit() else None


def load_of(samples: list[dict], blocks: int | None) -> dict:
    """A pass's sampled load: vLLM's running and waiting requests, the device KV blocks requests
    hold (``kv_cache_usage_perc`` x the blocks but the null one: vLLM's own usage rule, prefix-cached
    blocks no request holds counted free) and graphchunk's pool blocks holding KV, each's ``spread``."""
    series = lambda name: [s[name] for s in samples if name in s]  # noqa: E731
    held = [round(u * (blocks - 1)) for u in series(KV_USAGE)] if blocks else []
    return {"running": spread(series("vllm:num_requests_running")),
            "waiting": spread(series("vllm:num_requests_waiting")),
            "device_kv_blocks": spread(held), "device_kv_blocks_total": blocks,
            "pool_blocks_used": spread(series("vllm:graphchunk_pool_blocks_used"))}


def precompute_lines(levels, context: bool = False) -> list[dict]:
    """The precompute's corpus lines: every level's documents for both modes (each line names its
    mode), or with ``context`` blend only (contextualized entries are blend's)."""
    lines = T.precompute_corpus(levels, "blend")
    return lines if context else T.precompute_corpus(levels, "isolated") + lines


def precompute(args, model: Path, levels, tier: Path, work: Path, log=print, context: bool = False) -> dict:
    """``graphchunk-precompute`` of ``precompute_lines`` into ``tier`` (one run), with the servers'
    model, dtype, block size and KV budget; with ``context``, each document behind its
    ``--context-size`` most related (BM25)."""
    lines = precompute_lines(levels, context)
    corpus = T.write_jsonl(work / ("precompute-context.jsonl" if context else "precompute.jsonl"), lines)
    command = [sys.executable, "-m", "graphchunk.tools.precompute", "--store", str(tier), "--corpus", str(corpus),
               "--model", str(model), "--format", "documents",
               "--dtype", args.dtype, "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
               "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    if context:
        command += ["--context", "bm25", "--context-size", str(args.context_size)]
    log(f"[serve] precompute of {len(lines)} documents: {' '.join(command)}")
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    tail = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("graphchunk-precompute: ")][-1:] \
        or [""]
    if done.returncode:
        raise RuntimeError(f"graphchunk-precompute failed ({done.returncode}):\n{done.stderr[-3000:]}")
    log(f"[serve] {tail[0]}")
    return {"command": " ".join(command), "documents": len(lines), "seconds": round(time.monotonic() - start, 1),
            "summary": tail[0]}


# --- passes -------------------------------------------------------------------------------------

def run_pass(args, server: VllmServer, kind: str, phase: str, level, trace: str, work: Path, log=print) -> dict:
    """One ``vllm bench serve`` pass of ``level``'s ``trace`` against ``server``: its row."""
    n, c = len(level.traces[trace]), level.concurrency
    label = file_stem(f"{kind}-{phase}-c{c}")  # also the request-id prefix
    if args.format == "chat":
        rows = T.chat_rows(level, trace, documents_field=kind != "vanilla")
    else:
        rows = T.completion_rows(level, trace)
    jsonl = T.write_jsonl(work / "traces" / f"{label}.jsonl", rows)
    result_file = work / "results" / f"{label}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    log(f"[serve] pass {label}: {n} requests at concurrency {c}")
    argv = bench_argv(args, server.url, str(server.model), jsonl, n, c, result_file, label, tenant_of(kind))
    before, blocks = counters(server.url), device_blocks(server.url)
    with GaugeSampler(server.url, GAUGES, SAMPLE_INTERVAL) as sampler:
        vllm_bench_serve(argv)
    after = counters(server.url)
    found = json.loads(result_file.read_text())
    row = make_row(kind, phase, c, trace, found, {k: after[k] - before.get(k, 0.0) for k in after},
                   docs_sent=sum(len(r.doc_ids) for r in level.traces[trace]))
    row.update(load_of(sampler.samples, blocks))
    row["bench_argv"] = argv
    log(f"[serve] {label}: " + one_line(row))
    return row


def run_kind(args, model: Path, kind: str, levels, work: Path, store: Path | None, log=print) -> tuple[list, dict]:
    """Every pass of one server: cold, warm (and ceiling for vanilla) per level, or with ``store``
    the precomputed pass per level (``blend-corpus`` kinds: cold and warm on their ``store``)."""
    server = start_server(args, model, kind, work, store, log)
    rows = []
    try:
        for level in levels:
            if store is not None and not on_corpus(kind):
                rows.append(run_pass(args, server, kind, "precomputed", level, "cold", work, log))
                continue
            rows.append(run_pass(args, server, kind, "cold", level, "cold", work, log))
            rows.append(run_pass(args, server, kind, "warm", level, "warm", work, log))
            if kind == "vanilla":
                rows.append(run_pass(args, server, kind, "ceiling", level, "warm", work, log))
    except BaseException:
        log(f"[serve] server log (tail):\n{server.log_tail()}")
        raise
    finally:
        server.stop()
    return rows, {"name": server_name(kind, store), "command": "vllm " + " ".join(server.args), "startup_s": round(server.startup_s, 1)}


# --- report -------------------------------------------------------------------------------------

def make_row(kind: str, phase: str, c: int, trace: str, found: dict, delta: dict, docs_sent: int) -> dict:
    """A pass's row: vLLM's result numbers and the server's /metrics deltas (graphchunk's chunk
    counters; vLLM's prefix cache, in tokens)."""
    n = found["completed"] or 1
    get = lambda name: delta.get(name)  # noqa: E731
    lookups, hits, tier = get("vllm:graphchunk_lookups_total"), get("vllm:graphchunk_hits_total"), get("vllm:graphchunk_tier_hits_total")
    queries, cached = get("vllm:prefix_cache_queries_total"), get("vllm:prefix_cache_hits_total")
    cache = {"documents_sent": docs_sent, "chunk_lookups": lookups, "chunk_hits": hits, "tier_hits": tier,
             "tier_host_hits": get("vllm:graphchunk_tier_host_hits_total"),
             "chunk_misses": get("vllm:graphchunk_misses_total"), "evictions": get("vllm:graphchunk_evictions_total"),
             "chunk_hit_rate": (1 - get("vllm:graphchunk_misses_total") / docs_sent) if lookups is not None else None,
             "tokens_computed_per_request": (get("vllm:graphchunk_tokens_computed_total") / n if lookups is not None
                                             else (queries - cached) / n if queries is not None else None),
             "tokens_reused_per_request": get("vllm:graphchunk_tokens_reused_total") and get("vllm:graphchunk_tokens_reused_total") / n,
             "blend_tokens_recomputed": get("vllm:graphchunk_blend_tokens_recomputed_total"),
             "blend_full_prefills": get("vllm:graphchunk_blend_full_prefills_total"),
             "prefix_cache_queries": queries, "prefix_cache_hits": cached,
             "preemptions": get("vllm:num_preemptions_total"),
             "prefix_cache_hit_rate": H.ratio(cached, queries)}
    pct = {m: {"mean": found.get(f"mean_{m}_ms"), "p50": found.get(f"p50_{m}_ms"), "p99": found.get(f"p99_{m}_ms")}
           for m in ("ttft", "tpot", "itl", "e2el")}
    return {"kind": kind, "phase": phase, "concurrency": c, "trace": trace, "num_prompts": found["num_prompts"],
            "completed": found["completed"], "failed": found["failed"], "duration_s": found["duration"],
            "request_throughput": found["request_throughput"], "output_throughput": found["output_throughput"],
            "total_token_throughput": found["total_token_throughput"],
            **{f"{m}_ms": v for m, v in pct.items()},
            "prompt_tokens_per_request": found["total_input_tokens"] / n, "output_tokens": found["total_output_tokens"],
            "cache": cache, "prompt_lens": found.get("input_lens"),
            "errors": sorted({e for e in found.get("errors") or [] if e})[:3]}


def one_line(row: dict) -> str:
    cache = row["cache"]
    reuse = (f"chunk hit rate {cache['chunk_hit_rate']:.2f} (tier hits {cache['tier_hits'] or 0:.0f})"
             if cache["chunk_hit_rate"] is not None else f"prefix-cache hit rate {cache['prefix_cache_hit_rate'] or 0:.2f}")
    return (f"{row['completed']}/{row['num_prompts']} ok, {row['failed']} failed, {row['request_throughput']:.2f} req/s, "
            f"{row['output_throughput']:.1f} tok/s, TTFT p50 {row['ttft_ms']['p50']:.0f} ms p99 {row['ttft_ms']['p99']:.0f} ms, "
            f"{reuse}, {row['cache']['tokens_computed_per_request'] or 0:.0f} tokens computed/request, running "
            f"{med_max(row['running'])}, waiting {med_max(row['waiting'])}, "
            f"KV blocks {med_max(row['device_kv_blocks'])}")


def _find(rows: list[dict], kind: str, phase: str, c: int) -> dict | None:
    return next((r for r in rows if (r["kind"], r["phase"], r["concurrency"]) == (kind, phase, c)), None)


def _vanilla_base(rows: list[dict], row: dict) -> dict | None:
    """The vanilla row a graphchunk row compares against: the same phase and level (precomputed:
    vanilla cold, its first sight of the documents)."""
    return _find(rows, "vanilla", "cold" if row["phase"] == "precomputed" else row["phase"], row["concurrency"])


def compare(rows: list[dict]) -> None:
    """Each row's ratios against vanilla's same phase and level (precomputed: vanilla cold), and
    for graphchunk's rows the gain fraction between vanilla warm (0) and the ceiling (1)."""
    for row in rows:
        c = row["concurrency"]
        base = _vanilla_base(rows, row)
        if base is not None and row["kind"] != "vanilla":
            row["vs_vanilla"] = {"against": f"vanilla {base['phase']}",
                                 "request_throughput": H.ratio(row["request_throughput"], base["request_throughput"]),
                                 "output_throughput": H.ratio(row["output_throughput"], base["output_throughput"]),
                                 "ttft_p50_speedup": H.ratio(base["ttft_ms"]["p50"], row["ttft_ms"]["p50"]),
                                 "ttft_p99_speedup": H.ratio(base["ttft_ms"]["p99"], row["ttft_ms"]["p99"])}
        warm, ceiling = _find(rows, "vanilla", "warm", c), _find(rows, "vanilla", "ceiling", c)
        if row["kind"] != "vanilla" and warm and ceiling:
            gain = lambda get: H.ratio(get(row) - get(warm), get(ceiling) - get(warm))  # noqa: E731
            row["gain_fraction"] = {"request_throughput": gain(lambda r: r["request_throughput"]),
                                    "ttft_p50": gain(lambda r: r["ttft_ms"]["p50"])}


def documents_arrived(row: dict) -> bool:
    """Every document a graphchunk pass sent was looked up (at concurrency 1 exactly once), but those
    of requests run as vLLM's full prefill (``blend_full_prefills``) whose entries were not kept:
    while another request waits for pool room such a request is planned for nothing, so none of its
    documents is looked up (``Admission._compute_for_later``)."""
    cache = row["cache"]
    unplanned = cache["documents_sent"] / row["num_prompts"] * (cache.get("blend_full_prefills") or 0)
    return cache["chunk_lookups"] + unplanned >= cache["documents_sent"] and (
        row["concurrency"] > 1 or cache["chunk_lookups"] == cache["documents_sent"])


def checks(rows: list[dict], kinds: list[str], levels) -> dict:
    """What must hold whatever the timings; None where a run lacks the rows to tell. Prompt tokens:
    each graphchunk request's count against vanilla's for the same request, as
    ``serve_trace.expected_token_gap`` predicts from the same prompt text."""
    gaps = {(lv.concurrency, trace): g for lv in levels for trace, g in lv.token_gaps.items()}
    for row in rows:
        base = _vanilla_base(rows, row)
        if row["kind"] != "vanilla" and base is not None:
            seen = [v - g for v, g in zip(base["prompt_lens"], row["prompt_lens"])]
            row["prompt_tokens_vs_vanilla"] = {"vanilla_minus_graphchunk": [min(seen), max(seen)],
                                               "as_expected": seen == gaps[row["concurrency"], row["trace"]]}
    gc = [r for r in rows if r["kind"] != "vanilla"]
    hit = lambda kind, phase: [r["cache"]["chunk_hit_rate"] for r in gc if (r["kind"], r["phase"]) == (kind, phase)]  # noqa: E731
    out = {"all_completed": all(r["completed"] == r["num_prompts"] and r["failed"] == 0 for r in rows),
           "same_prompt_text_as_vanilla": all(g is not None for gap in gaps.values() for g in gap),
           "prompt_tokens_as_expected": all(r["prompt_tokens_vs_vanilla"]["as_expected"] for r in gc
                                            if "prompt_tokens_vs_vanilla" in r) if "vanilla" in kinds else None,
           "documents_arrived": all(map(documents_arrived, gc)) if gc else None,
           "ceiling_prefix_cache_hits": all((r["cache"]["prefix_cache_hits"] or 0) > 0 for r in rows
                                            if r["phase"] == "ceiling") if "vanilla" in kinds else None}
    for kind in (k for k in kinds if k != "vanilla"):
        if on_corpus(kind):  # cold is first sight for the pool only: its chunks come from the tier
            out[f"{kind}_cold_from_the_tier"] = all((r["cache"]["tier_hits"] or 0) > 0 and not r["cache"]["chunk_misses"]
                                                    for r in gc if (r["kind"], r["phase"]) == (kind, "cold"))
            continue
        out[f"{kind}_warm_hits_more_than_cold"] = all(w > c for w, c in zip(hit(kind, "warm"), hit(kind, "cold")))
        pre = [r["cache"]["tier_hits"] or 0 for r in gc if (r["kind"], r["phase"]) == (kind, "precomputed")]
        out[f"{kind}_precomputed_tier_hits"] = all(t > 0 for t in pre) if pre else None
    return out


def report(args, command: str, clock, model: Path, levels, rows: list[dict], servers: list[dict],
           precomputed: dict | None) -> dict:
    compare(rows)
    found = checks(rows, args.kinds, levels)
    argv = [row.pop("bench_argv") for row in rows][:1]
    for row in rows:
        row.pop("prompt_lens")
    from graphchunk.engine.worker import POOL_SHARE  # the worker's own sizing rule (pool_blocks_in)

    pool_tokens = pool_tokens_at(args, model, POOL_SHARE)
    working = {mode: max(T.working_set_tokens(level, mode, args.block_size) for level in levels)
               for mode in ("isolated", "blend")}
    sizes = {"levels": [{"concurrency": lv.concurrency, "documents": len(lv.docs),
                         "requests_per_pass": len(lv.traces["cold"]),
                         "document_tokens_mean": sum(lv.doc_tokens) / len(lv.doc_tokens)} for lv in levels],
             "chunk_pool_tokens": pool_tokens, "working_set_tokens_max": working,
             "pool_holds_working_set": all(w <= pool_tokens for w in working.values()),
             "prompt_tokens_vanilla_minus_graphchunk": sorted({g for lv in levels for gap in lv.token_gaps.values()
                                                               for g in gap if g is not None})}
    return {"benchmark": "serve: vllm bench serve against vanilla vLLM", "command": command,
            "vllm_bench_serve": "vllm bench serve " + shlex.join(argv[0]) if argv else None,
            "config": H.config_dict(args), "model": str(model), "device": H.device_name(),
            "environment": clock.environment(), "sizes": sizes, "servers": servers, "precompute": precomputed,
            "checks": found, "rows": rows,
            "notes": [f"--kv-cache-memory-bytes {args.kv_cache_bytes} for every server; graphchunk's chunk pool is "
                      f"half of it, {pool_tokens} tokens (kinds with /pool=SHARE: that share of it), against a "
                      f"largest level working set of {max(working.values())} tokens (upper bound: whole blocks "
                      f"per entry)",
                      "vllm_bench_serve: the first pass's arguments (through the shim); every pass has its own "
                      "--dataset-path, --num-prompts, --max-concurrency, --request-id-prefix and --result-filename",
                      "chunk_hit_rate = 1 - chunk misses / documents sent over the pass: the share of documents "
                      "whose KV was not computed (found in the pool or the tier). graphchunk counts a lookup per "
                      "step a document's tokens are scheduled in, so where chunked prefill (vLLM's 2048-token "
                      "step budget on CPU) splits a prompt over two steps, at concurrency >= 8, chunk_lookups "
                      "exceed documents_sent and the second lookup is a hit; at concurrency 1 they are equal. "
                      "prefix_cache_* are vLLM's own /metrics (tokens)",
                      f"running, waiting, device_kv_blocks, pool_blocks_used: /metrics sampled every "
                      f"{SAMPLE_INTERVAL} s while the pass ran (median, max, samples; the first read is taken as "
                      "the pass starts): vLLM's num_requests_running and num_requests_waiting; the device KV blocks "
                      "requests hold, vLLM's kv_cache_usage_perc x (device_kv_blocks_total - 1), "
                      "device_kv_blocks_total being num_gpu_blocks of vllm:cache_config_info (what graphchunk's "
                      "pool leaves vLLM; prefix-cached blocks no request holds count free, as in vLLM's usage); "
                      "graphchunk's pool_blocks_used gauge. cache.tier_host_hits: tier loads served from the host-"
                      "memory level (graphchunk_tier_host_hits; tier_hits counts lookups served by either level)",
                      "ratios: graphchunk / vanilla of the same phase and level (precomputed: vanilla cold); "
                      "ttft_*_speedup = vanilla / graphchunk; gain_fraction = (graphchunk - vanilla warm) / "
                      "(vanilla ceiling - vanilla warm)"]}


LINE_STYLES = {"cold": ":", "warm": "-", "precomputed": "--", "ceiling": "-."}
COLORS = {"vanilla": "tab:gray", "isolated": "tab:blue", "blend": "tab:orange"}


def plot(result: dict, path: Path) -> None:
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    kinds = list(dict.fromkeys([*COLORS, *(r["kind"] for r in result["rows"])]))
    series = sorted({(r["kind"], r["phase"]) for r in result["rows"]}, key=lambda kp: (kinds.index(kp[0]), kp[1]))
    for kind, phase in series:
        rows = sorted((r for r in result["rows"] if (r["kind"], r["phase"]) == (kind, phase)),
                      key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        style = dict(ls=LINE_STYLES[phase], marker="o", color="black" if phase == "ceiling" else COLORS.get(kind, f"C{kinds.index(kind)}"),
                     label=f"{kind} {phase}" + (": every prompt a prefix-cache hit" if phase == "ceiling" else ""))
        axes[0].plot(xs, [r["request_throughput"] for r in rows], **style)
        axes[1].plot(xs, [r["ttft_ms"]["p50"] / 1000 for r in rows], **style)
    for ax, label in zip(axes, ("requests / s", "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{Path(result['model']).name}, {result['config']['dtype']}, {result['config']['format']} RAG "
                 f"traffic, {result['device']}", fontsize=9)
    H.save_figure(fig, path)


def med_max(spread: dict | None) -> str:
    """A sampled gauge's ``median/max`` ("-": not sampled)."""
    return f"{spread['median']:g}/{spread['max']:g}" if spread else "-"


def table(result: dict) -> str:
    width = max([9, *(len(r["kind"]) for r in result["rows"])])
    lines = [f"{'kind':{width}s} phase        c  req/s   tok/s  TTFT p50 ms  p99 ms  TPOT p50  hit rate  x vanilla req/s  "
             "TTFT speedup  gain(req/s)  running  waiting  KV blocks  pool blocks  tier(host) hits  preempt"]
    for r in result["rows"]:
        hit = r["cache"]["chunk_hit_rate"] if r["kind"] != "vanilla" else r["cache"]["prefix_cache_hit_rate"]
        vs, gain = r.get("vs_vanilla", {}), r.get("gain_fraction", {})
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        tier = f"{fmt(r['cache']['tier_hits'], '.0f')}({fmt(r['cache'].get('tier_host_hits'), '.0f')})"
        lines.append(f"{r['kind']:{width}s} {r['phase']:11s} {r['concurrency']:3d} {r['request_throughput']:6.2f} "
                     f"{r['output_throughput']:7.1f} {r['ttft_ms']['p50']:11.0f} {r['ttft_ms']['p99']:7.0f} "
                     f"{fmt(r['tpot_ms']['p50'], '8.0f')} {fmt(hit, '9.2f')} {fmt(vs.get('request_throughput'), '16.2f')} "
                     f"{fmt(vs.get('ttft_p50_speedup'), '13.2f')} {fmt(gain.get('request_throughput'), '11.2f')}  "
                     f"{med_max(r.get('running')):>7s}  {med_max(r.get('waiting')):>7s}  "
                     f"{med_max(r.get('device_kv_blocks')):>9s}  {med_max(r.get('pool_blocks_used')):>11s}  "
                     f"{tier:>15s}  {fmt(r['cache']['preemptions'], '7.0f')}")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perf/serving/bench_serve.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and servers")
    g.add_argument("--model", default="smollm2", help="smollm2, tiny-llama3 or a path")
    g.add_argument("--dtype", default="float32", help="float32: this CPU has no native bf16")
    g.add_argument("--kv-cache-bytes", type=int, default=4 << 30, help="--kv-cache-memory-bytes; graphchunk's pool: half")
    g.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default, given so the precompute matches")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--enforce-eager", action="store_true", help="no vLLM compilation (quick runs only)")
    g.add_argument("--startup-timeout", type=float, default=900.0)
    g.add_argument("--kinds", type=_names, default=list(KINDS), help="server kinds (vanilla is needed for the ratios)")
    g.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="vLLM's step token budget for every server (0: vLLM's default; a large one runs vanilla's "
                        "prefills in steps of their own, its pure-decode TPOT)")
    g.add_argument("--no-precomputed", action="store_true", help="skip the precompute and the precomputed passes")
    g.add_argument("--precomputed-kinds", type=_names, default=None,
                   help="the graphchunk kinds that also serve from a precomputed tier (default: every one)")
    g.add_argument("--context-size", type=int, default=2,
                   help="blend-corpus kinds: documents before each one in its precompute (BM25's most related)")
    t = p.add_argument_group("traffic")
    t.add_argument("--format", choices=("chat", "completions"), default="chat")
    t.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="levels (--max-concurrency of a pass)")
    t.add_argument("--num-prompts", type=_ints, default=[24, 48, 96],
                   help="requests per pass: one per level, or one for all")
    t.add_argument("--docs-per-level", type=int, default=40, help="documents of each level's slice of the corpus")
    t.add_argument("--docs-per-prompt", type=int, default=5)
    t.add_argument("--doc-tokens", type=_pair, default=(160, 220), help="LO,HI: document length (log-uniform)")
    t.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s: P(rank r) ~ r^-s")
    t.add_argument("--questions", type=int, default=64)
    t.add_argument("--question-words", type=_pair, default=(6, 16))
    t.add_argument("--output-len", type=int, default=16)
    t.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="", help="traces, vLLM's result files, logs, tier ('': a temp directory)")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory (the tier is always removed)")
    p.add_argument("--out", type=Path, default=H.REPO / "perf/results/serve.json")
    p.add_argument("--plot", type=Path, default=H.REPO / "perf/results/serve.png")
    return p


QUICK = dict(model="tiny-llama3", concurrency=[1], num_prompts=[6], precomputed_kinds=["isolated"], docs_per_level=8,
             docs_per_prompt=3, doc_tokens=(40, 80), questions=16, output_len=4, kv_cache_bytes=1 << 28,
             max_model_len=1024, enforce_eager=True, out=Path(tempfile.gettempdir()) / "serve_quick.json",
             plot=Path(tempfile.gettempdir()) / "serve_quick.png")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _pair(text: str) -> tuple[int, int]:
    lo, hi = _ints(text)
    return lo, hi


def _names(text: str) -> list[str]:
    names = text.split(",")
    try:
        for name in names:
            settings_of(name)
    except (ValueError, SystemExit) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def precomputes(args, kind: str) -> bool:
    """Whether ``kind`` also serves the cold trace from a precomputed tier (the docstring's
    ``precomputed`` pass: graphchunk kinds of the chat form, as ``--precomputed-kinds`` says)."""
    if kind == "vanilla" or on_corpus(kind) or args.format != "chat" or args.no_precomputed:
        return False
    return args.precomputed_kinds is None or kind in args.precomputed_kinds


def run(args, command: str, log=print) -> dict:
    clock = H.RunClock()
    model = H.resolve_model(args.model)
    tokenizer = H.load_tokenizer(model)
    levels = T.build_levels(tokenizer, args.concurrency, args, random.Random(args.seed))
    for level in levels:
        level.token_gaps = {trace: T.expected_token_gap(tokenizer, level, trace) if args.format == "chat"
                            else [0] * len(requests) for trace, requests in level.traces.items()}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"[serve] {len(levels)} levels x {args.docs_per_level} documents, requests per pass "
        f"{args.num_prompts}; work directory {work}")
    rows, servers, precomputed, contextualized = [], [], None, None
    tier, context_tier = work / "tier", work / "tier-context"
    try:
        for kind in args.kinds:
            if on_corpus(kind) and contextualized is None:
                context_tier.mkdir(exist_ok=True)
                contextualized = precompute(args, model, levels, context_tier, work, log, context=True)
            found, server = run_kind(args, model, kind, levels, work, context_tier if on_corpus(kind) else None, log)
            rows += found
            servers.append(server)
            if not precomputes(args, kind):
                continue
            if precomputed is None:
                tier.mkdir(exist_ok=True)
                precomputed = precompute(args, model, levels, tier, work, log)
            found, server = run_kind(args, model, kind, levels, work, tier, log)
            rows += found
            servers.append(server)
            clock.mark(kind)
    except BaseException:
        args.keep_work = True
        log(f"[serve] failed; server logs, traces and vLLM's result files kept in {work}")
        raise
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(context_tier, ignore_errors=True)
        if not (args.keep_work or args.work_dir):
            shutil.rmtree(work, ignore_errors=True)
    result = report(args, command, clock, model, levels, rows, servers, precomputed)
    result["precompute_context"] = contextualized
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = H.parse_with_quick(build_parser(), argv, QUICK)
    if len(args.num_prompts) == 1:
        args.num_prompts = args.num_prompts * len(args.concurrency)
    if len(args.num_prompts) != len(args.concurrency):
        raise SystemExit("--num-prompts: one value, or one per --concurrency level")
    H.script_env()
    result = run(args, H.command_line(__file__, argv))
    H.write_json(args.out, result)
    plot(result, args.plot)
    print(table(result))
    print(f"wrote {args.out} and {args.plot}")
    failed = [name for name, ok in result["checks"].items() if ok is False]
    if failed:
        print(f"checks failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
