"""Replicas benchmark: graphchunk servers behind vLLM's router, per routing policy, on the serving
bench's RAG traces, measured by vLLM's own load generator.

    python -m perf.serving.bench_replicas [--policies round_robin,cache_aware,kv_aware] [--replicas 2]
                                  [--mode isolated] [--concurrency 8] [--num-prompts 48]
                                  [--out perf/results/replicas.json] [--quick]

For each policy, ``--replicas`` fresh graphchunk servers sharing a fresh tier directory behind
``vllm-router`` (``replicas.py``; ``kv_aware`` fed by each server's KV events), then the cold and
the warm trace of one level (``serve_trace.py``, the serving bench's: Zipf popularity, three
system prompts, documents in the chat request's ``documents`` field) through the router; and
``one``: the same traces on a single server (no router), the pool hit rate one server reaches.
Servers use the serving bench's flags (``bench_serve.server_flags``).

Each row: vLLM's numbers (request throughput, TTFT p50/p99), and from every replica's /metrics
(its own counters) the fleet's chunk lookups and where they were served: the replica's pool
(``hits``), the shared tier (``tier_hits``) or computed (``misses``); requests per replica. What a
policy is judged by here is where documents were served from: on one machine the replicas share
its cores, so throughput does not scale with replicas and is reported, not compared.
"""
from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path

from perf.serving import bench_serve as B
from perf.common import harness as H
from perf.serving import serve_trace as T
from perf.serving.replicas import ROUTER_POLICIES, Replicas
from perf.common.server import scrape, total

COUNTED = ("vllm:graphchunk_lookups_total", "vllm:graphchunk_hits_total", "vllm:graphchunk_tier_hits_total",
           "vllm:graphchunk_misses_total", "vllm:request_success_total", "vllm:prefix_cache_hits_total",
           "vllm:prefix_cache_queries_total")


ROUTER_COUNTED = ("vllm_router_prefix_routing_decisions_total", "vllm_router_kv_placement_lookups_total",
                  "vllm_router_kv_routing_inputs_total", "vllm_router_cache_hits_total", "vllm_router_cache_misses_total")
"""The router's own counters of how it decided (prefix match, load fallback, ...), by label."""


def counted(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {name: total(samples, name) or 0.0 for name in COUNTED}


def router_counted(router) -> dict[str, float]:
    """``ROUTER_COUNTED`` samples of the router's /metrics, keyed ``name{labels}``."""
    if router is None:
        return {}
    found = {}
    for name, labels, value in scrape(router.metrics_url):
        if name in ROUTER_COUNTED:
            found[name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"] = value
    return found


def run_pass(args, fleet: Replicas, name: str, phase: str, level, work: Path, log=print) -> dict:
    """One ``vllm bench serve`` pass of ``level``'s ``phase`` trace through the router (or the one
    server): its row, with every replica's counter deltas."""
    n, c = len(level.traces[phase]), level.concurrency
    label = f"{name}-{phase}-c{c}"
    jsonl = T.write_jsonl(work / "traces" / f"{label}.jsonl", T.chat_rows(level, phase, documents_field=True))
    result_file = work / "results" / f"{label}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    url = fleet.router.url if fleet.router is not None else fleet.servers[0].url
    before, router_before = [counted(s.url) for s in fleet.servers], router_counted(fleet.router)
    found = B.vllm_bench_serve(B.bench_argv(args, url, str(fleet.servers[0].model), jsonl, n, c, result_file, label))
    after, router_after = [counted(s.url) for s in fleet.servers], router_counted(fleet.router)
    deltas = [{k: a[k] - b[k] for k in COUNTED} for a, b in zip(after, before)]
    fleet_total = {k: sum(d[k] for d in deltas) for k in COUNTED}
    lookups = fleet_total["vllm:graphchunk_lookups_total"] or None
    row = {"policy": name, "phase": phase, "concurrency": c, "num_prompts": n, "completed": found["completed"],
           "failed": found["failed"], "request_throughput": found["request_throughput"],
           "ttft_ms": {"p50": found.get("p50_ttft_ms"), "p99": found.get("p99_ttft_ms")},
           "tpot_ms": {"p50": found.get("p50_tpot_ms")},
           "lookups": fleet_total["vllm:graphchunk_lookups_total"],
           "pool_hit_rate": H.ratio(fleet_total["vllm:graphchunk_hits_total"], lookups),
           "tier_hit_rate": H.ratio(fleet_total["vllm:graphchunk_tier_hits_total"], lookups),
           "computed_rate": H.ratio(fleet_total["vllm:graphchunk_misses_total"], lookups),
           "prefix_cache_hit_rate": H.ratio(fleet_total["vllm:prefix_cache_hits_total"],
                                            fleet_total["vllm:prefix_cache_queries_total"] or None),
           "requests_per_replica": [d["vllm:request_success_total"] for d in deltas],
           "per_replica": deltas,
           "router_decisions": {k: v - router_before.get(k, 0.0) for k, v in router_after.items()
                                if v - router_before.get(k, 0.0)}}
    log(f"[replicas] {label}: {row['completed']}/{n} ok, {row['request_throughput']:.2f} req/s, TTFT p50 "
        f"{row['ttft_ms']['p50']:.0f} ms; lookups served from pool {row['pool_hit_rate'] or 0:.2f}, tier "
        f"{row['tier_hit_rate'] or 0:.2f}, computed {row['computed_rate'] or 0:.2f}; requests per replica "
        f"{row['requests_per_replica']}")
    return row


class _One:
    """One server without a router, shaped like ``Replicas`` for ``run_pass``."""

    router = None

    def __init__(self, server):
        self.servers = [server]


def run_policy(args, model: Path, name: str, level, work: Path, log=print) -> tuple[list[dict], dict]:
    """The cold then the warm pass of ``level`` on fresh servers (and a fresh tier) for ``name``."""
    tier = work / f"tier-{name}"
    tier.mkdir(parents=True, exist_ok=True)
    settings = {"mode": args.mode}
    if name == "one":
        server = B.start_server(args, model, args.mode, work, tier, log)
        fleet, stop = _One(server), server.stop
    else:
        fleet = Replicas(model, n=args.replicas, dtype=args.dtype, graphchunk=settings, tier=tier,
                         flags=B.server_flags(args), policy=name, block_size=args.block_size, log_dir=work)
        log(f"[replicas] starting {args.replicas} servers behind vllm-router --policy {name}")
        fleet.start(args.startup_timeout, lambda s, line: log(f"[replicas]   {s:4.0f} s  {line[:100]}"))
        stop = fleet.stop
    try:
        rows = [run_pass(args, fleet, name, phase, level, work, log) for phase in ("cold", "warm")]
    finally:
        stop()
        shutil.rmtree(tier, ignore_errors=True)
    setup = {"policy": name, "servers": ["vllm " + " ".join(s.args) for s in fleet.servers]}
    if fleet.router is not None:
        setup["router"] = " ".join(fleet.router.args)
    return rows, setup


def build_parser():
    p = B.build_parser()
    p.prog = "perf/serving/bench_replicas.py"
    p.description = __doc__.splitlines()[0]
    r = p.add_argument_group("replicas")
    r.add_argument("--policies", type=lambda text: text.split(","), default=["one", "round_robin", "cache_aware",
                                                                            "kv_aware"],
                   help=f"'one' (a single server) and vllm-router policies: {', '.join(ROUTER_POLICIES)}")
    r.add_argument("--replicas", type=int, default=2)
    r.add_argument("--mode", default="isolated", choices=("isolated", "blend"))
    p.set_defaults(concurrency=[8], num_prompts=[48], out=H.REPO / "perf/results/replicas.json", plot=None)
    return p


QUICK = dict(B.QUICK, concurrency=[2], num_prompts=[6], out=Path(tempfile.gettempdir()) / "replicas_quick.json")
QUICK.pop("plot")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = H.parse_with_quick(build_parser(), argv, QUICK)
    unknown = [p for p in args.policies if p != "one" and p not in ROUTER_POLICIES]
    if unknown:
        raise SystemExit(f"--policies: unknown {unknown}; known: one, {', '.join(ROUTER_POLICIES)}")
    H.script_env()
    clock = H.RunClock()
    model = H.resolve_model(args.model)
    [level] = T.build_levels(H.load_tokenizer(model), args.concurrency[:1], args, random.Random(args.seed))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-replicas-"))
    rows, setups = [], []
    try:
        for name in args.policies:
            found, setup = run_policy(args, model, name, level, work)
            rows += found
            setups.append(setup)
            clock.mark(name)
    except BaseException:
        print(f"[replicas] failed; logs kept in {work}")
        raise
    if not (args.keep_work or args.work_dir):
        shutil.rmtree(work, ignore_errors=True)
    result = {"benchmark": "replicas", "command": H.command_line(__file__, argv), "device": H.device_name(),
              "environment": clock.environment(), "config": H.config_dict(args, skip=("out", "plot")),
              "documents": len(level.docs), "docs_per_prompt": args.docs_per_prompt, "rows": rows,
              "setups": setups}
    H.write_json(args.out, result)
    print(table(rows))
    print(f"wrote {args.out}")
    return 1 if any(row["failed"] for row in rows) else 0


def table(rows: list[dict]) -> str:
    lines = ["| policy | trace | req/s | TTFT p50 ms | pool | tier | computed | requests per replica |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['phase']} | {r['request_throughput']:.2f} | {r['ttft_ms']['p50']:.0f} | "
                     f"{r['pool_hit_rate'] or 0:.2f} | {r['tier_hit_rate'] or 0:.2f} | {r['computed_rate'] or 0:.2f} | "
                     f"{', '.join(f'{n:.0f}' for n in r['requests_per_replica'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
