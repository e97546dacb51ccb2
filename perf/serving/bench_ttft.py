"""Time to first token: vanilla vLLM vs graphchunk (all chunks missing, all chunks cached).

    python -m perf.serving.bench_ttft [--chunks 8 --chunk-tokens 512 --sys-tokens 32 --question-tokens 64
                               --repeats N --dtype float32 --sweep 1,2,4,8 --modes blend,isolated
                               --out perf/results/ttft_cpu.json --plot perf/results/ttft_cpu.png]

One engine configuration for every measurement (same vLLM kwargs: dtype, prefix caching on, block
size, max_num_batched_tokens >= the longest prompt so no prefill is chunked, same KV memory, of
which graphchunk carves its chunk pool). One engine per kind, built one after the other in this
process, each once, sweeping the number of chunks inside it:

* ``vanilla``   ``vllm.LLM``;
* ``graphchunk`` ``GraphChunkLLM`` (``worker_cls="graphchunk.Runner"``), one engine per ``--modes``
  entry (``blend``, graphchunk's default, with its default recompute policy; ``isolated``), every
  ratio against the same vanilla run.

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
question only (the S sys tokens may count as reused in both: they are copied from the pool; in
blend mode they may count as computed instead, and an all-hit request recomputes some of its
chunk tokens, ``blend_tokens_recomputed``).

Workload (``ttft_workload.py``): CPython's help-topic text ('#' removed), documents, sys and
questions cut to exactly L, S and Q tokens, seeded. Prompts go in as token ids (with explicit
segment boundaries for graphchunk), so both engines see exactly the same tokens. Engines, timing
and the result file's common parts: ``harness.py``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from perf.common import harness as H
from perf.serving.ttft_workload import Request, Workload, build_workload, engine_requests, expected_stats, stats_violations

REPO = H.REPO
TARGET = {"speedup_all_hit": 20.0, "ratio_all_miss": 1.1}
STAT_KEYS = ("lookups", "hits", "misses", "evictions", "tokens_reused", "tokens_computed", "blend_tokens_recomputed")


# --- engines ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineSetup:
    llm_kwargs: dict
    graphchunk: dict
    kv_bytes_per_token: int
    notes: list[str]


def engine_setup(args, model_path: str, workload: Workload) -> EngineSetup:
    from vllm.utils.math_utils import cdiv, round_up

    kv_per_token = H.kv_bytes_per_token(model_path, args.dtype)
    bs = args.block_size
    longest = max(args.sweep) * args.chunk_tokens + args.sys_tokens + args.question_tokens
    # Headroom: the generated token, and a little more; a multiple of 1024 keeps the number tidy.
    max_model_len = round_up(longest + 256, 1024)
    # Pool: every document of the workload stays cached (no eviction), plus the sys entry.
    entry_blocks = cdiv(args.sys_tokens % bs + args.chunk_tokens, bs)
    pool_blocks = len(workload.docs) * entry_blocks + 2 * cdiv(args.sys_tokens, bs) + 8
    pool_tokens = pool_blocks * bs
    # The scheduler's own blocks: room for several whole prompts (the prefix cache keeps some).
    own_tokens = 4 * max_model_len
    kv_bytes = args.kv_cache_bytes or (pool_tokens + own_tokens) * kv_per_token
    llm_kwargs = H.llm_kwargs(model_path, dtype=args.dtype, block_size=bs, max_model_len=max_model_len,
                              max_num_seqs=args.max_num_seqs, kv_cache_bytes=kv_bytes, seed=args.seed,
                              enforce_eager=args.enforce_eager)
    graphchunk = dict(pool_tokens=pool_tokens, max_chunks=max(32, max(args.sweep)),
                      max_chunk_len=max(2048, args.chunk_tokens))
    notes = [f"max_num_batched_tokens = max_model_len = {max_model_len} >= longest prompt {longest}: "
             "every prompt is prefilled in one step (no chunked prefill)",
             f"kv_cache_memory_bytes = {int(kv_bytes)} for both engines; graphchunk takes its pool "
             f"({pool_tokens} tokens, {pool_tokens * kv_per_token} bytes) out of it",
             f"block_size = {bs} in both engines (vLLM's CPU default is 128); vLLM's prefix cache keeps whole "
             f"blocks only, so it can serve {args.sys_tokens // bs * bs} of the {args.sys_tokens} sys tokens"]
    return EngineSetup(llm_kwargs, graphchunk, kv_per_token, notes)


def sampling_params(boundaries: list[int] | None):
    from graphchunk.engine.request_args import BOUNDARIES_ARG

    return H.ttft_params({BOUNDARIES_ARG: boundaries} if boundaries is not None else None)


def check_request(kind: str, req: Request, out, delta: dict, workload: Workload, *, sys_tokens: int,
                  question_tokens: int, block_size: int, mode: str | None = None) -> tuple[dict | None, dict, list[str]]:
    """(the counter ranges a graphchunk request had to meet, None for vanilla; the counters outside
    them; failure messages): vLLM's prefix cache may serve at most the sys prompt's whole blocks,
    graphchunk's counters must be as ``expected_stats`` says."""
    where = f"{kind}{'-' + mode if mode else ''} {req.phase} k={req.k} #{req.index}"
    failures = []
    # a graphchunk request's context counts as cached (its connector supplies it); the counters below
    # tell whether the pool served it
    limit = len(out.prompt_token_ids) - question_tokens if kind == "graphchunk" else sys_tokens // block_size * block_size
    if (out.num_cached_tokens or 0) > limit:
        failures.append(f"{where}: vLLM prefix cache served {out.num_cached_tokens} tokens, more than "
                        f"{limit} (the sys prompt's whole blocks, or a graphchunk request's context)")
    expected = expected_stats(req, workload, sys_tokens, question_tokens, mode) if kind == "graphchunk" else None
    wrong = stats_violations(delta, expected) if expected is not None else {}
    if wrong:
        failures.append(f"{where}: (got, expected range) {wrong}")
    return expected, wrong, failures


def run_engine(kind: str, setup: EngineSetup, workload: Workload, *, sys_tokens: int, question_tokens: int,
               vanilla_miss_phase: bool = False, mode: str | None = None, log=print) -> dict:
    """Builds one engine (graphchunk's in ``mode``), runs its request sequence through it, shuts it down."""
    t0 = time.perf_counter()
    engine = H.make_engine(kind, setup.llm_kwargs, {**setup.graphchunk, "mode": mode} if mode else setup.graphchunk)
    startup = time.perf_counter() - t0
    name = f"{kind}-{mode}" if mode else kind
    log(f"[{name}] engine up in {startup:.1f} s")
    records, failures = [], []
    first_tokens: dict[tuple, int] = {}
    try:
        before = H.engine_stats(engine)
        for req in engine_requests(kind, workload, vanilla_miss_phase):
            ids, bounds = workload.prompt(req)
            out, ttft = H.timed_generate(engine, {"prompt_token_ids": ids},
                                         sampling_params(bounds if kind == "graphchunk" else None))
            after = H.engine_stats(engine)
            delta = H.counter_delta(before, after, STAT_KEYS)
            before = after
            rec = dict(phase=req.phase, k=req.k, index=req.index, counted=req.counted, ttft_s=ttft,
                       prompt_tokens=len(ids), num_cached_tokens=out.num_cached_tokens,
                       first_token=out.outputs[0].token_ids[0], stats_delta=delta or None,
                       load1=os.getloadavg()[0])
            expected, wrong, found = check_request(kind, req, out, delta, workload, sys_tokens=sys_tokens,
                                                   question_tokens=question_tokens,
                                                   block_size=setup.llm_kwargs["block_size"], mode=mode)
            failures += found
            if expected is not None:
                rec["stats_expected"] = {key: list(rng) for key, rng in expected.items()}
                rec["stats_ok"] = not wrong
            if req.phase == "miss":
                first_tokens[(req.k, req.index)] = rec["first_token"]
            elif req.phase == "hit" and req.source is not None:
                rec["same_first_token_as_miss"] = rec["first_token"] == first_tokens.get((req.k, req.source))
            records.append(rec)
            log(f"[{name}] {req.phase:>13} k={req.k} #{req.index:<2} {'' if req.counted else '(warm-up) '}"
                f"{1e3 * ttft:8.1f} ms  cached={out.num_cached_tokens}"
                + (f"  {delta}" if delta else ""))
        final_stats = H.engine_stats(engine) or None
    finally:
        H.shutdown(engine)
        del engine
    return dict(mode=mode, startup_s=startup, records=records, failures=failures, final_stats=final_stats)


# --- summary ------------------------------------------------------------------------------------

def summarize(vanilla: dict, graph: dict, sweep: list[int]) -> dict:
    def times(run, phase, k):
        return [r["ttft_s"] for r in run["records"] if r["counted"] and r["k"] == k
                and (phase is None or r["phase"] == phase)]

    per_k = {}
    for k in sorted(sweep):
        row = dict(vanilla=H.percentiles(times(vanilla, None, k)),
                   all_miss=H.percentiles(times(graph, "miss", k)),
                   all_hit=H.percentiles(times(graph, "hit", k)))
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


def plot(modes: dict, path: Path, title: str) -> None:
    plt = H.pyplot()
    first = next(iter(modes.values()))["per_chunks"]
    ks = sorted(int(k) for k in first)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = [(first, "vanilla", "vanilla vLLM (prefix caching)", "o-")]
    for mode, found in modes.items():
        curves += [(found["per_chunks"], "all_miss", f"graphchunk {mode}, all chunks missing", "s-"),
                   (found["per_chunks"], "all_hit", f"graphchunk {mode}, all chunks cached", "^-")]
    for per_k, name, label, style in curves:
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
    H.save_figure(fig, path)


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
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"),
                   help="float32: this CPU has no native bf16 (vLLM would emulate it)")
    p.add_argument("--modes", default="blend,isolated", help="graphchunk's engines, one per mode, each against vanilla")
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
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or not set(args.modes) <= {"blend", "isolated"}:
        p.error(f"--modes: blend and/or isolated, got {args.modes}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    H.script_env()
    model_path = str(H.resolve_model(args.model))
    workload = build_workload(H.load_tokenizer(model_path), sweep=args.sweep, chunk_tokens=args.chunk_tokens,
                              sys_tokens=args.sys_tokens, question_tokens=args.question_tokens,
                              repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    setup = engine_setup(args, model_path, workload)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"workload: {len(workload.docs)} documents, {len(workload.requests)} requests per engine; "
        f"sweep {args.sweep}; engine kwargs {setup.llm_kwargs}; graphchunk {setup.graphchunk}")
    clock = H.RunClock()
    common = dict(sys_tokens=args.sys_tokens, question_tokens=args.question_tokens,
                  vanilla_miss_phase=args.vanilla_miss_phase, log=log)
    vanilla = run_engine("vanilla", setup, workload, **common)
    clock.mark("after_vanilla")
    graphs = {}
    for mode in args.modes:
        graphs[mode] = run_engine("graphchunk", setup, workload, mode=mode, **common)
        clock.mark(f"after_{mode}")

    device = H.device_name()
    failures = vanilla["failures"] + [f for graph in graphs.values() for f in graph["failures"]]
    modes = {}
    for mode, graph in graphs.items():
        per_k = summarize(vanilla, graph, args.sweep)
        head = per_k[str(args.chunks)]
        modes[mode] = {
            "speedup_all_hit": head["speedup_all_hit"], "ratio_all_miss": head["ratio_all_miss"],
            "target": {**TARGET, "met": head["speedup_all_hit"] >= TARGET["speedup_all_hit"]
                       and head["ratio_all_miss"] <= TARGET["ratio_all_miss"]},
            "headline": {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "sys_tokens": args.sys_tokens,
                         "question_tokens": args.question_tokens, "vanilla_p50_s": head["vanilla"]["p50"],
                         "all_miss_p50_s": head["all_miss"]["p50"], "all_hit_p50_s": head["all_hit"]["p50"]},
            "per_chunks": per_k, "cache_checks": cache_checks(graph, args.sweep)}
    result = {
        "device": device,
        "command": H.command_line(__file__, argv),
        "modes": modes,
        "config": {**H.config_dict(args),
                   "llm_kwargs": setup.llm_kwargs, "graphchunk": setup.graphchunk,
                   "kv_bytes_per_token": setup.kv_bytes_per_token, "notes": setup.notes + workload.notes,
                   "num_documents": len(workload.docs), "requests_per_engine": len(workload.requests),
                   "timing": "wall time of generate([one prompt], SamplingParams(max_tokens=1, temperature=0))"},
        "checks_passed": not failures,
        "failures": failures,
        "environment": clock.environment(),
        "raw": {"vanilla": vanilla, **{f"graphchunk-{mode}": graph for mode, graph in graphs.items()}},
    }
    H.write_json(args.out, result)
    plot(modes, args.plot, f"TTFT, {args.chunk_tokens}-token chunks, S={args.sys_tokens}, "
                           f"Q={args.question_tokens}, {args.dtype}; {device}")

    print(f"\nTTFT on {device}, {args.dtype}, L={args.chunk_tokens} S={args.sys_tokens} Q={args.question_tokens}, "
          f"{args.repeats} requests per point")
    for mode, found in modes.items():
        print(f"graphchunk {mode}:")
        print(f"{'chunks':>6} {'vanilla p50/p90 ms':>20} {'all-miss p50/p90 ms':>20} {'all-hit p50/p90 ms':>20}"
              f" {'speedup hit':>11} {'ratio miss':>10}")
        for k in args.sweep:
            row = found["per_chunks"][str(k)]
            cell = lambda name: f"{1e3 * row[name]['p50']:.1f}/{1e3 * row[name]['p90']:.1f}"  # noqa: E731
            print(f"{k:>6} {cell('vanilla'):>20} {cell('all_miss'):>20} {cell('all_hit'):>20}"
                  f" {row['speedup_all_hit']:>11.2f} {row['ratio_all_miss']:>10.3f}")
        print(f"headline (k={args.chunks}): speedup_all_hit = {found['speedup_all_hit']:.2f} "
              f"(target >= {TARGET['speedup_all_hit']:g}), ratio_all_miss = {found['ratio_all_miss']:.3f} "
              f"(target <= {TARGET['ratio_all_miss']:g})")
    print(f"cache checks: {'all requests as expected' if not failures else 'FAILED'}")
    for failure in failures:
        print(f"  {failure}")
    print(f"wrote {args.out} and {args.plot}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
