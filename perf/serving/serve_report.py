"""The serving benchmark's rows and result (``bench_serve.py``): a pass's row from vLLM's result and
the server's /metrics, ratios against vanilla and the gain fraction (``compare``), what must hold
whatever the timings (``checks``), the result's JSON (``report``), its table and plot.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from perf.common import harness as H
from perf.serving import serve_trace as T
from perf.serving.serve_kinds import on_corpus, pool_tokens_at

SAMPLE_INTERVAL = 0.5
"""Seconds between two reads of a pass's /metrics gauges (``bench_serve.GAUGES``)."""


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
                      f"half of it, {pool_tokens} tokens (kinds with /pool=SHARE: that share of it; with "
                      f"/host=BYTES and no /pool=, a quarter: worker.pool_share), against a largest level working "
                      f"set of {max(working.values())} tokens (upper bound: whole blocks per entry)",
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
