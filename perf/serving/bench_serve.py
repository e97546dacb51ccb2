"""Serving benchmark: how much more one server serves, and how soon its users see a first token,
under RAG traffic, measured by vLLM's own load generator (``vllm bench serve``) against vanilla vLLM.

    python -m perf.serving.bench_serve [--model smollm2] [--concurrency 1,8,32] [--num-prompts 24,48,96]
                               [--format chat|completions] [--out perf/results/serve.json] [--quick]

Servers, one at a time, on the same ``vllm serve`` flags (``server_flags``; vLLM's compilation on
unless ``--enforce-eager``, prefix caching on, ``--kv-cache-memory-bytes`` of which graphchunk's
chunk pool takes half, sized to hold each level's working set, said in the JSON):

* the kinds of ``serve_kinds.py`` (``vanilla``, ``isolated``, ``blend``, their policies, entries,
  pools and host memory: its docstring lists them);

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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perf.common import harness as H
from perf.serving import serve_trace as T
from perf.serving.serve_kinds import KINDS, kind_options, on_corpus, pool_tokens_at, settings_of, tenant_of
from perf.serving.serve_report import SAMPLE_INTERVAL, make_row, one_line, plot, report, table
from perf.common.server import KV_USAGE, GaugeSampler, label_of, scrape, spread, total
from graphchunk.tools.serve_demo import VllmServer

COUNTERS = ("vllm:graphchunk_lookups_total", "vllm:graphchunk_hits_total", "vllm:graphchunk_misses_total",
            "vllm:graphchunk_tier_hits_total", "vllm:graphchunk_tier_host_hits_total",
            "vllm:graphchunk_evictions_total", "vllm:graphchunk_tokens_reused_total",
            "vllm:graphchunk_tokens_computed_total", "vllm:graphchunk_blend_tokens_recomputed_total",
            "vllm:graphchunk_blend_full_prefills_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", KV_USAGE, "vllm:graphchunk_pool_blocks_used")
"""The /metrics gauges sampled while a pass runs (``GaugeSampler``, every ``SAMPLE_INTERVAL`` s)."""


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
