"""Time to first token: vanilla vLLM vs graphchunk (all chunks missing, all chunks cached).

    python perf/bench_ttft.py [--chunks 8 --chunk-tokens 512 --sys-tokens 32 --question-tokens 64
                               --repeats N --dtype bfloat16 --sweep 1,2,4,8
                               --out perf/results/ttft_cpu.json --plot perf/results/ttft_cpu.png]

One engine configuration for every measurement (same vLLM kwargs: dtype, prefix caching on, block
size, max_num_batched_tokens >= the longest prompt so no prefill is chunked, same KV memory, of
which graphchunk carves its chunk pool). Two engines, built one after the other in this process,
each once, sweeping the number of chunks inside it:

* ``vanilla``   ``vllm.LLM``;
* ``graphchunk`` ``GraphChunkLLM`` (``worker_cls="graphchunk.Runner"``).

The request sequence, per number of chunks k (largest k first), after one global warm-up:

* miss phase: W warm-up + N requests whose k documents were never seen before;
* hit phase:  W warm-up + N requests, request i with the documents of miss-phase request i in a
  new order (for k = 1: one document of an earlier request where it was not the first one;
  uncounted 2-chunk "seed" requests provide such documents when the sweep has none).

Every request's first document has never been the first document of an earlier request, so
vLLM's prefix cache cannot help beyond the sys prompt in either engine (``num_cached_tokens`` is
recorded and checked). graphchunk runs everything: its miss phase is ``all_miss``, its hit phase
``all_hit``. vanilla runs the hit phase, i.e. exactly the prompts of ``all_hit`` (with
``--vanilla-miss-phase`` the miss phase too; both cost vanilla a full prefill).
TTFT is the wall time of ``generate`` of one request with ``max_tokens=1, temperature=0``.
graphchunk's counters (``stats()``) are read around every request and checked: an all-miss
request shows k chunk lookups, all misses, and computes its k*L chunk tokens and its question;
an all-hit request shows k lookups, all hits, reuses its k*L chunk tokens and computes its
question only (the S sys tokens may count as reused in both: they are copied from the pool).

Workload: CPython's ``pydoc_data.topics`` text ('#' removed). A document is the text from one
paragraph on, tokenized with the model's tokenizer and cut to exactly L tokens (each document
starts at another paragraph, so all are distinct); sys and questions are cut the same way to S and
Q tokens. Everything is seeded. Prompts go in as token ids (with explicit segment boundaries for
graphchunk), so both engines see exactly the same tokens.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# vLLM kills the engine when one step takes over 300 s; a 4k-token bf16 prefill on a CPU without
# native bf16 (AVX2 only) under load comes close, and that step is what this script measures.
os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TARGET = {"speedup_all_hit": 20.0, "ratio_all_miss": 1.1}
LEADING = 32
"""Tokens at the start of every sys, document and question that no other one shares."""
STAT_KEYS = ("lookups", "hits", "misses", "evictions", "tokens_reused", "tokens_computed")


# --- workload -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    phase: str  # "global_warmup", "seed", "miss" or "hit"
    k: int
    index: int  # within its phase; index < warmup: not counted
    docs: tuple[int, ...]  # document ids, in prompt order
    question: tuple[int, ...]
    counted: bool
    source: int | None = None  # hit phase: index of the miss request with the same documents


@dataclass
class Workload:
    sys: tuple[int, ...]
    docs: list[tuple[int, ...]]
    requests: list[Request]
    chunk_tokens: int
    notes: list[str] = field(default_factory=list)

    def prompt(self, req: Request) -> tuple[list[int], list[int]]:
        """Token ids and segment boundaries (start of each chunk and of the question)."""
        ids, bounds = list(self.sys), []
        for d in req.docs:
            bounds.append(len(ids))
            ids.extend(self.docs[d])
        bounds.append(len(ids))
        ids.extend(req.question)
        return ids, bounds


def corpus_paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for paragraph in topics[name].replace("#", "").split("\n\n"):
            if paragraph.strip():
                paragraphs.append(paragraph.strip("\n"))
    return paragraphs


class TextSource:
    """Token windows of exactly n tokens starting at paragraph p of the corpus."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.paragraphs = corpus_paragraphs()

    def window(self, p: int, n: int) -> tuple[int, ...] | None:
        text, tokens, q = "", [], p
        while q < len(self.paragraphs):
            text = self.paragraphs[q] if q == p else text + "\n\n" + self.paragraphs[q]
            q += 1
            if len(text) >= 2 * n:  # cheap guard before tokenizing (a token is ~4 characters)
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if len(tokens) >= n:
                    return tuple(tokens[:n])
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        return tuple(tokens[:n]) if len(tokens) >= n else None


def build_workload(tokenizer, *, sweep: list[int], chunk_tokens: int, sys_tokens: int, question_tokens: int,
                   repeats: int, warmup: int, seed: int) -> Workload:
    rng = random.Random(seed)
    source = TextSource(tokenizer)
    starts = list(range(len(source.paragraphs)))
    rng.shuffle(starts)
    starts_iter = iter(starts)

    def take(n: int, seen: set) -> tuple[int, ...]:
        # Distinct leading tokens, not just distinct windows: the help topics repeat some paragraphs,
        # and two documents opening with the same one would share prefix-cache blocks.
        for p in starts_iter:
            window = source.window(p, n)
            if window is not None and window[:LEADING] not in seen:
                seen.add(window[:LEADING])
                return window
        raise RuntimeError(f"the corpus has too few distinct {n}-token windows for this workload; "
                           "lower --repeats, --warmup or the sweep")

    seen: set = set()
    sys_ids = take(sys_tokens, seen) if sys_tokens else ()
    docs: list[tuple[int, ...]] = []
    firsts: set[int] = set()  # documents that have been the first document of a request
    used: list[int] = []  # documents of earlier requests, in order of first use
    requests: list[Request] = []
    notes: list[str] = []

    def fresh_docs(k: int) -> tuple[int, ...]:
        ids = []
        for _ in range(k):
            docs.append(take(chunk_tokens, seen))
            ids.append(len(docs) - 1)
        return tuple(ids)

    def add(req: Request) -> None:
        requests.append(req)
        firsts.add(req.docs[0])
        used.extend(d for d in req.docs if d not in used_set)
        used_set.update(req.docs)

    used_set: set[int] = set()
    question = lambda: take(question_tokens, seen)  # noqa: E731
    # One request ahead of everything, not counted: process start-up costs and the sys entry.
    add(Request("global_warmup", 1, 0, fresh_docs(1), question(), False))
    per_phase = warmup + repeats
    for k in sorted(set(sweep), reverse=True):
        if k == 1:
            # Each k=1 hit request needs a document that sat off the first position earlier (else
            # vLLM's prefix cache would serve its context); uncounted 2-chunk seed requests add them.
            spare = [d for d in used if d not in firsts]
            for i in range(max(0, per_phase - len(spare))):
                add(Request("seed", 2, i, fresh_docs(2), question(), False))
        misses = []
        for i in range(per_phase):
            req = Request("miss", k, i, fresh_docs(k), question(), i >= warmup)
            misses.append(req)
            add(req)
        for i, miss in enumerate(misses):
            if k > 1:  # the same documents, a first one that never was first
                first = rng.choice([d for d in miss.docs if d not in firsts])
                rest = [d for d in miss.docs if d != first]
                rng.shuffle(rest)
                add(Request("hit", k, i, (first, *rest), miss.question, i >= warmup, source=i))
            else:  # one document of an earlier request, never first
                doc = rng.choice([d for d in used if d not in firsts])
                add(Request("hit", k, i, (doc,), question(), i >= warmup))
    return Workload(sys_ids, docs, requests, chunk_tokens, notes)


# --- engines ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineSetup:
    llm_kwargs: dict
    graphchunk: dict
    kv_bytes_per_token: int
    notes: list[str]


def engine_setup(args, model_path: str, workload: Workload) -> EngineSetup:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * dtype_bytes
    bs = args.block_size
    longest = max(args.sweep) * args.chunk_tokens + args.sys_tokens + args.question_tokens
    # Headroom: the generated token, and a little more; a multiple of 1024 keeps the number tidy.
    max_model_len = -(-(longest + 256) // 1024) * 1024
    # Pool: every document of the workload stays cached (no eviction), plus the sys entry.
    entry_blocks = -(-(args.sys_tokens % bs + args.chunk_tokens) // bs)
    pool_blocks = len(workload.docs) * entry_blocks + 2 * (-(-args.sys_tokens // bs)) + 8
    pool_tokens = pool_blocks * bs
    # The scheduler's own blocks: room for several whole prompts (the prefix cache keeps some).
    own_tokens = 4 * max_model_len
    kv_bytes = args.kv_cache_bytes or (pool_tokens + own_tokens) * kv_per_token
    llm_kwargs = dict(
        model=model_path, dtype=args.dtype, enable_prefix_caching=True, block_size=bs,
        max_model_len=max_model_len, max_num_batched_tokens=max_model_len, max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=int(kv_bytes), seed=args.seed, enforce_eager=args.enforce_eager,
    )
    graphchunk = dict(pool_tokens=pool_tokens, max_chunks=max(32, max(args.sweep)),
                      max_chunk_len=max(2048, args.chunk_tokens))
    notes = [f"max_num_batched_tokens = max_model_len = {max_model_len} >= longest prompt {longest}: "
             "every prompt is prefilled in one step (no chunked prefill)",
             f"kv_cache_memory_bytes = {int(kv_bytes)} for both engines; graphchunk takes its pool "
             f"({pool_tokens} tokens, {pool_tokens * kv_per_token} bytes) out of it",
             f"block_size = {bs} in both engines (vLLM's CPU default is 128); vLLM's prefix cache keeps whole "
             f"blocks only, so it can serve {args.sys_tokens // bs * bs} of the {args.sys_tokens} sys tokens"]
    return EngineSetup(llm_kwargs, graphchunk, kv_per_token, notes)


def make_engine(kind: str, setup: EngineSetup):
    if kind == "vanilla":
        from vllm import LLM

        return LLM(**setup.llm_kwargs)
    from graphchunk.llm import GraphChunkLLM

    kwargs = dict(setup.llm_kwargs)
    return GraphChunkLLM(kwargs.pop("model"), graphchunk=setup.graphchunk, **kwargs)


def shutdown(engine) -> None:
    if hasattr(engine, "shutdown") and hasattr(engine, "llm"):  # GraphChunkLLM
        engine.shutdown()
    else:
        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
    gc.collect()


def sampling_params(boundaries: list[int] | None):
    from vllm import SamplingParams

    from graphchunk.engine.frontend import BOUNDARIES_ARG

    extra = {BOUNDARIES_ARG: boundaries} if boundaries is not None else None
    return SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)


def _stats(engine) -> dict[str, float]:
    return engine.stats() if hasattr(engine, "stats") else {}


def expected_stats(req: Request, workload: Workload, sys_tokens: int,
                   question_tokens: int) -> dict[str, tuple[int, int]] | None:
    """graphchunk counter deltas a request must show, as inclusive ranges (None: unchecked).

    Chunk lookups only are counted (k per request); an all-miss request computes its k chunks
    and its question, an all-hit request its question only and reuses its k*L chunk tokens. The
    sys prompt's KV (S tokens) may be counted as reused in both (it is copied from the pool
    unless vLLM's prefix cache holds it)."""
    k, L, S, Q = req.k, workload.chunk_tokens, sys_tokens, question_tokens
    if req.phase in ("miss", "seed"):
        return {"lookups": (k, k), "hits": (0, 0), "misses": (k, k), "evictions": (0, 0),
                "tokens_reused": (0, S), "tokens_computed": (k * L + Q, k * L + Q)}
    if req.phase == "hit":
        return {"lookups": (k, k), "hits": (k, k), "misses": (0, 0), "evictions": (0, 0),
                "tokens_reused": (k * L, k * L + S), "tokens_computed": (Q, Q)}
    return None


def stats_violations(delta: dict, expected: dict[str, tuple[int, int]]) -> dict:
    """{counter: (got, expected range)} for every counter outside its range."""
    return {key: (delta.get(key), list(rng)) for key, rng in expected.items()
            if delta.get(key) is None or not rng[0] <= delta[key] <= rng[1]}


def engine_requests(kind: str, workload: Workload, vanilla_miss_phase: bool = False) -> list[Request]:
    """graphchunk runs every request; vanilla the hit phase (the reordered prompts) and the global
    warm-up, and the miss phase too when asked (it costs vanilla the same: a full prefill)."""
    if kind == "graphchunk" or vanilla_miss_phase:
        return [r for r in workload.requests if kind == "graphchunk" or r.phase != "seed"]
    return [r for r in workload.requests if r.phase in ("global_warmup", "hit")]


def run_engine(kind: str, setup: EngineSetup, workload: Workload, *, sys_tokens: int, question_tokens: int,
               vanilla_miss_phase: bool = False, log=print) -> dict:
    """Builds one engine, runs its request sequence through it, shuts it down."""
    t0 = time.perf_counter()
    engine = make_engine(kind, setup)
    startup = time.perf_counter() - t0
    log(f"[{kind}] engine up in {startup:.1f} s")
    generate = engine.generate if kind == "graphchunk" else (
        lambda p, sp: engine.generate(p, sp, use_tqdm=False))
    records, failures = [], []
    first_tokens: dict[tuple, int] = {}
    whole_sys_blocks = sys_tokens // setup.llm_kwargs["block_size"] * setup.llm_kwargs["block_size"]
    try:
        before = _stats(engine)
        for req in engine_requests(kind, workload, vanilla_miss_phase):
            ids, bounds = workload.prompt(req)
            params = sampling_params(bounds if kind == "graphchunk" else None)
            gc.collect()
            start = time.perf_counter()
            outputs = generate([{"prompt_token_ids": ids}], params)
            ttft = time.perf_counter() - start
            out = outputs[0]
            after = _stats(engine)
            delta = {key: int(after[key] - before[key]) for key in STAT_KEYS if key in after}
            before = after
            rec = dict(phase=req.phase, k=req.k, index=req.index, counted=req.counted, ttft_s=ttft,
                       prompt_tokens=len(ids), num_cached_tokens=out.num_cached_tokens,
                       first_token=out.outputs[0].token_ids[0], stats_delta=delta or None,
                       load1=os.getloadavg()[0])
            # vLLM's own prefix cache may only serve (whole blocks of) the sys prompt.
            if (out.num_cached_tokens or 0) > whole_sys_blocks:
                failures.append(f"{kind} {req.phase} k={req.k} #{req.index}: vLLM prefix cache served "
                                f"{out.num_cached_tokens} tokens, more than the sys prompt's whole blocks")
            expected = expected_stats(req, workload, sys_tokens, question_tokens) if kind == "graphchunk" else None
            if expected is not None:
                wrong = stats_violations(delta, expected)
                rec["stats_expected"] = {key: list(rng) for key, rng in expected.items()}
                rec["stats_ok"] = not wrong
                if wrong:
                    failures.append(f"graphchunk {req.phase} k={req.k} #{req.index}: (got, expected range) {wrong}")
            if req.phase == "miss":
                first_tokens[(req.k, req.index)] = rec["first_token"]
            elif req.phase == "hit" and req.source is not None:
                rec["same_first_token_as_miss"] = rec["first_token"] == first_tokens.get((req.k, req.source))
            records.append(rec)
            log(f"[{kind}] {req.phase:>13} k={req.k} #{req.index:<2} {'' if req.counted else '(warm-up) '}"
                f"{1e3 * ttft:8.1f} ms  cached={out.num_cached_tokens}"
                + (f"  {delta}" if delta else ""))
        final_stats = _stats(engine) or None
    finally:
        shutdown(engine)
        del engine
        gc.collect()
    return dict(startup_s=startup, records=records, failures=failures, final_stats=final_stats)


# --- summary ------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict:
    arr = np.asarray(values, dtype=float)
    return dict(p50=float(np.percentile(arr, 50)), p90=float(np.percentile(arr, 90)), mean=float(arr.mean()),
                min=float(arr.min()), max=float(arr.max()), n=int(arr.size))


def summarize(vanilla: dict, graph: dict, sweep: list[int]) -> dict:
    def times(run, phase, k):
        return [r["ttft_s"] for r in run["records"] if r["counted"] and r["k"] == k
                and (phase is None or r["phase"] == phase)]

    per_k = {}
    for k in sorted(sweep):
        row = dict(vanilla=percentiles(times(vanilla, None, k)),
                   all_miss=percentiles(times(graph, "miss", k)),
                   all_hit=percentiles(times(graph, "hit", k)))
        row["speedup_all_hit"] = row["vanilla"]["p50"] / row["all_hit"]["p50"]
        row["ratio_all_miss"] = row["all_miss"]["p50"] / row["vanilla"]["p50"]
        per_k[str(k)] = row
    return per_k


def cache_checks(graph: dict, sweep: list[int]) -> dict:
    out = {}
    for k in sorted(sweep):
        row = {}
        for phase, name in (("miss", "all_miss"), ("hit", "all_hit")):
            recs = [r for r in graph["records"] if r["k"] == k and r["phase"] == phase]
            total = {key: sum((r["stats_delta"] or {}).get(key, 0) for r in recs) for key in STAT_KEYS}
            row[name] = dict(requests=len(recs), all_as_expected=all(r.get("stats_ok") for r in recs),
                             expected_per_request=recs[0].get("stats_expected") if recs else None, totals=total)
            if phase == "hit":
                same = [r["same_first_token_as_miss"] for r in recs if "same_first_token_as_miss" in r]
                row[name]["same_first_token_as_miss_request"] = f"{sum(same)}/{len(same)}"
        out[str(k)] = row
    return out


def device_name() -> str:
    model = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({cores} cores)"


def versions() -> dict:
    import torch
    import vllm

    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "graphchunk"],
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "OMP_", "KMP_", "LD_PRELOAD"))}
    return dict(python=sys.version.split()[0], torch=torch.__version__, vllm=vllm.__version__,
                graphchunk_commit=commit, graphchunk_dirty=dirty, env=env)


def plot(per_k: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(int(k) for k in per_k)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label, style in (("vanilla", "vanilla vLLM (prefix caching)", "o-"),
                               ("all_miss", "graphchunk, all chunks missing", "s-"),
                               ("all_hit", "graphchunk, all chunks cached", "^-")):
        p50 = [1e3 * per_k[str(k)][name]["p50"] for k in ks]
        p90 = [1e3 * per_k[str(k)][name]["p90"] for k in ks]
        line, = ax.plot(ks, p50, style, label=label)
        ax.fill_between(ks, p50, p90, color=line.get_color(), alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("chunks per request")
    ax.set_ylabel("time to first token, p50 (ms; band up to p90)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8, help="chunks per request at the headline point")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--sys-tokens", type=int, default=32)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10, help="counted requests per (engine, phase, k)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests before them")
    p.add_argument("--sweep", default="1,2,4,8", help="numbers of chunks; --chunks is added")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="0: pool + 4 * max_model_len tokens")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--vanilla-miss-phase", action="store_true",
                   help="run vanilla on the miss-phase prompts too (its TTFT is then taken over both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--out", type=Path, default=REPO / "perf/results/ttft_cpu.json")
    p.add_argument("--plot", type=Path, default=REPO / "perf/results/ttft_cpu.png")
    args = p.parse_args(argv)
    args.sweep = sorted({int(x) for x in args.sweep.split(",") if x.strip()} | {args.chunks})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from graphchunk.reference import models

    model_path = args.model or str(models.smollm2_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    workload = build_workload(tokenizer, sweep=args.sweep, chunk_tokens=args.chunk_tokens,
                              sys_tokens=args.sys_tokens, question_tokens=args.question_tokens,
                              repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    setup = engine_setup(args, model_path, workload)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"workload: {len(workload.docs)} documents, {len(workload.requests)} requests per engine; "
        f"sweep {args.sweep}; engine kwargs {setup.llm_kwargs}; graphchunk {setup.graphchunk}")
    load = {"start": os.getloadavg()}
    started = time.time()
    common = dict(sys_tokens=args.sys_tokens, question_tokens=args.question_tokens,
                  vanilla_miss_phase=args.vanilla_miss_phase, log=log)
    vanilla = run_engine("vanilla", setup, workload, **common)
    load["after_vanilla"] = os.getloadavg()
    graph = run_engine("graphchunk", setup, workload, **common)
    load["end"] = os.getloadavg()

    per_k = summarize(vanilla, graph, args.sweep)
    head = per_k[str(args.chunks)]
    device = device_name()
    failures = vanilla["failures"] + graph["failures"]
    result = {
        "device": device,
        "speedup_all_hit": head["speedup_all_hit"],
        "ratio_all_miss": head["ratio_all_miss"],
        "target": {**TARGET, "met": head["speedup_all_hit"] >= TARGET["speedup_all_hit"]
                   and head["ratio_all_miss"] <= TARGET["ratio_all_miss"]},
        "headline": {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "sys_tokens": args.sys_tokens,
                     "question_tokens": args.question_tokens,
                     "vanilla_p50_s": head["vanilla"]["p50"], "all_miss_p50_s": head["all_miss"]["p50"],
                     "all_hit_p50_s": head["all_hit"]["p50"]},
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "llm_kwargs": setup.llm_kwargs, "graphchunk": setup.graphchunk,
                   "kv_bytes_per_token": setup.kv_bytes_per_token, "notes": setup.notes + workload.notes,
                   "num_documents": len(workload.docs), "requests_per_engine": len(workload.requests),
                   "timing": "wall time of generate([one prompt], SamplingParams(max_tokens=1, temperature=0))"},
        "per_chunks": per_k,
        "cache_checks": cache_checks(graph, args.sweep),
        "checks_passed": not failures,
        "failures": failures,
        "environment": {**versions(), "load_average": load, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                                                                     time.localtime(started)),
                        "wall_s": time.time() - started},
        "raw": {"vanilla": vanilla, "graphchunk": graph},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(per_k, args.plot, f"TTFT, {args.chunk_tokens}-token chunks, S={args.sys_tokens}, "
                           f"Q={args.question_tokens}, {args.dtype}; {device}")

    print(f"\nTTFT on {device}, {args.dtype}, L={args.chunk_tokens} S={args.sys_tokens} Q={args.question_tokens}, "
          f"{args.repeats} requests per point")
    print(f"{'chunks':>6} {'vanilla p50/p90 ms':>20} {'all-miss p50/p90 ms':>20} {'all-hit p50/p90 ms':>20}"
          f" {'speedup hit':>11} {'ratio miss':>10}")
    for k in args.sweep:
        row = per_k[str(k)]
        cell = lambda name: f"{1e3 * row[name]['p50']:.1f}/{1e3 * row[name]['p90']:.1f}"  # noqa: E731
        print(f"{k:>6} {cell('vanilla'):>20} {cell('all_miss'):>20} {cell('all_hit'):>20}"
              f" {row['speedup_all_hit']:>11.2f} {row['ratio_all_miss']:>10.3f}")
    print(f"\nheadline (k={args.chunks}): speedup_all_hit = {head['speedup_all_hit']:.2f} "
          f"(target >= {TARGET['speedup_all_hit']:g}), ratio_all_miss = {head['ratio_all_miss']:.3f} "
          f"(target <= {TARGET['ratio_all_miss']:g})")
    print(f"cache checks: {'all requests as expected' if not failures else 'FAILED'}")
    for failure in failures:
        print(f"  {failure}")
    print(f"wrote {args.out} and {args.plot}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
