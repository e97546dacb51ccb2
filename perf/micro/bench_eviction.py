"""Chunk hit rate and recomputed tokens of every eviction policy on synthetic RAG traces.

    python -m perf.micro.bench_eviction                       # the committed results, ~1 min (one core)
    python -m perf.micro.bench_eviction --quick               # smoke run, seconds
    python -m perf.micro.bench_eviction --replot              # the plot again from the result file

Drives graphchunk's real ``ChunkPool`` (``graphchunk/cache/pool.py``) with each policy of
``graphchunk/cache/eviction.py`` on the same trace, no model involved.

Trace. A corpus of --docs documents with lognormal lengths (median --median-tokens, sigma
--sigma, clipped to [--min-tokens, --max-tokens]); document popularity is Zipf with exponent s
(p(rank r) ~ r^-s) over a random permutation of the corpus, independent of length. Every request
retrieves k ~ U{--k-min..--k-max} distinct documents drawn from that distribution. Scenarios:
``zipf-s`` (stationary, one per --skews) and ``shift-s`` (for --shift-skews: the popularity
permutation is redrawn halfway through, so yesterday's hot documents go cold and aging matters).
Seeded (--seed): every policy sees the same requests.

Per request, as a step does: every document is looked up (``pool.lookup``); a miss is inserted
(``pool.insert``) and marked ready (its KV "computed": its tokens count as recomputed); then all
of the request's entries are released. A document that does not fit beside the request's other
entries (``PoolExhausted``) is recomputed uncached ("bypassed"). Counting starts after the first
--warmup share of requests (cold misses are the same for every policy).

Pool sizes: --fractions of the working set (blocks of every document the trace references; block
size --block-size). Per (scenario, pool size, policy): chunk hit rate (hits / lookups), recomputed
tokens, both relative to LRU.

Policies: ``lru``, ``lfu`` (LFU with dynamic aging), ``gdsf`` (cost = tokens, the pool's default
cost), ``gdsf-cost1`` (gdsf with ``insert(cost=1)``: classic GDSF, favours small documents, i.e.
chunk hits over tokens saved), and ``belady``: furthest next use, from the known trace. With
documents of varied size exact offline optimum is NP-hard, and furthest-next-use Belady is the
standard offline reference, not a strict bound: a size-aware policy can beat it on chunk hit rate
(small documents are more hits per block), and with k documents pinned per request even on tokens.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from graphchunk.cache.eviction import Belady
from graphchunk.cache.pool import ChunkPool, PoolExhausted

from perf.common import harness as H

POLICIES = ("lru", "lfu", "gdsf", "gdsf-cost1", "belady")
NOTE_OBJECTIVE = ("The default policy is chosen on recomputed tokens (the prefill a miss costs); chunk hit rate "
                  "counts a 32-token document like a 2048-token one.")
NOTE_BELADY = ("belady = evict the entry whose next use is furthest (offline, knows the trace). With documents "
               "of varied size the exact offline optimum is NP-hard; furthest-next-use is the standard offline "
               "reference, not a strict bound (a size-aware policy can exceed its chunk hit rate).")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--requests", type=int, default=12000)
    p.add_argument("--k-min", type=int, default=3)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--median-tokens", type=int, default=300)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--skews", default="0.6,0.8,1.0,1.2")
    p.add_argument("--shift-skews", default="0.8,1.0", help="skews of the popularity-shift scenario ('' for none)")
    p.add_argument("--fractions", default="0.02,0.05,0.1,0.2,0.3,0.5")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="500 docs, 2000 requests")
    p.add_argument("--replot", action="store_true", help="only draw --plot from --out")
    p.add_argument("--out", default="perf/results/eviction.json")
    p.add_argument("--plot", default="perf/results/eviction.png")
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.requests = 500, 2000
    return args


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


# --- trace ------------------------------------------------------------------------------------

def doc_lengths(args, rng) -> np.ndarray:
    raw = rng.lognormal(math.log(args.median_tokens), args.sigma, args.docs)
    return np.clip(np.rint(raw), args.min_tokens, args.max_tokens).astype(int)


def zipf_probs(n: int, skew: float, rng) -> np.ndarray:
    """p[doc] for a popularity ranking that is a random permutation of the corpus."""
    weights = np.arange(1, n + 1, dtype=float) ** -skew
    probs = np.empty(n)
    probs[rng.permutation(n)] = weights / weights.sum()
    return probs


def make_trace(args, skew: float, shift: bool, rng) -> list[list[int]]:
    probs = zipf_probs(args.docs, skew, rng)
    trace = []
    for t in range(args.requests):
        if shift and t == args.requests // 2:
            probs = zipf_probs(args.docs, skew, rng)
        k = int(rng.integers(args.k_min, args.k_max + 1))
        trace.append([int(d) for d in rng.choice(args.docs, size=k, replace=False, p=probs)])
    return trace


def next_uses(trace: list[list[int]]) -> dict[int, list[int]]:
    positions: dict[int, list[int]] = {}
    for t, docs in enumerate(trace):
        for d in docs:
            positions.setdefault(d, []).append(t)
    return positions


# --- replay -----------------------------------------------------------------------------------

def key(doc: int) -> bytes:
    return doc.to_bytes(4, "little")


def make_pool(policy: str, num_blocks: int, block_size: int, positions, clock) -> ChunkPool:
    if policy == "belady":
        def next_use(entry) -> float:
            pos = positions[int.from_bytes(entry.key, "little")]
            i = bisect.bisect_right(pos, clock[0])
            return pos[i] if i < len(pos) else math.inf
        return ChunkPool(num_blocks, block_size, policy=Belady(next_use))
    return ChunkPool(num_blocks, block_size, policy="gdsf" if policy == "gdsf-cost1" else policy)


def replay(trace, lengths, policy: str, num_blocks: int, args, positions) -> dict:
    clock = [0]
    pool = make_pool(policy, num_blocks, args.block_size, positions, clock)
    cost = 1 if policy == "gdsf-cost1" else None
    start = int(len(trace) * args.warmup)
    stats = dict(lookups=0, hits=0, recomputed_tokens=0, bypassed=0)
    for t, docs in enumerate(trace):
        clock[0] = t
        held, counted = [], t >= start
        for d in docs:
            entry = pool.lookup(key(d), (d,))
            if entry is None:
                try:
                    entry = pool.insert(key(d), (d,), int(lengths[d]), cost)
                    pool.mark_ready(entry)
                    held.append(entry)
                except PoolExhausted:
                    stats["bypassed"] += counted
                stats["recomputed_tokens"] += int(lengths[d]) * counted
            else:
                held.append(entry)
                stats["hits"] += counted
            stats["lookups"] += counted
        for entry in held:
            pool.release(entry)
    pool.check_invariants()
    stats["evictions"] = pool.metrics.evictions
    stats["hit_rate"] = stats["hits"] / stats["lookups"]
    return stats


def run_scenario(args, lengths, skew: float, shift: bool, rng) -> list[dict]:
    from vllm.utils.math_utils import cdiv

    trace = make_trace(args, skew, shift, rng)
    positions = next_uses(trace)
    working_blocks = sum(cdiv(int(lengths[d]), args.block_size) for d in positions)
    name = f"{'shift' if shift else 'zipf'}-{skew:g}"
    points = []
    for fraction in floats(args.fractions):
        num_blocks = max(1, round(fraction * working_blocks))
        row = {p: replay(trace, lengths, p, num_blocks, args, positions) for p in args.policies.split(",")}
        for policy, stats in row.items():
            points.append(point(name, skew, shift, fraction, num_blocks, policy, stats, row.get("lru"), args))
        print(f"{name:10s} pool {fraction:5.0%}: " + "  ".join(
            f"{p} {s['hit_rate']:.3f}/{s['recomputed_tokens'] / 1e6:.2f}M" for p, s in row.items()), flush=True)
    return points


def point(name, skew, shift, fraction, num_blocks, policy, stats, lru, args) -> dict:
    out = dict(scenario=name, skew=skew, shift=shift, fraction=fraction, pool_blocks=num_blocks,
               pool_tokens=num_blocks * args.block_size, policy=policy, **stats)
    if lru is not None:
        out["hit_rate_vs_lru"] = stats["hit_rate"] / lru["hit_rate"] if lru["hit_rate"] else None
        out["recomputed_vs_lru"] = stats["recomputed_tokens"] / lru["recomputed_tokens"]
    return out


# --- summary and plot -------------------------------------------------------------------------

def summarize(points: list[dict]) -> dict:
    """Per policy: mean hit rate and recomputed tokens relative to LRU over all points, the share
    of LRU's gap to Belady closed (recomputed tokens), and at how many points it recomputes the
    fewest tokens of the online policies."""
    by = {}
    for p in points:
        by.setdefault((p["scenario"], p["fraction"]), {})[p["policy"]] = p
    fewest = [min((q for q in g.values() if q["policy"] != "belady"), key=lambda q: q["recomputed_tokens"])["policy"]
              for g in by.values()]
    summary = {}
    for policy in {p["policy"] for p in points}:
        rows = [g for g in by.values() if policy in g and "lru" in g]
        rec = [g[policy]["recomputed_vs_lru"] for g in rows]
        hit = [g[policy]["hit_rate_vs_lru"] for g in rows if g[policy]["hit_rate_vs_lru"]]
        gaps = [(g["lru"]["recomputed_tokens"] - g[policy]["recomputed_tokens"])
                / (g["lru"]["recomputed_tokens"] - g["belady"]["recomputed_tokens"])
                for g in rows if "belady" in g and g["lru"]["recomputed_tokens"] > g["belady"]["recomputed_tokens"]]
        summary[policy] = dict(mean_recomputed_vs_lru=float(np.mean(rec)), worst_recomputed_vs_lru=float(max(rec)),
                               mean_hit_rate_vs_lru=float(np.mean(hit)),
                               mean_gap_to_belady_closed=float(np.mean(gaps)) if gaps else None,
                               points_fewest_recomputed=fewest.count(policy) if policy != "belady" else None)
    return summary


def plot(result: dict, path: str) -> None:
    plt = H.pyplot()
    points = result["points"]
    scenarios = list(dict.fromkeys(p["scenario"] for p in points))
    policies = list(dict.fromkeys(p["policy"] for p in points))
    fig, axes = plt.subplots(2, len(scenarios), figsize=(3.2 * len(scenarios), 6.4), squeeze=False)
    for col, scen in enumerate(scenarios):
        for policy in policies:
            rows = [p for p in points if p["scenario"] == scen and p["policy"] == policy]
            x = [100 * p["fraction"] for p in rows]
            style = dict(marker="o", ms=3, label=policy, ls="--" if policy == "belady" else "-")
            axes[0, col].plot(x, [p["hit_rate"] for p in rows], **style)
            if "recomputed_vs_lru" in rows[0]:
                axes[1, col].plot(x, [p["recomputed_vs_lru"] for p in rows], **style)
        axes[0, col].set_title(scen, fontsize=10)
        axes[1, col].set_xlabel("pool, % of working set")
        ticks = sorted({100 * p["fraction"] for p in points})
        for ax in axes[:, col]:
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("chunk hit rate")
    axes[1, 0].set_ylabel("recomputed tokens / LRU's")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=10)
    H.save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), args.plot)
        return 0
    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    lengths = doc_lengths(args, rng)
    scenarios = [(s, False) for s in floats(args.skews)] + [(s, True) for s in floats(args.shift_skews)]
    points = [p for skew, shift in scenarios for p in run_scenario(args, lengths, skew, shift, rng)]
    result = dict(
        title=f"{args.docs} docs ({args.min_tokens}-{args.max_tokens} tok, median {args.median_tokens}), "
              f"{args.requests} requests of {args.k_min}-{args.k_max} Zipf docs",
        command=H.command_line(__file__, argv), config=vars(args),
        corpus=dict(tokens=int(lengths.sum()), mean_tokens=float(lengths.mean()),
                    median_tokens=float(np.median(lengths))),
        note=[NOTE_OBJECTIVE, NOTE_BELADY], summary=summarize(points), points=points,
        wall_s=round(time.perf_counter() - started, 1))
    H.write_json(args.out, result)
    plot(result, args.plot)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out} and {args.plot} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
