"""Answer quality of every way to reuse documents, against full prefill, on the HF oracle, in one run.

    python -m perf.answers.bench_oracle_quality [--doc-tokens 150,400 --prompts 48 --docs 5-8 --families all
                                         --settings all --out perf/results/oracle_quality.json
                                         --plot perf/results/oracle_quality.png]   # ~1 h on 2 cores
    python -m perf.answers.bench_oracle_quality --quick                                    # CI, ~1 min

Why a second quality benchmark beside ``bench_blend.py``: it measures what the semantics cost, not
what graphchunk's serving path computes (``tests/`` check that those agree), and so it can measure
settings graphchunk does not serve yet (APE's correction of isolated mode) on the same tasks
before the vLLM side is built, and many settings per prompt cheaply (the isolated context is
computed once per prompt and every isolated setting's question runs over it). No timings: HF's
eager forward is not what users run (``bench_blend.py`` has the all-hit TTFT of every setting
graphchunk serves).

Tasks: ``rag_tasks.py`` (fact, paraphrase, two_hop, which_doc in turn; chat documents placed as the
OpenAI server places them), --prompts per document length, the same seed for every length.

Settings (``--settings``, comma list, default ``all`` = ``DEFAULT_SETTINGS``), on SmolLM2-135M fp32:

* ``full``: HF's plain causal forward (what vanilla vLLM computes), the reference: its greedy
  continuation of --answer-tokens (EOS does not stop it) and its distribution at every step;
* ``isolated``: the isolated mask and positions (DESIGN.md §2), context computed in the
  incremental form (each chunk as ``sys ‖ chunk``), question over it;
* ``ape:T:S`` / ``ape-prefix:T:S``: isolated with APE's merge (``graphchunk.reference.ape``), the
  documents tempered / the prefix and question tempered (APE's released code);
* ``none``, ``legolink:K``, ``question:R``, ``recompute:1``: blend mode (every chunk's KV computed
  alone where it lands, sys causal) with no token, the first K of every chunk, the top R of chunk
  tokens by the question's attention over the naively reused context (``Oracle.question_attention``;
  the ``question`` policy's ranking) or every chunk token recomputed (must equal ``full``);
  ``blocks:R:B``: as many chunk tokens as ``question:R``, picked in blocks of B consecutive tokens
  (each chunk cut into blocks from its first token): the blocks whose question attention sums
  highest, the last one taken cut to its first tokens (issue 62: fewer, longer recomputed runs,
  each one pseudo-sequence in the served path, against ``question:R``'s scattered tokens);
  a blend setting ending in ``/prefix`` computes every chunk after the fixed ``--blend-prefix``
  text instead of alone (``Oracle.prefixed_kv``: DESIGN.md §2's "fixed model-level prefix", the
  same tokens before every chunk; not served by graphchunk yet).

Per prompt and setting: ``exact_match`` (``Task.correct`` of the free greedy answer, stopped at EOS),
``kl`` (mean over the reference continuation's steps of KL(full || setting), teacher-forced),
``kl_first`` (at the first answer-bearing step, ``Task.answer_step``). Per setting, length and family:
means with 95 % bootstrap intervals (``blend_metrics.bootstrap``: prompts resampled, 2000, seed 0)
and the paired exact-match differences to full prefill (``exact_match_delta``) and to plain isolated
mode (``exact_match_delta_isolated``: what a correction of isolated mode buys); with ``--baseline
LABEL``, each row's KL and exact match minus that setting's, prompt by prompt (``vs_baseline``,
``blend_metrics.paired_deltas``). Checks (exit 1): ``recompute:1``'s and ``full``'s KL at most
``FULL_KL_TOL``.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

from perf.common import harness as H
from perf.answers.blend_metrics import BOOTSTRAP, FULL_KL_TOL, bootstrap, kl_steps, paired_deltas
from perf.answers.blend_task import SYS_TEXT
from perf.answers.rag_tasks import build_tasks, encode, parse_docs, parse_families

REPO = H.REPO
DEFAULT_SETTINGS = ("full,isolated,ape:0.9:0.9,ape:0.8:0.8,ape:1:0.7,ape-prefix:0.9:0.9,ape-prefix:0.8:0.8,"
                    "ape-prefix:1:0.7,none,legolink:15")
"""APE at its defaults (0.9, 0.9) and around them, on both sides (the isolated settings run as one
batch over a context computed once), beside blend mode's naive reuse and its default policy
(LegoLink 15). ``recompute:1`` (the exactness anchor) and ``question:R`` run in ``--quick`` and
where asked; a run of the defaults takes ~1 h on 2 cores (decode steps of a 135M model in fp32
read its 0.5 GB of weights: ~0.1 s each)."""
QUICK = dict(prompts=4, docs="3", doc_tokens="80", distractors=1, answer_tokens=16,
             settings="full,isolated,ape:0.9:0.9,ape-prefix:0.9:0.9,none,legolink:4,question:0.15,question:0.15/prefix,recompute:1,"
                      "recompute:1/prefix", baseline="question:0.15")


BLEND_PREFIX = "Here is a document.\n\n"
"""``--blend-prefix``'s default: the text a ``/prefix`` setting computes before every chunk."""


def parse_setting(item: str) -> dict:
    base, slash, flag = item.partition("/")
    blend = ("none", "legolink", "question", "blocks", "recompute")
    if slash and (flag != "prefix" or base.split(":")[0] not in blend):
        raise SystemExit(f"setting {item!r}: only blend settings (none, legolink, question, blocks, recompute) "
                         f"take /prefix")
    name, *params = base.split(":")
    try:
        values = [float(p) for p in params]
    except ValueError:
        raise SystemExit(f"setting {item!r}: parameters are numbers")
    shapes = {"full": 0, "isolated": 0, "none": 0, "ape": 2, "ape-prefix": 2, "legolink": 1, "question": 1,
              "blocks": 2, "recompute": 1}
    if shapes.get(name) != len(values):
        raise SystemExit(f"setting {item!r}: known full, isolated, ape:T:S, ape-prefix:T:S, none, legolink:K, "
                         "question:R, blocks:R:B, recompute:1")
    if name.startswith("ape"):
        from graphchunk.reference.ape import Ape

        return dict(label=item, kind="ape", ape=Ape(values[0], values[1], "prefix" if name == "ape-prefix" else "documents"))
    return dict(label=item, kind=name, param=values[0] if values else None, prefix=bool(slash),
                block=int(values[1]) if name == "blocks" else None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48, help="prompts per document length, the families in turn")
    p.add_argument("--doc-tokens", default="150,400", help="document lengths (comma list), each its own prompts")
    p.add_argument("--docs", default="5-8", help="documents per prompt: N, or A-B drawn per prompt")
    p.add_argument("--families", default="all")
    p.add_argument("--distractors", type=int, default=3, help="distractor facts per prompt (at most docs - gold)")
    p.add_argument("--answer-tokens", type=int, default=20, help="free greedy tokens, and the reference continuation")
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS.split(",")))
    p.add_argument("--blend-prefix", default=BLEND_PREFIX, help="text before every chunk of a /prefix setting")
    p.add_argument("--baseline", default=None, help="a setting's label: every row paired with it prompt by prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--out", type=Path, default=REPO / "perf/results/oracle_quality.json")
    p.add_argument("--plot", type=Path, default=REPO / "perf/results/oracle_quality.png")
    args = H.parse_with_quick(p, argv, QUICK)
    args.families = parse_families(args.families)
    parse_docs(args.docs)
    args.lengths = [int(x) for x in str(args.doc_tokens).split(",")]
    args.setting_list = [parse_setting(s.strip()) for s in args.settings.split(",") if s.strip()]
    if args.setting_list[0]["kind"] != "full":
        raise SystemExit("--settings must start with full (the reference)")
    if args.baseline is not None and args.baseline not in [s["label"] for s in args.setting_list]:
        raise SystemExit(f"--baseline {args.baseline!r} is not one of the settings")
    return args


def recomputed_tokens(oracle, ids, layout, setting, context_kv=None) -> list[int]:
    """The chunk tokens a blend setting recomputes."""
    chunk_tokens = np.arange(layout.sys_len, layout.context_len)
    if setting["kind"] == "none":
        return []
    if setting["kind"] == "recompute":
        return chunk_tokens.tolist()
    if setting["kind"] == "legolink":
        k = int(setting["param"])
        return [t for start, n in zip(layout.chunk_starts(), layout.chunk_lens) for t in range(start, start + min(k, n))]
    scores = oracle.question_attention(ids, layout, context_kv=context_kv)[layout.sys_len:]
    n = int(round(setting["param"] * chunk_tokens.size))
    if setting["kind"] == "blocks":
        return block_tokens(layout, scores, n, setting["block"])
    return sorted((chunk_tokens[np.argsort(-scores, kind="stable")[:n]]).tolist())


def block_tokens(layout, scores: np.ndarray, n: int, block: int) -> list[int]:
    """``n`` chunk tokens in blocks of ``block`` (each chunk cut from its first token): blocks by
    their summed ``scores`` (one per chunk token, from the first; ties: the earlier block), whole
    until the last one taken, which keeps its first tokens."""
    blocks = [(start + a, min(start + a + block, start + length))
              for start, length in zip(layout.chunk_starts(), layout.chunk_lens) for a in range(0, length, block)]
    sums = np.asarray([scores[a - layout.sys_len:b - layout.sys_len].sum() for a, b in blocks])
    picked: list[int] = []
    for i in np.argsort(-sums, kind="stable"):
        a, b = blocks[i]
        picked += range(a, min(b, a + n - len(picked)))
        if len(picked) >= n:
            break
    return sorted(picked)


def runs_of(tokens: list[int]) -> int:
    """Maximal runs of consecutive indices: the pseudo-sequences a recompute of ``tokens`` forwards."""
    return int(len(tokens) and 1 + np.count_nonzero(np.diff(tokens) != 1))


def answer_text(tokenizer, oracle, tokens: list[int]) -> str:
    cut = next((j + 1 for j, t in enumerate(tokens) if t in oracle.eos_token_ids), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)


def one_prompt(oracle, tokenizer, task, settings, answer_tokens, prefix_ids: list[int]) -> dict:
    """{label: record} of every setting on one task."""
    import torch

    from graphchunk.layout import Layout

    ids, bounds = encode(tokenizer, SYS_TEXT, task)
    layout = Layout(bounds[0], tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])), len(ids) - bounds[-1])
    ref_tokens, ref_lp = oracle.causal_generate(ids, answer_tokens)
    ref = torch.stack(ref_lp).double().numpy()
    at, fallback = task.answer_step(tokenizer, ref_tokens)
    isolated = [s for s in settings if s["kind"] in ("isolated", "ape")]
    results = {"full": (ref_tokens, ref)}
    if isolated:  # one batch row per setting over the context computed once
        cache = oracle.isolated_cache(ids, layout)
        apes = [s.get("ape") for s in isolated]
        answers = oracle.question_generate(cache, ids, layout, answer_tokens, apes=apes)
        forced = oracle.question_logprobs(cache, ids, layout, ref_tokens, apes=apes).double().numpy()
        results.update({s["label"]: (answers[i], forced[i]) for i, s in enumerate(isolated)})
    prefixed = oracle.prefixed_kv(ids, layout, prefix_ids) if any(s.get("prefix") for s in settings) else None
    for s in settings:
        if s["kind"] not in ("full", "isolated", "ape"):
            context = prefixed if s["prefix"] else None
            fresh = recomputed_tokens(oracle, ids, layout, s, context)
            results[s["label"]] = (
                oracle.blend_generate(ids, layout, fresh, answer_tokens, stop_at_eos=True, context_kv=context)[0],
                oracle.blend_logprobs(ids, layout, fresh, ref_tokens, context_kv=context).double().numpy(),
                len(fresh), runs_of(fresh))
    out = {}
    for s in settings:
        tokens, lp, *recomputed = results["full" if s["kind"] == "full" else s["label"]]
        kl = kl_steps(ref, lp)
        text = answer_text(tokenizer, oracle, tokens)
        out[s["label"]] = dict(prompt=task.index, kind=task.kind, exact_match=int(task.correct(text)),
                               kl=float(kl.mean()), kl_first=float(kl[at]), answer=text,
                               recomputed=recomputed[0] if recomputed else 0, runs=recomputed[1] if recomputed else 0)
    out["_prompt"] = dict(prompt=task.index, kind=task.kind, tokens=len(ids), boundaries=list(bounds),
                          answer_position=at, answer_position_fallback=fallback)
    return out


def summarize(records: list[dict], refs: dict[str, list[dict]]) -> dict:
    """Means with 95 % intervals over ``records`` (one per prompt): exact match, KL, KL at the first
    answer token, and the paired exact-match difference to each reference (``refs``: {suffix:
    records}; ``exact_match_delta``: to full prefill, ``exact_match_delta_isolated``: to isolated)."""
    cols = {m: np.asarray([r[m] for r in records], dtype=float) for m in ("exact_match", "kl", "kl_first")}
    for suffix, ref in refs.items():
        em = {r["prompt"]: r["exact_match"] for r in ref}
        cols["exact_match_delta" + suffix] = np.asarray([r["exact_match"] - em[r["prompt"]] for r in records], dtype=float)
    return {"n_prompts": len(records), **bootstrap(cols, **BOOTSTRAP)}


def rows_of(per: dict, settings, families, baseline: str | None = None) -> list[dict]:
    refs = {"": per[settings[0]["label"]]}
    if "isolated" in per:
        refs["_isolated"] = per["isolated"]
    rows = []
    for s in settings:
        records = per[s["label"]]
        row = {"label": s["label"], **summarize(records, refs)}
        row["by_family"] = {f: summarize([r for r in records if r["kind"] == f],
                                         {k: [r for r in v if r["kind"] == f] for k, v in refs.items()})
                            for f in families if any(r["kind"] == f for r in records)}
        row["per_prompt"] = {k: [r[k] for r in records] for k in ("prompt", "kind", "exact_match", "kl", "kl_first",
                                                                  "answer", "recomputed", "runs")}
        # chunk tokens recomputed, and their runs of consecutive tokens (pseudo-sequences), per prompt
        row["recomputed_mean"] = float(np.mean(row["per_prompt"]["recomputed"]))
        row["runs_mean"] = float(np.mean(row["per_prompt"]["runs"]))
        rows.append(row)
    if baseline is not None:
        base = next(row for row in rows if row["label"] == baseline)
        for row in rows:
            row["vs_baseline"] = {"label": baseline, **paired_deltas(base, row)}
    return rows


def plot(result: dict, path: Path) -> None:
    """Exact match minus full prefill's, with 95 % intervals, per setting (rows) and length (colour)."""
    plt = H.pyplot()
    lengths = result["lengths"]
    labels = [row["label"] for row in lengths[0]["rows"]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.5))
    for i, run in enumerate(lengths):
        for j, row in enumerate(run["rows"]):
            y = j + 0.25 * (i - (len(lengths) - 1) / 2)
            lo, hi = row["exact_match_delta_ci"]
            ax.errorbar([row["exact_match_delta"]], [y], xerr=[[row["exact_match_delta"] - lo], [hi - row["exact_match_delta"]]],
                        fmt="o", color=f"C{i}", capsize=3, label=f"~{run['doc_tokens']} tok docs" if j == 0 else None)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("exact match - full prefill's (paired), 95 % bootstrap interval")
    ax.legend(fontsize=7)
    ax.set_title(result["plot_title"], fontsize=8)
    ax.grid(True, alpha=0.3)
    H.save_figure(fig, path)


def print_table(result: dict) -> None:
    for run in result["lengths"]:
        print(f"\n~{run['doc_tokens']}-token documents, {run['rows'][0]['n_prompts']} prompts "
              f"(full prefill exact match {run['rows'][0]['exact_match']:.2f})")
        families = list(run["rows"][0]["by_family"])
        print(f"{'setting':>22} {'EM':>5} {'EM - full [95% CI]':>24} {'KL':>7} {'runs':>6} "
              + " ".join(f"{f:>10}" for f in families))
        for row in run["rows"]:
            lo, hi = row["exact_match_delta_ci"]
            fam = " ".join(f"{row['by_family'][f]['exact_match_delta']:>+10.2f}" for f in families)
            print(f"{row['label']:>22} {row['exact_match']:>5.2f} {row['exact_match_delta']:>+8.2f} [{lo:+.2f}, {hi:+.2f}] "
                  f"{row['kl']:>7.3f} {row.get('runs_mean', 0):>6.1f} {fam}")
        for row in run["rows"]:
            pair = row.get("vs_baseline")
            if pair and row["label"] != pair["label"]:
                print(f"{row['label']:>22} - {pair['label']}: KL {pair['kl_delta']:+.4f} "
                      f"[{pair['kl_delta_ci'][0]:+.4f}, {pair['kl_delta_ci'][1]:+.4f}], exact match "
                      f"{pair['exact_match_delta']:+.2f} [{pair['exact_match_delta_ci'][0]:+.2f}, "
                      f"{pair['exact_match_delta_ci'][1]:+.2f}]")


def main(argv=None) -> int:
    args = parse_args(argv)
    H.script_env()
    from graphchunk.reference.oracle import Oracle

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    clock = H.RunClock()
    model_path = H.resolve_model(args.model)
    tokenizer = H.load_tokenizer(model_path)
    oracle = Oracle(model_path)
    prefix_ids = tokenizer(args.blend_prefix, add_special_tokens=False)["input_ids"]
    failures, lengths = [], []
    for doc_tokens in args.lengths:
        args.doc_tokens = doc_tokens
        tasks = build_tasks(tokenizer, args, random.Random(args.seed))
        per = {s["label"]: [] for s in args.setting_list}
        prompts = []
        for task in tasks:
            t0 = time.perf_counter()
            got = one_prompt(oracle, tokenizer, task, args.setting_list, args.answer_tokens, prefix_ids)
            prompts.append(got.pop("_prompt"))
            for label, record in got.items():
                per[label].append(record)
            log(f"[oracle_quality] ~{doc_tokens} tok, prompt {task.index + 1}/{len(tasks)} {task.kind} "
                f"({prompts[-1]['tokens']} tokens) {time.perf_counter() - t0:.1f} s: "
                + " ".join(f"{k}={v['exact_match']}" for k, v in got.items()))
        rows = rows_of(per, args.setting_list, args.families, args.baseline)
        for row in rows:
            if row["label"] in ("full", "recompute:1") and row["kl"] > FULL_KL_TOL:
                failures.append(f"~{doc_tokens} tok: {row['label']} differs from full prefill: KL {row['kl']:.3g}")
        lengths.append(dict(doc_tokens=doc_tokens, rows=rows, prompts=prompts, tasks=[t.record() for t in tasks]))
    clock.mark("end")
    result = dict(device=H.device_name(), model=str(model_path), dtype="float32", lengths=lengths,
                  settings=[s["label"] for s in args.setting_list], checks_passed=not failures, failures=failures,
                  config={**H.config_dict(args, skip=("setting_list", "lengths")), "doc_tokens": args.lengths,
                          "sys_prompt": SYS_TEXT},
                  command=H.command_line(__file__, argv), environment=clock.environment(),
                  plot_title=(f"SmolLM2-135M fp32 on the HF oracle, {args.prompts} prompts per length "
                              f"({', '.join(args.families)}), {args.docs} docs"))
    H.write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)
    print_table(result)
    print(f"checks: {'passed' if not failures else 'FAILED'}")
    for f in failures:
        print(f"  {f}")
    print(f"wall {result['environment']['wall_s']:.0f} s; wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
