"""Cached-chunk prefill: graphchunk's static-shape templates vs vLLM's own compiled graph vs eager, one run.

    python perf/bench_templates.py [--chunks 8 --chunk-tokens 512 --sys-tokens 32 --question-tokens 64
                                    --padded-question-tokens 48 --rounds 10 --dtype float32
                                    --templates cpu --out perf/results/templates.json]

Engine A runs as a user gets it (no --enforce-eager: on CPU vLLM compiles one dynamic-shape
graph, DYNAMO_TRACE_ONCE) with the grid's templates captured at start-up as graphchunk's own
static-shape templates (the grid's backend is taken as ``compile`` whatever the file names).
One warm-up request puts k documents (L tokens each, CPython's ``pydoc_data`` text) into the chunk
pool; then every round sends the same documents in a new order with new questions, each prompt
once per arm, in an order alternating by round:
``replay`` (Q-token question, templates on: the bucket's template at exactly its size),
``vllm_graph`` (the same prompt, templates off: vLLM's compiled graph), ``replay_padded``
(a question of P < Q tokens, padded to the Q-token template) and ``vllm_graph_padded_q`` (that
prompt on vLLM's graph, unpadded). Engine B then starts with --enforce-eager and no templates
and runs the same prompts (``eager``, ``eager_padded_q``). Every measured request is all-hit, so
it computes only its question; vLLM's prefix cache is off so all arms do the same work. TTFT is
the wall time of ``generate`` with ``max_tokens=1``; counters are checked around every request
(replayed / padded / none) and all arms of a prompt must give the same first token.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from bench_ttft import TextSource, device_name, versions

import numpy as np  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--sys-tokens", type=int, default=32)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--padded-question-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--templates", default="cpu")
    parser.add_argument("--model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("perf/results/templates.json"))
    return parser.parse_args(argv)


def windows(source: TextSource, rng: random.Random, count: int, n: int) -> list[tuple[int, ...]]:
    starts = list(range(len(source.paragraphs)))
    rng.shuffle(starts)
    found = (source.window(p, n) for p in starts)
    return [w for _, w in zip(range(count), (w for w in found if w is not None))]


def prompt(sys_ids, docs, order, question) -> tuple[list[int], list[int]]:
    ids, bounds = list(sys_ids), []
    for d in order:
        bounds.append(len(ids))
        ids += docs[d]
    bounds.append(len(ids))
    return ids + list(question), bounds


GRAPH_COUNTERS = ("graph_replays", "graph_padded", "graph_eager")
ARMS = {  # arm: (engine, templates on, padded question, counters expected)
    "replay": ("A", True, False, (1, 0, 0)), "vllm_graph": ("A", False, False, (0, 0, 0)),
    "replay_padded": ("A", True, True, (0, 1, 0)), "vllm_graph_padded_q": ("A", False, True, (0, 0, 0)),
    "eager": ("B", False, False, None), "eager_padded_q": ("B", False, True, None)}


def as_compile_grid(name_or_path: str, directory: Path) -> str:
    """The grid with backend ``compile`` (graphchunk's static templates), as a file in ``directory``."""
    from graphchunk.graphs.buckets import load_grid

    text = Path(load_grid(name_or_path).source).read_text()
    path = directory / "templates-compile.toml"
    path.write_text(re.sub(r'(?m)^backend = .*$', 'backend = "compile"', text))
    return str(path)


def timed(llm, ids, bounds):
    from vllm import SamplingParams

    from graphchunk.engine.frontend import BOUNDARIES_ARG

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={BOUNDARIES_ARG: bounds})
    before = llm.stats()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    ttft = time.perf_counter() - start
    after = llm.stats()
    delta = {k: int(after[k] - before[k]) for k in ("hits", "misses") + GRAPH_COUNTERS}
    return ttft, out.outputs[0].token_ids[0], delta


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from graphchunk import GraphChunkLLM
    from graphchunk.reference import models

    model = args.model or str(models.smollm2_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    rng = random.Random(args.seed)
    source = TextSource(tokenizer)
    sys_ids = windows(source, rng, 1, args.sys_tokens)[0]
    docs = windows(source, rng, args.chunks, args.chunk_tokens)
    questions = windows(source, rng, args.rounds + 1, args.question_tokens)
    context = args.sys_tokens + args.chunks * args.chunk_tokens
    max_model_len = -(-(context + args.question_tokens + 256) // 1024) * 1024
    load = {"start": os.getloadavg()}
    rounds = []
    for r in range(1, args.rounds + 1):
        order = rng.sample(range(args.chunks), args.chunks)
        rounds.append({False: prompt(sys_ids, docs, order, questions[r]),
                       True: prompt(sys_ids, docs, order, questions[r][:args.padded_question_tokens])})
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    failures, runs, tokens, engines = [], {arm: [] for arm in ARMS}, {}, {}
    grid = as_compile_grid(args.templates, Path(tempfile.mkdtemp()))
    for engine in ("A", "B"):
        started = time.perf_counter()
        llm = GraphChunkLLM(model, dtype=args.dtype, enforce_eager=engine == "B", enable_prefix_caching=False,
                            max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
                            kv_cache_memory_bytes=2 << 30, seed=args.seed,
                            graphchunk={"templates": grid if engine == "A" else "",
                                        "pool_tokens": 2 * max_model_len + 2048})
        startup = time.perf_counter() - started
        try:
            warm = timed(llm, *prompt(sys_ids, docs, range(args.chunks), questions[0]))
            log(f"engine {engine} up in {startup:.1f} s; warm-up (all miss) {warm[0]:.2f} s")
            arms = [arm for arm, spec in ARMS.items() if spec[0] == engine]
            for r, prompts in enumerate(rounds, 1):
                for arm in (arms if r % 2 else arms[::-1]):
                    _, templates_on, padded, counters = ARMS[arm]
                    if engine == "A":
                        llm.use_templates(templates_on)
                    ttft, token, delta = timed(llm, *prompts[padded])
                    expected = {"hits": args.chunks, "misses": 0,
                                **dict(zip(GRAPH_COUNTERS, counters or (0, 0, 0)))}
                    if delta != expected:
                        failures.append(f"round {r} {arm}: counters {delta}, expected {expected}")
                    runs[arm].append(ttft)
                    tokens.setdefault((r, padded), set()).add(token)
                    log(f"round {r:2d} {arm:>20} {1e3 * ttft:8.1f} ms  {delta}")
            engines[engine] = {"startup_s": startup, "warmup_all_miss_s": warm[0],
                               "templates": llm.templates_manifest() if engine == "A" else None}
        finally:
            llm.shutdown()
    load["end"] = os.getloadavg()
    failures += [f"round {r} (padded question: {p}): first tokens differ across arms {sorted(t)}"
                 for (r, p), t in tokens.items() if len(t) != 1]

    stats = {arm: {"p50_s": float(np.percentile(t, 50)), "p90_s": float(np.percentile(t, 90)), "runs_s": t}
             for arm, t in runs.items()}
    p50 = {arm: stats[arm]["p50_s"] for arm in stats}
    ratios = {"replay_over_vllm_graph": p50["replay"] / p50["vllm_graph"],
              "replay_over_eager": p50["replay"] / p50["eager"],
              "vllm_graph_over_eager": p50["vllm_graph"] / p50["eager"],
              "replay_padded_over_vllm_graph": p50["replay_padded"] / p50["vllm_graph_padded_q"],
              "replay_padded_over_eager": p50["replay_padded"] / p50["eager_padded_q"]}
    result = {
        "device": device_name(), **ratios, **stats,
        "what": "TTFT of an all-hit request (question-only cached-chunk prefill + sampling one token): "
                "graphchunk's static templates vs vLLM's compiled dynamic-shape graph (engine A, alternating) "
                "vs eager (engine B, --enforce-eager, same prompts, after A)",
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "model": model, "context_tokens": context, "max_model_len": max_model_len,
                   "enable_prefix_caching": False, "templates_backend": "compile"},
        "engines": engines,
        "checks_passed": not failures, "failures": failures, "environment": {**versions(), "load_average": load},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.chunks} x {args.chunk_tokens} cached + {args.question_tokens}/{args.padded_question_tokens}-token "
          f"question, {args.dtype}, "
          f"{args.rounds} rounds on {result['device']}")
    for arm in ARMS:
        print(f"  {arm:>20}: p50 {1e3 * stats[arm]['p50_s']:.1f} ms, p90 {1e3 * stats[arm]['p90_s']:.1f} ms")
    for name, value in ratios.items():
        print(f"  {name} = {value:.3f}")
    print(f"checks: {'passed' if not failures else 'FAILED'}")
    for failure in failures:
        print(f"  {failure}")
    print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
