"""Quality and speed of every graphchunk setting against vanilla full prefill, side by side, in one run.

    python perf/bench_blend.py [--prompts 8 --docs 5 --doc-tokens 200 --continuation 16 --repeats 2
                                --settings all --out perf/results/blend_quality.json
                                --plot perf/results/blend_quality.png]     # ~17 min on 2 shared cores
    python perf/bench_blend.py --quick --settings vanilla,isolated          # smoke run, ~2 min

Settings (``--settings``, comma list, default all): vanilla, isolated, none, cacheblend:R, legolink:K.

One GraphChunkLLM engine (bundled SmolLM2-135M-Instruct, fp32, vLLM's compilation on as a user runs
it unless --enforce-eager, vLLM prefix caching on), one retrieval task, every setting on the same
token ids:

* ``vanilla``     the prompt's token ids as an ordinary token prompt (no boundaries): full prefill,
                  the reference;
* ``isolated``    graphchunk's isolated mode (``graphchunk_mode: isolated``);
* ``none`` / ``cacheblend:r`` / ``legolink:k``  blend mode (``graphchunk_mode: blend``,
                  ``graphchunk_recompute``, ``graphchunk_recompute_ratio`` / ``_tokens``);
                  ``cacheblend:1.0`` recomputes every chunk token and must match vanilla.

Task. Documents are CPython help-topic text (``pydoc_data.topics``, '#' removed), ~--doc-tokens
tokens each, whole sentences. Every prompt has --docs documents; one holds the planted fact "The
access code for the {color} {place} is {NNNN}." (at a random sentence boundary), up to
--distractors others hold the same fact for another color or place with another code. Chat form
(``RagPrompt(sys, docs, question, chat=True)``): system = sys, user = the documents and "What is
the access code for the {color} {place}?".

Per prompt, per setting (all requests greedy; each setting has its own ``cache_salt``, so no setting
is ever served KV another setting computed, neither by vLLM's prefix cache nor by the chunk pool):

* warm-up: the documents in another order behind another sys prompt (graphchunk settings only):
  afterwards every document is in the chunk pool;
* KL:      max_tokens=1, logprobs=-1 (the whole vocabulary, vLLM's raw model logprobs);
           kl = KL(vanilla || setting) of the first generated token's distribution, in nats;
* forced:  the setting is fed vanilla's greedy continuation (--continuation tokens, ignore_eos) by
           the ForceTokens logits processor (``force_tokens.py``) in one request; top-1 agreement =
           share of steps where the setting's own argmax (raw logprobs, rank 1) equals vanilla's token;
* answer:  free greedy generation (--answer-tokens, stops at EOS); exact match (EM) = the expected
           4-digit code occurs in the generated text as a whole number (regex ``(?<!\\d)CODE(?!\\d)``);
* timing (after all of the above, --repeats rounds, settings in rotated order each round): the
  documents in yet another order behind a sys prompt never seen before (a fresh nonce at its
  start, so vLLM's prefix cache cannot serve even its first block): every chunk is a pool hit for
  blend, a full prefill for vanilla, and an all-miss for isolated (isolated KV depends on sys).
  isolated also runs its own all-hit case: the warm-up's sys prompt (documents reordered, a first
  document no earlier request with that sys had). TTFT = wall time of ``generate`` with
  max_tokens=1; ``num_cached_tokens`` and graphchunk's counters are checked around every request.

Modules: ``blend_task.py`` (settings, documents, questions, orders), ``blend_runner.py`` (the
engine and the request loop), ``blend_metrics.py`` (KL, top-1, exact match, the result's rows,
table and plot), ``harness.py`` (what every perf script shares).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness as H
from blend_metrics import DEFINITIONS, FULL_KL_TOL, plot, print_table, rows
from blend_runner import run
from blend_task import DEFAULT_SETTINGS, SYS_TEXT, parse_settings

REPO = H.REPO


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--docs", type=int, default=5, help="documents per prompt")
    p.add_argument("--doc-tokens", type=int, default=200, help="target tokens per document (0.75x..1.25x)")
    p.add_argument("--distractors", type=int, default=2, help="documents with a fact for another color/place")
    p.add_argument("--continuation", type=int, default=16, help="teacher-forced steps (vanilla's greedy output)")
    p.add_argument("--answer-tokens", type=int, default=24, help="free greedy tokens scored for exact match")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per prompt")
    p.add_argument("--settings", default="all", help=f"comma list; all = {DEFAULT_SETTINGS}")
    p.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    p.add_argument("--pool-tokens", type=int, default=0, help="0: sized from the workload")
    p.add_argument("--no-salt", action="store_true",
                   help="no per-setting cache_salt (settings may then share vLLM prefix-cache blocks and pool entries)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run vLLM eagerly (default: vLLM's compilation on, as users run it)")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--out", type=Path, default=REPO / "perf/results/blend_quality.json")
    p.add_argument("--replot", type=Path, default=None, help="only draw --plot again from this result JSON")
    p.add_argument("--plot", type=Path, default=REPO / "perf/results/blend_quality.png")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 2 prompts x 3 documents of ~80 tokens, "
                                                        "1 round (explicitly given sizes still win)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.quick:
        given = {a.split("=")[0] for a in raw if a.startswith("--")}
        for name, value in (("prompts", 2), ("docs", 3), ("doc_tokens", 80), ("repeats", 1), ("distractors", 1),
                            ("answer_tokens", 16)):
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    args.settings = parse_settings(args.settings)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:  # the plot again from a result file, nothing measured
        result = json.loads(args.replot.read_text())
        plot(result["rows"], args.plot, result.get("plot_title", result["device"]))
        return 0
    H.script_env()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    clock = H.RunClock()
    res = run(args, log)
    clock.mark("end")
    result_rows = rows(args, res)
    for row in result_rows:  # recomputing 100 % must be full prefill (DESIGN.md §2)
        if row["policy"] == "cacheblend" and row["param"] == 1.0 and row["kl"] is not None and row["kl"] > FULL_KL_TOL:
            res["failures"].append(f"cacheblend r=1 differs from full prefill: mean KL {row['kl']:.3g} > {FULL_KL_TOL:g}")
    device = H.device_name()
    vanilla_row = result_rows[0]
    result = {
        "device": device,
        "rows": result_rows,
        "vanilla_exact_match": vanilla_row["exact_match"],
        "definitions": DEFINITIONS,
        "config": {**H.config_dict(args, skip=("settings",)),
                   "settings": [s.label for s in args.settings], **res["engine"],
                   "startup_s": res["startup_s"], "prompt_tokens": res["prompt_tokens"],
                   "doc_tokens": res["doc_tokens"], "sys_prompt": SYS_TEXT,
                   "per_setting_cache_salt": not args.no_salt},
        "command": H.command_line(__file__, argv),
        "tasks": [dict(index=t.index, color=t.color, place=t.place, code=t.code, gold_doc=t.gold,
                       distractors=t.distractors, question=t.question, orders=t.orders) for t in res["tasks"]],
        "reference": res["reference"],
        "checks_passed": not res["failures"],
        "failures": res["failures"],
        "final_stats": res["final_stats"],
        "environment": clock.environment(),
    }
    result["plot_title"] = (f"SmolLM2-135M fp32, {args.prompts} prompts x {args.docs} docs (~{args.doc_tokens} tok), "
                            f"{args.continuation}-token continuation; {device}")
    H.write_json(args.out, result)
    if args.plot:
        plot(result_rows, args.plot, result["plot_title"])

    print_table(result_rows)
    print(f"checks: {'passed' if not res['failures'] else 'FAILED'}")
    for failure in res["failures"][:40]:
        print(f"  {failure}")
    print(f"wall {result['environment']['wall_s']:.0f} s; wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
