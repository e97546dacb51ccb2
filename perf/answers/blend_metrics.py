"""``bench_blend.py``'s quality metrics and summary.

Contract:

* per request: ``step_logprobs`` (a whole-vocabulary logprobs response as [steps, vocab]),
  ``kl_steps`` (KL(vanilla || setting) per step); where an answer starts and whether it is right
  are the task's (``rag_tasks.Task.answer_step``, ``Task.correct``);
* per setting: ``rows(args, res)`` turns ``blend_runner.run``'s per-prompt records into the result
  file's rows: every metric of ``METRICS`` as the mean over prompts with its 95 % bootstrap
  interval (``<metric>_ci``), per task kind too (``by_task``), and the timings;
* ``print_table`` and ``plot`` (quality with its intervals against all-hit TTFT).

``DEFINITIONS`` is what the result file says each number means.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from perf.common import harness as H
from perf.answers.blend_task import TASK_KINDS

FULL_KL_TOL = 1e-4
"""cacheblend r=1 (and vanilla against itself) must match vanilla: mean KL over the continuation at
most this (vanilla vs itself: ~1e-7)."""
BOOTSTRAP = dict(resamples=2000, seed=0, level=0.95)
METRICS = ("kl", "kl_first", "kl_first_token", "top1_agreement", "exact_match", "exact_match_delta")
DEFINITIONS = {
    "kl": "vanilla's reference request (greedy, continuation tokens, ignore_eos, logprobs=-1: the whole "
          "vocabulary at every step) gives its distribution at every step of its own continuation; the setting "
          "is fed that continuation in one request (ForceTokens logits processor) with logprobs=-1; kl = "
          "KL(vanilla || setting) in nats per step (vLLM raw logprobs), averaged over the continuation's steps, "
          "then over prompts (kl_median, kl_max: over prompts). vanilla's own row compares two identical "
          "vanilla requests: the harness noise floor",
    "kl_first": "KL at the first answer-bearing step: the first continuation position whose token's decoded text "
                "contains a digit (where vanilla's code starts; which_doc: after which the text names the first "
                "three letters of a title); position 0 where none does "
                "(answer_position_fallbacks counts those prompts)",
    "kl_first_token": "KL at step 0 of the continuation (the first generated token)",
    "top1_agreement": "share of continuation steps where the setting's argmax over its full distribution equals "
                      "vanilla's token; per prompt, then the mean over prompts",
    "exact_match": "1 if the expected 4-digit code occurs in the setting's free greedy answer (detokenized text "
                   "of at most answer_tokens tokens, generation stopped at EOS) as a whole number, i.e. "
                   "re.search(r'(?<!\\d)CODE(?!\\d)', text); which_doc: the first of the prompt's document "
                   "titles the answer names (as a word) is the gold document's; the mean over prompts",
    "exact_match_delta": "per prompt exact_match(setting) - exact_match(vanilla), paired; the mean over prompts",
    "vs_baseline": "with --baseline: per prompt, this setting's kl (and exact_match) minus the baseline setting's on "
                   "the same prompt (paired); kl_delta and exact_match_delta are the means over prompts, each with its "
                   "95 % bootstrap interval (kl_delta_ci: an interval wholly above 0 means the setting is further "
                   "from full prefill than the baseline on these prompts)",
    "*_ci": "95 % percentile bootstrap interval of the mean: prompts resampled with replacement (2000 resamples, "
            "seed 0, the same resampled prompt sets for every metric of a row); widened to contain the point "
            "estimate where rounding puts it outside",
    "by_task": "the same metrics and intervals over the prompts of one task family of the run (rag_tasks.py): "
               "fact (one planted fact in the question's words, distractors for other colors/places), paraphrase "
               "(the code in other words than the question's), two_hop (the building of a color/place in one "
               "document, that building's code in another), which_doc (the title of the document that mentions "
               "the color/place)",
    "same_answer_as_vanilla": "share of prompts whose free answer text equals vanilla's",
    "ttft_ms": "p50 over prompts x repeats of the wall time of generate([one prompt], max_tokens=1, greedy); "
               "documents cached (a warm-up request per prompt and setting with another sys prompt and "
               "another document order), the timed request has the documents reordered behind a sys prompt "
               "never seen before (vLLM's prefix cache serves nothing: num_cached_tokens checked == 0). "
               "vanilla: a full prefill. isolated: every chunk misses (isolated KV depends on sys)",
    "ttft_ms_all_hit": "blend and vanilla: ttft_ms; isolated: ttft_ms_same_sys_all_hit (the warm-up's sys prompt, "
                       "documents reordered, every chunk a pool hit)",
    "ttft_over_full_prefill": "ttft_ms over vanilla's ttft_ms, both p50s of this run (CacheBlend's includes "
                              "its check pass); ttft_all_hit_over_full_prefill likewise for ttft_ms_all_hit",
    "param": "isolated: key temperature (plain isolated: the deployment's default, 1); cacheblend, question: "
             "recompute ratio; legolink: tokens recomputed at the start of every chunk; else 0",
}
"""The result file's ``definitions``: what each row's numbers mean."""


# --- per request ----------------------------------------------------------------------------------

def step_logprobs(out, vocab: int) -> np.ndarray:
    """Every generated position's logprobs over the whole vocabulary (flat_logprobs), [steps, vocab]."""
    lp = out.outputs[0].logprobs
    ids = np.asarray(lp.token_ids, dtype=np.int64)
    vals = np.asarray(lp.logprobs, dtype=np.float64)
    arr = np.full((len(lp.start_indices), vocab), -np.inf)
    for j, (s, e) in enumerate(zip(lp.start_indices, lp.end_indices)):
        arr[j, ids[s:e]] = vals[s:e]
    return arr


def kl_steps(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(ref || other) in nats per row of two [steps, vocab] logprob arrays (inf where other
    lacks a token ref has)."""
    p = np.exp(ref)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (ref - other), 0.0)
    kl = terms.sum(axis=1)
    return np.where(np.isfinite(kl), kl, np.inf)


# --- statistics -----------------------------------------------------------------------------------

def bootstrap(columns: dict[str, np.ndarray], resamples: int, seed: int, level: float) -> dict:
    """{name: mean, name_ci: [lo, hi]} for equal-length columns, from one set of resampled prompts."""
    n = len(next(iter(columns.values()), []))
    if n == 0:
        return {key: None for name in columns for key in (name, name + "_ci")}
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    tail = 100 * (1 - level) / 2
    out = {}
    for name, values in columns.items():
        mean = float(np.mean(values))
        lo, hi = np.percentile(values[idx].mean(axis=1), [tail, 100 - tail])
        out[name], out[name + "_ci"] = mean, [min(float(lo), mean), max(float(hi), mean)]
    return out


def summary(quality: list[dict], vanilla_em: dict[int, int]) -> dict:
    """Every metric of ``METRICS`` over ``quality`` (one record per prompt) with its interval."""
    cols = {m: np.asarray([q[m] for q in quality], dtype=float) for m in METRICS if m != "exact_match_delta"}
    cols["exact_match_delta"] = np.asarray([q["exact_match"] - vanilla_em[q["prompt"]] for q in quality], dtype=float)
    return {"n_prompts": len(quality), **bootstrap(cols, **BOOTSTRAP)}


# --- rows -----------------------------------------------------------------------------------------

def summed(deltas: list[dict]) -> dict:
    keys = sorted({k for d in deltas for k in d})
    return {k: int(sum(d.get(k, 0) for d in deltas)) for k in keys}


def timing(s, per: dict, full_prefill_ms: float | None) -> dict:
    ttft = np.asarray(per["ttft"]) * 1e3
    row = dict(ttft_ms=H.percentile(ttft, 50), ttft_p90_ms=H.percentile(ttft, 90), n_timed=int(ttft.size))
    row["ttft_ms_all_hit"] = row["ttft_ms"]
    if s.policy == "isolated":
        same = np.asarray(per["ttft_same_sys"]) * 1e3
        row.update(ttft_ms_new_sys=row["ttft_ms"], ttft_ms_same_sys_all_hit=H.percentile(same, 50),
                   ttft_p90_ms_same_sys_all_hit=H.percentile(same, 90),
                   ttft_ms_all_hit=H.percentile(same, 50),
                   ttft_note="ttft_ms = ttft_ms_new_sys: documents cached under another sys prompt, the timed "
                             "request's sys never seen, so every isolated chunk misses (sys + chunks + question "
                             "computed); ttft_ms_all_hit = ttft_ms_same_sys_all_hit: the sys of the warm-up "
                             "request, documents reordered, every chunk a pool hit (question computed only)")
    row["ttft_over_full_prefill"] = H.ratio(row["ttft_ms"], full_prefill_ms)
    row["ttft_all_hit_over_full_prefill"] = H.ratio(row["ttft_ms_all_hit"], full_prefill_ms)
    return row


def counters(s, per: dict) -> dict:
    out = {phase: summed(ds) for phase, ds in per["stats"].items() if ds}
    timed = per["stats"]["timed"]
    if timed:
        out["timed_mean_per_request"] = {k: v / len(timed) for k, v in summed(timed).items()}
    return out


def row_of(s, per: dict, vanilla_em: dict, full_prefill_ms, failed) -> dict:
    quality = per["quality"]
    kl = [q["kl"] for q in quality]
    row = dict(policy=s.policy, param=s.param, label=s.label, extra_args=s.extra, **summary(quality, vanilla_em),
               kl_median=H.percentile(kl, 50), kl_max=float(np.max(kl)) if kl else None,
               same_answer_as_vanilla=float(np.mean([q["same_answer"] for q in quality])) if quality else None,
               first_token_agreement=float(np.mean([q["top1_steps"][0] for q in quality])) if quality else None,
               n_continuation_steps=sum(len(q["top1_steps"]) for q in quality),
               **timing(s, per, full_prefill_ms), failed=failed)
    kinds = [kind for kind in TASK_KINDS if any(q["kind"] == kind for q in quality)]
    row["by_task"] = {kind: summary([q for q in quality if q["kind"] == kind], vanilla_em) for kind in kinds}
    row["counters"] = counters(s, per)
    row["counters_note"] = ("deltas of llm.stats() summed per phase: warm (isolated: one per prompt; blend: the "
                            "one blend warm-up per prompt, counted under the setting that sent it), timed (new sys)"
                            + (", timed_same_sys" if s.policy == "isolated" else "")
                            + "; the forced and answer requests run in batches: the result's quality_batches")
    row["per_prompt"] = {k: [q[k] for q in quality] for k in ("prompt", "kind", *METRICS[:-1], "answer",
                                                               "kl_steps", "top1_steps")}
    row["per_prompt"].update(ttft_ms=[1e3 * x for x in per["ttft"]], num_cached_tokens_timed=per["cached_timed"])
    if s.policy == "isolated":
        row["per_prompt"]["ttft_ms_same_sys_all_hit"] = [1e3 * x for x in per["ttft_same_sys"]]
    return row


def rows(args, res) -> list[dict]:
    vanilla = res["per"][args.settings[0].label]
    vanilla_em = {q["prompt"]: q["exact_match"] for q in vanilla["quality"]}
    full_prefill_ms = H.percentile(np.asarray(vanilla["ttft"]) * 1e3, 50)
    out = [row_of(s, res["per"][s.label], vanilla_em, full_prefill_ms, res["broken"].get(s.label))
           for s in args.settings]
    if args.baseline:
        paired(out, args.baseline)
    return out


def paired(result_rows: list[dict], baseline: str) -> None:
    """Adds ``vs_baseline`` to every other row: its kl and exact_match minus the ``baseline`` row's,
    prompt by prompt (the prompts both answered), as means with bootstrap intervals."""
    base = next(r for r in result_rows if r["label"] == baseline)
    for row in result_rows:
        if row is not base and row["n_prompts"]:
            row["vs_baseline"] = {"baseline": baseline, **paired_deltas(base, row)}


def paired_deltas(base: dict, row: dict) -> dict:
    """``row``'s kl and exact_match minus ``base``'s, prompt by prompt over the prompts both
    answered: n_prompts and the means with bootstrap intervals."""
    base_of = {p: i for i, p in enumerate(base["per_prompt"]["prompt"])}
    mine = row["per_prompt"]
    both = [(i, base_of[p]) for i, p in enumerate(mine["prompt"]) if p in base_of]
    cols = {f"{m}_delta": np.asarray([mine[m][i] - base["per_prompt"][m][j] for i, j in both], dtype=float)
            for m in ("kl", "exact_match")}
    return {"n_prompts": len(both), **bootstrap(cols, **BOOTSTRAP)}


# --- table and plot -------------------------------------------------------------------------------

def _ci(row: dict, name: str, fmt: str) -> str:
    lo, hi = row[name + "_ci"]
    return f"{row[name]:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def print_table(result_rows: list[dict]) -> None:
    print(f"\n{'setting':>18} {'KL continuation [95% CI]':>29} {'KL first answer token':>29} "
          f"{'top-1':>19} {'exact match':>18} {'all-hit TTFT ms':>16} {'x full':>7}")
    for row in result_rows:
        if not row["n_prompts"] or row["ttft_ms_all_hit"] is None:
            print(f"{row['label']:>18}  no result: {row['failed']}")
            continue
        pair = row.get("vs_baseline")
        print(f"{row['label']:>18} {_ci(row, 'kl', '8.3g'):>29} {_ci(row, 'kl_first', '8.3g'):>29} "
              f"{_ci(row, 'top1_agreement', '.3f'):>19} {_ci(row, 'exact_match', '.2f'):>18} "
              f"{row['ttft_ms_all_hit']:>16.1f} {row['ttft_all_hit_over_full_prefill'] or 0:>7.2f}"
              + (f"   vs {pair['baseline']}: KL {_ci(pair, 'kl_delta', '+.3g')}, "
                 f"exact match {_ci(pair, 'exact_match_delta', '+.2f')}" if pair else "")
              + ("  (FAILED later)" if row["failed"] else ""))


MARKERS = {"vanilla": "*", "isolated": "s", "none": "X", "cacheblend": "o", "question": "D", "legolink": "^"}


def plot(result_rows: list[dict], path: Path, title: str) -> None:
    """Three panels against all-hit TTFT (log x): KL over the continuation (log y), top-1 agreement,
    exact match; 95 % intervals as error bars; marker and colour by policy."""
    plt = H.pyplot()
    floor = 1e-8
    fig, axes = plt.subplots(3, 1, figsize=(9, 11), sharex=True)
    panels = (("kl", "KL(vanilla || setting), mean over continuation, nats", True),
              ("top1_agreement", "top-1 agreement, teacher-forced continuation", False),
              ("exact_match", "exact match", False))
    colors = {p: f"C{i}" for i, p in enumerate(MARKERS)}
    shown = set()
    for row in result_rows:
        if not row["n_prompts"] or row["ttft_ms_all_hit"] is None:
            continue
        x, policy = row["ttft_ms_all_hit"], row["policy"]
        for ax, (name, _, log) in zip(axes, panels):
            y = max(row[name], floor) if log else row[name]
            lo, hi = (max(v, floor) for v in row[name + "_ci"]) if log else row[name + "_ci"]
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt=MARKERS[policy], color=colors[policy], markersize=8,
                        capsize=3, label=policy if (ax is axes[0] and policy not in shown) else None)
            ax.annotate(row["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=6)
        shown.add(policy)
    for ax, (_, label, log) in zip(axes, panels):
        ax.set_ylabel(label + (f" (floor {floor:g})" if log else ""), fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_yscale("log") if log else ax.set_ylim(-0.03, 1.03)
    axes[-1].set_xscale("log")
    axes[-1].set_xlabel("TTFT p50, ms, all documents cached (isolated: same sys, all hit; vanilla: full prefill)")
    axes[0].legend(fontsize=7, loc="best")
    axes[0].set_title(title + "; bars: 95 % bootstrap intervals over prompts", fontsize=8)
    H.save_figure(fig, path)
