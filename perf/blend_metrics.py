"""``bench_blend.py``'s quality metrics and summary: first-token KL over the whole vocabulary,
top-1 agreement under teacher forcing, exact match; the per-setting rows of the result file, the
table printed at the end and the plot (quality against TTFT)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import harness as H

FULL_KL_TOL = 1e-4
"""cacheblend r=1 must match vanilla: mean first-token KL at most this (vanilla vs itself: ~1e-7)."""
EM_RULE = ("exact_match = 1 if the expected 4-digit code occurs in the setting's free greedy answer "
           "(detokenized text of at most --answer-tokens tokens, generation stopped at EOS) as a whole "
           "number, i.e. re.search(r'(?<!\\d)CODE(?!\\d)', text); the mean over prompts")
DEFINITIONS = {
    "kl": "KL(vanilla || setting) in nats of the first generated token's distribution over the whole "
          "vocabulary (vLLM raw logprobs, logprobs=-1); kl is the mean over prompts (kl_median, kl_max too). "
          "vanilla's own row compares two identical vanilla requests (the second mostly served by "
          "vLLM's prefix cache): the harness noise floor",
    "top1_agreement": "the setting is fed vanilla's greedy continuation (continuation tokens, ignore_eos) "
                      "through the ForceTokens logits processor; share of all (prompt, step) pairs where the "
                      "setting's own argmax (raw logprobs, rank 1) equals vanilla's token",
    "exact_match": EM_RULE,
    "same_answer_as_vanilla": "share of prompts whose free answer text equals vanilla's",
    "ttft_ms": "p50 over prompts x repeats of the wall time of generate([one prompt], max_tokens=1, greedy); "
               "documents cached (a warm-up request per prompt and setting with another sys prompt and "
               "another document order), the timed request has the documents reordered behind a sys prompt "
               "never seen before (vLLM's prefix cache serves nothing: num_cached_tokens checked == 0). "
               "vanilla: a full prefill. isolated: see its ttft_note",
    "ttft_over_full_prefill": "ttft_ms over vanilla's ttft_ms, both p50s of this run (CacheBlend's includes "
                              "its check pass)",
    "param": "cacheblend: recompute ratio; legolink: tokens recomputed at the start of every chunk; else 0",
}
"""The result file's ``definitions``: what each row's numbers mean."""


# --- metrics --------------------------------------------------------------------------------------

def full_logprobs(out, vocab: int) -> np.ndarray:
    """The first generated position's logprobs over the whole vocabulary (flat_logprobs)."""
    lp = out.outputs[0].logprobs
    s, e = lp.start_indices[0], lp.end_indices[0]
    arr = np.full(vocab, -np.inf)
    arr[np.asarray(lp.token_ids[s:e], dtype=np.int64)] = np.asarray(lp.logprobs[s:e], dtype=np.float64)
    return arr


def kl_divergence(ref: np.ndarray, other: np.ndarray) -> float:
    p = np.exp(ref)
    mask = p > 0
    with np.errstate(invalid="ignore"):
        terms = p[mask] * (ref[mask] - other[mask])
    return float(np.sum(terms)) if np.all(np.isfinite(terms)) else float("inf")


def step_argmaxes(out) -> list[int]:
    """The model's own top-1 token (rank 1 of the raw logprobs) at every generated step."""
    tops = []
    for position in out.outputs[0].logprobs:
        best = [tid for tid, lp in position.items() if lp.rank == 1]
        tops.append(best[0] if best else max(position.items(), key=lambda kv: kv[1].logprob)[0])
    return tops


def exact_match(text: str, code: str) -> bool:
    return re.search(rf"(?<!\d){code}(?!\d)", text) is not None


# --- summary --------------------------------------------------------------------------------------

def summed(deltas: list[dict]) -> dict:
    keys = sorted({k for d in deltas for k in d})
    return {k: int(sum(d.get(k, 0) for d in deltas)) for k in keys}


def _stat(fn, values):
    return float(fn(values)) if len(values) else None


def rows(args, res) -> list[dict]:
    out = []
    full_prefill_ms = H.percentile(np.asarray(res["per"][args.settings[0].label]["ttft"]) * 1e3, 50)  # vanilla's p50
    for s in args.settings:
        per = res["per"][s.label]
        steps = [a for agree in per["top1"] for a in agree]
        ttft = np.asarray(per["ttft"]) * 1e3
        row = dict(policy=s.policy, param=s.param, label=s.label, extra_args=s.extra,
                   kl=_stat(np.mean, per["kl"]), kl_median=_stat(np.median, per["kl"]), kl_max=_stat(np.max, per["kl"]),
                   top1_agreement=_stat(np.mean, steps), first_token_agreement=_stat(np.mean, per["first_agree"]),
                   exact_match=_stat(np.mean, per["em"]), same_answer_as_vanilla=_stat(np.mean, per["same_answer"]),
                   ttft_ms=H.percentile(ttft, 50), ttft_p90_ms=H.percentile(ttft, 90),
                   n_prompts=len(per["kl"]), n_timed=int(ttft.size), n_continuation_steps=len(steps),
                   failed=res["broken"].get(s.label))
        if s.policy == "isolated":
            same = np.asarray(per["ttft_same_sys"]) * 1e3
            row.update(ttft_ms_new_sys=row["ttft_ms"], ttft_ms_same_sys_all_hit=H.percentile(same, 50),
                       ttft_p90_ms_same_sys_all_hit=H.percentile(same, 90),
                       ttft_note="ttft_ms = ttft_ms_new_sys: documents cached under another sys prompt, the timed "
                                 "request's sys never seen, so every isolated chunk misses (sys + chunks + question "
                                 "computed); ttft_ms_same_sys_all_hit: the sys of the warm-up request, documents "
                                 "reordered, every chunk a pool hit (question computed only)")
        row["ttft_over_full_prefill"] = H.ratio(row["ttft_ms"], full_prefill_ms)
        counters = {phase: summed(ds) for phase, ds in per["stats"].items() if ds}
        timed = per["stats"]["timed"]
        if timed:
            counters["timed_mean_per_request"] = {k: v / len(timed) for k, v in summed(timed).items()}
        row["counters"] = counters
        row["counters_note"] = ("deltas of llm.stats() summed per phase: warm (one per prompt), quality (KL + "
                                "forced + answer requests; vLLM's prefix cache serves most of the 2nd and 3rd), "
                                "timed (all rounds, new sys)" + (", timed_same_sys" if s.policy == "isolated" else ""))
        row["per_prompt"] = dict(kl=per["kl"], top1_agreement=[float(np.mean(a)) for a in per["top1"]],
                                 top1_steps=per["top1"], exact_match=per["em"], answers=per["answers"],
                                 ttft_ms=[float(x) for x in ttft], num_cached_tokens_timed=per["cached_timed"])
        if s.policy == "isolated":
            row["per_prompt"]["ttft_ms_same_sys_all_hit"] = [1e3 * x for x in per["ttft_same_sys"]]
        out.append(row)
    return out


def plot(result_rows: list[dict], path: Path, title: str) -> None:
    plt = H.pyplot()
    floor = 1e-7
    fig, (ax_kl, ax_top) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for row in result_rows:
        if row["kl"] is None or row["ttft_ms"] is None:
            continue
        x = row["ttft_ms"]
        marker = {"vanilla": "*", "isolated": "s", "none": "X", "cacheblend": "o", "legolink": "^"}[row["policy"]]
        for ax, y in ((ax_kl, max(row["kl"], floor)), (ax_top, row["top1_agreement"])):
            ax.plot([x], [y], marker, markersize=9)
            ax.annotate(row["label"] + (" (new sys)" if row["policy"] == "isolated" else ""), (x, y),
                        textcoords="offset points", xytext=(5, 4), fontsize=7)
        if row["policy"] == "isolated" and row["ttft_ms_same_sys_all_hit"] is not None:
            x2 = row["ttft_ms_same_sys_all_hit"]
            for ax, y in ((ax_kl, max(row["kl"], floor)), (ax_top, row["top1_agreement"])):
                ax.plot([x2], [y], "s", mfc="none", markersize=9, color="gray")
                ax.annotate("isolated (same sys, all hit)", (x2, y), textcoords="offset points",
                            xytext=(5, -10), fontsize=7)
    ax_kl.set_yscale("log")
    ax_top.set_xscale("log")
    ax_kl.set_ylabel(f"KL(vanilla || setting), first token, nats (floor {floor:g})")
    ax_top.set_ylabel("top-1 agreement, teacher-forced continuation")
    ax_top.set_xlabel("TTFT p50, ms (documents cached, unseen sys prompt)")
    lowest = min(r["top1_agreement"] for r in result_rows if r["top1_agreement"] is not None)
    ax_top.set_ylim(max(0.0, lowest - 0.05), 1.01)
    for ax in (ax_kl, ax_top):
        ax.grid(True, which="both", alpha=0.3)
    ax_kl.set_title(title, fontsize=8)
    H.save_figure(fig, path)



def print_table(result_rows: list[dict]) -> None:
    print(f"\n{'setting':>20} {'KL mean':>10} {'top-1':>7} {'EM':>6} {'TTFT p50 ms':>12}  per timed request: "
          "tokens_computed [+ blend_tokens_recomputed]")
    for row in result_rows:
        if row["kl"] is None or row["ttft_ms"] is None:
            print(f"{row['label']:>20}  no result: {row['failed']}")
            continue
        mean = row["counters"].get("timed_mean_per_request", {})
        work = "" if "tokens_computed" not in mean else f"{mean['tokens_computed']:.0f}"
        if work and row["policy"] not in ("vanilla", "isolated") and "blend_tokens_recomputed" in mean:
            work += f" + {mean['blend_tokens_recomputed']:.0f}"
        print(f"{row['label']:>20} {row['kl']:>10.3g} {row['top1_agreement']:>7.3f} {row['exact_match']:>6.2f} "
              f"{row['ttft_ms']:>12.1f}  {work}" + ("  (FAILED later)" if row["failed"] else ""))
        if row["policy"] == "isolated" and row["ttft_ms_same_sys_all_hit"] is not None:
            print(f"{'isolated same sys':>20} {'':>10} {'':>7} {'':>6} {row['ttft_ms_same_sys_all_hit']:>12.1f}  "
                  "(all hit)")
