"""The host-scale benchmark's report (``bench_host_scale.py``): per-phase statistics of its step
records, the worker's per-request slope, issue 62's acceptance over a run, the console line and the
plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from perf.common import harness as H

PHASES = ("admission", "decode", "steady")
ACCEPTANCE = dict(
    running=[256, 1024], entries=[10000, 100000], connector_ratio_decode=0.10, connector_ratio_steady=0.25,
    pool_growth=0.25, pool_growth_floor_ms=0.05, worker_us_per_running_request=2.0,
    text=("graphchunk's connector time per step at most 10 % of vLLM's own scheduler time in the same run in "
          "decode steps and at most 25 % in steady state, at 256 and 1024 running requests, with 10k and 100k "
          "pool entries (medians); its per-step cost does not grow with pool entries (median at the most "
          "entries at most (1 + pool_growth) x the median at the fewest + pool_growth_floor_ms, per mode, "
          "running count and phase: noise on a shared machine); the "
          "worker's host time per decode step grows by at most 2 us per running request (least-squares slope "
          "of the decode medians over the running counts, per mode and entries)."))


def stats(values) -> dict | None:
    values = [float(v) for v in values]
    if not values:
        return None
    rounded = lambda x: round(x, 4)  # noqa: E731
    return dict(p50=rounded(H.percentile(values, 50)), p99=rounded(H.percentile(values, 99)),
                mean=rounded(float(np.mean(values))), max=rounded(max(values)), n=len(values))


def summarize(steps: list[dict], phase: str, graphchunk: bool) -> dict:
    fields = ("vllm_own_ms", "connector_ms", "worker_host_ms", "total_ms") if graphchunk else ("total_ms",)
    out = dict(steps=len(steps), **{field: stats(s[field] for s in steps) for field in fields})
    if not graphchunk:
        out["vllm_own_ms"] = out["total_ms"]
    for field in ("running", "waiting", "admitted", "finished", "tokens"):
        out[f"{field}_mean"] = round(float(np.mean([s[field] for s in steps])), 2) if steps else None
    admitted = sum(s["admitted"] for s in steps)
    out["admitted"], out["finished"] = admitted, sum(s["finished"] for s in steps)
    if graphchunk and steps:
        out["connector_ratio"] = H.ratio(out["connector_ms"]["p50"], out["vllm_own_ms"]["p50"])
        out["worker_ratio"] = H.ratio(out["worker_host_ms"]["p50"], out["vllm_own_ms"]["p50"])
        fills = sum(s["fills"] for s in steps)
        out["fills"] = fills
        out["pseudo_seqs"] = sum(s["pseudo_seqs"] for s in steps)
        out["scored_seqs"] = sum(s["scored_seqs"] for s in steps)
        out["pseudo_seqs_per_fill"] = round(out["pseudo_seqs"] / fills, 2) if fills else None
        if phase == "admission":
            out["worker_host_ms_per_admitted_request"] = \
                round(sum(s["worker_host_ms"] for s in steps) / admitted, 4) if admitted else None
            out["pseudo_seqs_per_admitted_request"] = round(out["pseudo_seqs"] / admitted, 2) if admitted else None
        if phase != "admission":  # each step's times (admission's may be a thousand steps)
            out["series"] = {field: [round(s[field], 4) for s in steps]
                             for field in ("vllm_own_ms", "connector_ms", "worker_host_ms")}
        methods = sorted({m for s in steps for m in s.get("connector_by_method_ms", {})})
        out["connector_by_method_ms_p50"] = {
            m: round(H.percentile([s.get("connector_by_method_ms", {}).get(m, 0.0) for s in steps], 50), 4)
            for m in methods}
    return out


def fit_slopes(configs: list[dict]) -> list[dict]:
    """Per mode and entries: the least-squares slope of the worker's decode median over the running
    counts, in us per running request."""
    fits = []
    for mode in sorted({c["mode"] for c in configs}):
        for entries in sorted({c["entries"] for c in configs if c["mode"] == mode}):
            points = sorted((c["running"], c["phases"]["decode"]["worker_host_ms"]["p50"]) for c in configs
                            if c["mode"] == mode and c["entries"] == entries and c["phases"]["decode"]["steps"])
            slope = None
            if len({r for r, _ in points}) >= 2:
                slope = round(float(np.polyfit([r for r, _ in points], [ms for _, ms in points], 1)[0]) * 1e3, 4)
            fits.append(dict(mode=mode, entries=entries, running=[r for r, _ in points],
                             worker_decode_ms_p50=[ms for _, ms in points], worker_us_per_running_request=slope))
    return fits


def acceptance(configs: list[dict], fits: list[dict]) -> dict:
    """Issue 62's acceptance over what this run measured (a criterion whose configurations are all
    missing is None)."""
    a = ACCEPTANCE
    ratios = []
    for c in configs:
        if c["running"] in a["running"] and c["entries"] in a["entries"]:
            decode, steady = c["connector_ratio_decode"], c["connector_ratio_steady"]
            ratios.append(dict(mode=c["mode"], running=c["running"], entries=c["entries"],
                               connector_ratio_decode=decode, connector_ratio_steady=steady,
                               ok=decode is not None and steady is not None and
                               decode <= a["connector_ratio_decode"] and steady <= a["connector_ratio_steady"]))
    growth = []
    for mode in sorted({c["mode"] for c in configs}):
        for running in sorted({c["running"] for c in configs if c["mode"] == mode}):
            group = sorted((c for c in configs if c["mode"] == mode and c["running"] == running),
                           key=lambda c: c["entries"])
            if len(group) < 2:
                continue
            for phase in ("decode", "steady"):
                lo, hi = (g["phases"][phase]["connector_ms"] for g in (group[0], group[-1]))
                if not lo or not hi:
                    continue
                rel = H.ratio(hi["p50"], lo["p50"])
                growth.append(dict(mode=mode, running=running, phase=phase, entries=[group[0]["entries"],
                                   group[-1]["entries"]], connector_ms_p50=[lo["p50"], hi["p50"]],
                                   ratio=round(rel, 3) if rel is not None else None,
                                   ok=hi["p50"] <= lo["p50"] * (1 + a["pool_growth"]) + a["pool_growth_floor_ms"]))
    slopes = [dict(mode=f["mode"], entries=f["entries"], worker_us_per_running_request=slope,
                   ok=slope <= a["worker_us_per_running_request"])
              for f in fits if (slope := f["worker_us_per_running_request"]) is not None]
    verdict = lambda rows: all(r["ok"] for r in rows) if rows else None  # noqa: E731
    result = dict(criteria=a, connector_ratio=ratios, pool_growth=growth, worker_slope=slopes,
                  connector_ratio_ok=verdict(ratios), pool_growth_ok=verdict(growth), worker_slope_ok=verdict(slopes))
    parts = [result["connector_ratio_ok"], result["pool_growth_ok"], result["worker_slope_ok"]]
    result["passed"] = None if None in parts else all(parts)
    return result


def phase_line(phases: dict) -> str:
    parts = []
    for phase in PHASES:
        p = phases[phase]
        own = (p["vllm_own_ms"] or {}).get("p50")
        text = f"{phase} {p['steps']} steps vLLM {own:.2f} ms" if own is not None else f"{phase} -"
        if p.get("connector_ms"):
            text += f" conn {p['connector_ms']['p50']:.3f} worker {p['worker_host_ms']['p50']:.3f}"
        parts.append(text)
    return "; ".join(parts)


def plot(result: dict, path: Path) -> None:
    """Per mode and phase (decode, steady): the connector's and vLLM's own ms per step (medians)
    against running requests (at the most entries) and against pool entries (at 256 running, else
    the nearest), one line per label."""
    plt = H.pyplot()
    runs = result["runs"]
    modes = sorted({c["mode"] for run in runs.values() for c in run["configs"]})
    rows = [(mode, phase) for mode in modes for phase in ("decode", "steady")]
    fig, axes = plt.subplots(len(rows) or 1, 2, figsize=(11, 3.2 * max(1, len(rows))), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (mode, phase) in enumerate(rows):
        for col, axis in enumerate(("running", "entries")):
            ax = axes[row][col]
            every = [c for run in runs.values() for c in run["configs"] if c["mode"] == mode]
            other = "entries" if axis == "running" else "running"
            # One point held for every label: the most entries; the running count nearest 256.
            fixed = max(c["entries"] for c in every) if axis == "running" else \
                min({c["running"] for c in every}, key=lambda r: (abs(r - 256), r))
            xlabel = "running requests" if axis == "running" else "pool entries"
            ax.set_title(f"{mode}, {phase}: {fixed} {'pool entries' if axis == 'running' else 'running'}", fontsize=9)
            for n, (label, run) in enumerate(sorted(runs.items())):
                chosen = sorted((c for c in run["configs"] if c["mode"] == mode and c[other] == fixed),
                                key=lambda c: c[axis])
                if not chosen:
                    continue
                xs = [c[axis] for c in chosen]
                color = colors[n % len(colors)]
                for field, style, name in (("connector_ms", "-o", "connector"), ("vllm_own_ms", "--s", "vLLM own"),
                                           ("worker_host_ms", ":^", "worker host")):
                    ys = [(c["phases"][phase][field] or {}).get("p50") for c in chosen]
                    if any(y for y in ys):
                        ax.plot(xs, [max(y or 0, 1e-4) for y in ys], style, color=color, label=f"{name} ({label})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("ms per step (median)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    H.save_figure(fig, path)
