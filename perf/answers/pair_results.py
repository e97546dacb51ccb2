"""Paired differences between rows of two ``bench_blend.py`` results on the same prompts.

    python -m perf.answers.pair_results BASE.json "LABEL" OTHER.json "LABEL" [...] --out perf/results/X.json

A setting's quality is a deterministic function of the engine and the prompt, so two runs over the
same prompts (same seed and sizes: the tasks, the prompts' token counts and vanilla's continuation
are checked equal) pair prompt by prompt as one run's rows do (``blend_metrics.paired``): here
across engine configurations a single run cannot hold (a deployment setting such as
``blend_entries``). Each OTHER row gets its KL and exact-match differences from the BASE row, with
bootstrap intervals. Times to first token do not compare across runs and are not paired.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from perf.answers.blend_metrics import paired_deltas


def row_of(result: dict, label: str, path: str) -> dict:
    for row in result["rows"]:
        if row["label"] == label:
            return row
    raise SystemExit(f"{path}: no row {label!r}; rows: {[r['label'] for r in result['rows']]}")


def same_prompts(a: dict, b: dict) -> str | None:
    """Why the two results' prompts differ (None: the same)."""
    if a["tasks"] != b["tasks"]:
        return "their tasks differ (documents, questions or orders)"
    keys = ("prompt", "prompt_tokens", "continuation")
    if [[r[k] for k in keys] for r in a["reference"]] != [[r[k] for k in keys] for r in b["reference"]]:
        return "their prompts' token counts or vanilla's continuations differ"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pairs", nargs="+", help="BASE.json LABEL, then OTHER.json LABEL ...")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if len(args.pairs) < 4 or len(args.pairs) % 2:
        raise SystemExit("give BASE.json LABEL and at least one OTHER.json LABEL")
    files = {path: json.loads(Path(path).read_text()) for path in args.pairs[::2]}
    (base_path, base_label), others = args.pairs[:2], list(zip(args.pairs[2::2], args.pairs[3::2]))
    base = row_of(files[base_path], base_label, base_path)
    rows = []
    for path, label in others:
        why = same_prompts(files[base_path], files[path])
        if why:
            raise SystemExit(f"{path} and {base_path} are not the same prompts: {why}")
        other = row_of(files[path], label, path)
        rows.append({"file": path, "label": label, "kl": other["kl"], "exact_match": other["exact_match"],
                     **paired_deltas(base, other)})
        r = rows[-1]
        print(f"{label:>20} ({path}): KL {r['kl']:.3f} {r['kl_delta']:+.3f} [{r['kl_delta_ci'][0]:+.3f}, "
              f"{r['kl_delta_ci'][1]:+.3f}]  exact match {r['exact_match']:.2f} {r['exact_match_delta']:+.2f} "
              f"[{r['exact_match_delta_ci'][0]:+.2f}, {r['exact_match_delta_ci'][1]:+.2f}]")
    out = {"command": "python -m perf.answers.pair_results " + " ".join(f'"{a}"' if " " in a else a for a in sys.argv[1:]),
           "base": {"file": base_path, "label": base_label, "kl": base["kl"], "exact_match": base["exact_match"]},
           "rows": rows, "definitions": {"kl_delta": "per prompt, the row's KL over vanilla's continuation minus the "
                                         "base row's; mean with a 95 % bootstrap interval (2000 resamples, seed 0)",
                                         "exact_match_delta": "the same for exact match"}}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
