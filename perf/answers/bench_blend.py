"""Quality and speed of every graphchunk setting against vanilla full prefill, side by side, in one run.

    python -m perf.answers.bench_blend [--prompts 48 --docs 5-8 --doc-tokens 150 --families all --continuation 16
                                --repeats 1 --settings all --out perf/results/blend_quality.json
                                --plot perf/results/blend_quality.png]
    python -m perf.answers.bench_blend --quick --enforce-eager --settings vanilla,isolated,isolated:0.8,none,question:0.3,cacheblend:1.0
                                                           # a smoke run, ~2 min (CI: tests/test_bench_blend.py's three)

Default sizes: 48 prompts (12 of each task family) x 5-8 documents of ~150 tokens (~1.1k-token
prompts); ``--doc-tokens 400`` is the long form. The first benchmark (4 documents of ~100 tokens, fact and
two_hop only: ``--docs 4 --doc-tokens 100 --families fact,two_hop``) took ~3-4 s per (prompt, setting)
with vLLM's compilation on, ~45 min on 2 cores; time grows with the prompt. LegoLink's k (5, 15, 30) are
the 5/15/30 % recompute budgets of CacheBlend and ``question`` on ~100-token documents.

Settings (``--settings``, comma list, default ``all`` = ``blend_task.DEFAULT_SETTINGS``; vanilla always
runs, first). One GraphChunkLLM engine (bundled SmolLM2-135M-Instruct, fp32, vLLM's compilation on as
a user runs it unless --enforce-eager, vLLM prefix caching on), every setting on the same token ids:

* ``vanilla``       the prompt's token ids as an ordinary token prompt (no boundaries): full
                    prefill, the reference;
* ``isolated``      graphchunk's isolated mode (``graphchunk_mode: isolated``), the deployment's
                    default key temperature; ``isolated:T`` also sends ``graphchunk_key_temperature: T``
                    (label ``isolated T=0.8``; ``isolated:1`` sends 1.0);
* ``none`` / ``cacheblend:R`` / ``question:R`` / ``legolink:K``  blend mode (``graphchunk_mode: blend``,
                    ``graphchunk_recompute``, ``graphchunk_recompute_ratio`` / ``_tokens``);
                    ``cacheblend:1.0`` recomputes every chunk token and must match vanilla.

``--blend-entries context`` runs the engine with ``graphchunk.blend_entries: context``: the warm-up
request (all misses, run as vLLM's full prefill when its policy ranks the context) leaves its
documents' KV as computed there, in the warm-up order behind a fresh sys, for every blend setting.

``--blend-entries corpus`` first runs ``graphchunk-precompute --context bm25 --format documents``
over every document of the run (the operator's corpus: each document computed behind its
``--context-size`` most related ones in it, behind the quality sys) into a tier (``--store``), then
runs the engine on that tier: blend settings send no ``cache_salt`` (corpus entries serve unsalted
requests), so their warm-ups load the contextualized entries from it.

``--blend-prefix TEXT`` runs the engine with ``graphchunk.blend_prefix: TEXT``: every blend chunk
computed after that text (DESIGN.md §2's fixed model-level prefix).

A setting the installed library cannot serve (a recompute policy or argument it does not know) is
not run; its row says why and the run's checks fail.

Tasks (``rag_tasks.py``, whose docstring is their spec): the families fact, paraphrase, two_hop and
which_doc in turn (``--families``), --docs documents per prompt (N, or A-B drawn per prompt) of
CPython help-topic text, ~--doc-tokens tokens each (0.75x..1.25x), whole sentences, facts planted at
random sentence boundaries, up to --distractors distractor facts in other documents.

Chat form (``RagPrompt(sys, docs, question, chat=True)``): a chat request's documents, placed as the
OpenAI server places them (system = sys, the user message leads with the documents, then the
question). The result's ``tasks`` records each prompt's family, gold document(s), facts,
distractors and document orders.

Per prompt, in this order (all requests greedy; the quality sys prompt is ``SYS_TEXT``). Cache
salts (``blend_task.salt_of``): settings sharing a ``cache_salt`` share chunk-pool entries, and
graphchunk's fingerprint in the request's salt keeps their vLLM prefix-cache blocks apart (blend:
policy and parameter; isolated: key temperature). All blend settings share one (a blend chunk's
KV is computed alone: the same for every policy); all ``isolated:T`` settings another (the pool
keeps plain keys; T applies as they are copied into a request); vanilla and plain ``isolated``
have their own. Checked: no graphchunk setting's forced request gets prefix-cache tokens, and the
timed checks below.

* reference: vanilla alone, --continuation tokens, ignore_eos, logprobs=-1 (the whole vocabulary at
  every step, vLLM's raw model logprobs, flat_logprobs, no detokenization): vanilla's greedy
  continuation and its distribution at each of its steps;
* warm-ups, one request (max_tokens=1) per cache salt, the documents in another order (the
  warm-up order): isolated behind the quality sys (isolated KV depends on sys, not on order),
  blend behind a fresh sys. Afterwards every document is in the pool, so every setting's quality
  requests are pool hits;
* forced, one batch (one ``generate``, a request per setting, vanilla included; chunked prefill is
  off, so every prompt's prefill runs whole in one step as when alone): each request is fed
  vanilla's continuation by the ForceTokens logits processor (``force_tokens.py``) with
  logprobs=-1: the setting's distribution at every step. Per step KL(vanilla || setting) in nats;
  ``kl`` = the mean over the continuation's steps; ``kl_first`` = KL at the first answer-bearing
  step (the first continuation token whose decoded text has a digit: where vanilla's code starts;
  step 0 where none has, counted in ``answer_position_fallbacks``); ``kl_first_token`` = step 0;
  ``top1_agreement`` = share of steps where the setting's argmax equals vanilla's token;
* answer, one batch: free greedy generation per setting (--answer-tokens, stops at EOS);
  ``exact_match`` = ``Task.correct``: the expected 4-digit code occurs in the text as a whole number
  (regex ``(?<!\\d)CODE(?!\\d)``); which_doc: the first title the text names is the gold one;
* timing (--repeats rounds, settings in an order rotated every round and prompt): the documents in
  yet another order behind a sys prompt never seen before (a fresh nonce at its start, so vLLM's
  prefix cache cannot serve even its first block): every chunk a pool hit for blend, a full
  prefill for vanilla, an all-miss for isolated (isolated KV depends on sys). Isolated settings
  also run their all-hit case: the quality sys (documents reordered, a first document no earlier
  request with that sys had). Each timed request alone; TTFT = wall time of ``generate`` with
  max_tokens=1; ``num_cached_tokens`` and graphchunk's counters are checked around every one.

Per setting (a row of the result): each metric's mean over prompts with a 95 % percentile bootstrap
interval (``<metric>_ci``: prompts resampled with replacement, 2000 resamples, seed 0), also
``exact_match_delta`` (paired per prompt against vanilla) and the same per task kind (``by_task``);
``ttft_ms`` (p50; isolated: new sys, all miss), ``ttft_ms_all_hit`` (isolated: same sys, all hit;
else ttft_ms), each over vanilla's (``ttft_over_full_prefill``, ``ttft_all_hit_over_full_prefill``).
The result's ``definitions`` spell each out. Checks (``failures``; exit code 1 if any): every
forcing and counter check above, and cacheblend r=1's and vanilla's own ``kl`` at most FULL_KL_TOL.

Modules: ``blend_task.py`` (settings, documents, questions, orders), ``blend_runner.py`` (the
engine and the request loop), ``blend_metrics.py`` (KL, top-1, exact match, bootstrap, the
result's rows, table and plot), ``harness.py`` (what every perf script shares).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from perf.common import harness as H
from perf.answers.blend_metrics import DEFINITIONS, FULL_KL_TOL, plot, print_table, rows
from perf.answers.blend_runner import run
from perf.answers.blend_task import DEFAULT_SETTINGS, SYS_TEXT, one_setting, parse_settings
from perf.answers.rag_tasks import FAMILIES, parse_docs, parse_families

REPO = H.REPO
QUICK = dict(prompts=4, docs="3", doc_tokens=80, repeats=1, distractors=1, continuation=14)
"""--quick's sizes (one prompt of each task family; 14 continuation steps reach the first digit of
the code families' usual answers); sizes given explicitly still win."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48, help="prompts, the families in turn")
    p.add_argument("--families", default="all", help=f"comma list of {', '.join(FAMILIES)}, or all")
    p.add_argument("--docs", default="5-8", help="documents per prompt: N, or A-B drawn per prompt")
    p.add_argument("--doc-tokens", type=int, default=150,
                   help="target tokens per document (0.75x..1.25x); the corpus holds ~33k distinct tokens")
    p.add_argument("--distractors", type=int, default=2, help="documents with a distractor fact")
    p.add_argument("--continuation", type=int, default=16, help="teacher-forced steps (vanilla's greedy output)")
    p.add_argument("--answer-tokens", type=int, default=24, help="free greedy tokens scored for exact match")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds per prompt")
    p.add_argument("--settings", default="all", help=f"comma list; all = {DEFAULT_SETTINGS}")
    p.add_argument("--baseline", default=None,
                   help="a setting of --settings (e.g. question:0.3): every other row gets its paired differences "
                        "from it (vs_baseline)")
    p.add_argument("--blend-prefix", default="", help="graphchunk.blend_prefix of the engine: text computed before "
                   "every blend chunk (default: none, chunks alone)")
    p.add_argument("--blend-entries", choices=("alone", "context", "corpus"), default="alone",
                   help="graphchunk.blend_entries of the engine: blend chunks computed alone, or taken from the "
                        "full prefill that first carried them (the warm-up's, when its policy ranks the context); "
                        "corpus: precomputed behind related documents (graphchunk-precompute --context bm25)")
    p.add_argument("--context-size", type=int, default=2,
                   help="--blend-entries corpus: documents before each one (graphchunk-precompute --context-size)")
    p.add_argument("--store", type=Path, default=None,
                   help="--blend-entries corpus: the tier directory (default: a new temporary one); a rerun "
                        "with the same prompts resumes its precompute")
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
    args = H.parse_with_quick(p, argv, QUICK)
    args.settings = parse_settings(args.settings)
    if args.blend_entries == "context" and args.no_salt:
        raise SystemExit("--blend-entries context needs the per-setting cache_salt: graphchunk takes blend entries "
                         "from a full prefill only under a cache_salt (one tenant's entries), so --no-salt would "
                         "measure entries computed alone")
    if args.baseline:
        args.baseline = one_setting(args.baseline).label
        if args.baseline not in [s.label for s in args.settings]:
            raise SystemExit(f"--baseline {args.baseline!r} is not among --settings")
    args.families = parse_families(args.families)
    parse_docs(args.docs)
    return args


def exactness_failures(result_rows: list[dict]) -> list[str]:
    """Recomputing 100 % must be full prefill (DESIGN.md §2), and vanilla must match itself."""
    out = []
    for row in result_rows:
        full = row["policy"] == "cacheblend" and row["param"] == 1.0
        if (full or row["policy"] == "vanilla") and row["kl"] is not None and row["kl"] > FULL_KL_TOL:
            out.append(f"{row['label']} differs from full prefill: mean KL over the continuation {row['kl']:.3g} "
                       f"> {FULL_KL_TOL:g}")
    return out


def result_of(args, argv, res, result_rows, clock) -> dict:
    device = H.device_name()
    fallbacks = sum(r["answer_position_fallback"] for r in res["reference"])
    return {
        "device": device,
        "rows": result_rows,
        "vanilla_exact_match": result_rows[0]["exact_match"],
        "answer_position_fallbacks": fallbacks,
        "definitions": DEFINITIONS,
        "config": {**H.config_dict(args, skip=("settings",)),
                   "settings": [s.label for s in args.settings], **res["engine"],
                   "startup_s": res["startup_s"], "prompt_tokens": res["prompt_tokens"],
                   "doc_tokens": res["doc_tokens"], "sys_prompt": SYS_TEXT,
                   "per_setting_cache_salt": not args.no_salt, "precomputed_corpus": res.get("precomputed")},
        "command": H.command_line(__file__, argv),
        "tasks": [t.record() for t in res["tasks"]],
        "reference": res["reference"],
        "per_prompt_s": res["per_prompt_s"],
        "quality_batches": res["quality_batches"],
        "checks_passed": not res["failures"],
        "failures": res["failures"],
        "final_stats": res["final_stats"],
        "environment": clock.environment(),
        "plot_title": (f"SmolLM2-135M fp32, {args.prompts} prompts ({', '.join(args.families)}) x {args.docs} docs "
                       f"(~{args.doc_tokens} tok), {args.continuation}-token continuation; {device}"),
    }


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
    res["failures"].extend(exactness_failures(result_rows))
    result = result_of(args, argv, res, result_rows, clock)
    H.write_json(args.out, result)
    if args.plot:
        plot(result_rows, args.plot, result["plot_title"])

    print_table(result_rows)
    print(f"answer position fallbacks (no answer start in vanilla's continuation): {result['answer_position_fallbacks']} "
          f"of {len(res['reference'])} prompts")
    print(f"checks: {'passed' if not res['failures'] else 'FAILED'}")
    for failure in res["failures"][:40]:
        print(f"  {failure}")
    per_prompt = res["per_prompt_s"]
    print(f"wall {result['environment']['wall_s']:.0f} s (engine start {res['startup_s']:.0f} s, "
          f"{sum(per_prompt) / max(1, len(per_prompt)):.1f} s per prompt, "
          f"{sum(per_prompt) / max(1, len(per_prompt) * len(args.settings)):.2f} s per (prompt, setting)); "
          f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
