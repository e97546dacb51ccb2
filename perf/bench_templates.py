"""Cached-chunk prefill with graph-template replay versus eager, side by side in one engine.

    python perf/bench_templates.py [--chunks 8 --chunk-tokens 512 --sys-tokens 32 --question-tokens 64
                                    --rounds 10 --dtype float32 --templates cpu
                                    --out perf/results/templates.json]

One GraphChunkLLM engine with the grid's templates captured at start-up. One warm-up request puts
k documents (L tokens each, CPython's ``pydoc_data`` text) into the chunk pool; then every round
sends one prompt — the same documents in a new order, a new question of Q tokens — twice: once
with templates on (the step replays its bucket's template) and once off (eager), alternating
which goes first. Every measured request is all-hit, so it computes only its question. vLLM's
prefix cache is off so that both runs of a round do the same work. TTFT is the wall time of
``generate`` with ``max_tokens=1``; counters are checked around every request (a replay run
shows one replay, an eager run none, neither a fallback nor a miss) and both runs of a round
must produce the same first token.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
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


def timed(llm, ids, bounds):
    from vllm import SamplingParams

    from graphchunk.engine.frontend import BOUNDARIES_ARG

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={BOUNDARIES_ARG: bounds})
    before = llm.stats()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    ttft = time.perf_counter() - start
    after = llm.stats()
    delta = {k: int(after[k] - before[k]) for k in ("hits", "misses", "graph_replays", "graph_fallbacks")}
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
    started = time.perf_counter()
    llm = GraphChunkLLM(model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
                        max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
                        kv_cache_memory_bytes=2 << 30, seed=args.seed,
                        graphchunk={"templates": args.templates, "pool_tokens": 2 * max_model_len + 2048})
    startup = time.perf_counter() - started
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    failures, runs = [], {"eager": [], "replay": []}
    try:
        warm = timed(llm, *prompt(sys_ids, docs, range(args.chunks), questions[0]))
        log(f"engine up in {startup:.1f} s; warm-up (all miss) {warm[0]:.2f} s")
        for r in range(1, args.rounds + 1):
            order = rng.sample(range(args.chunks), args.chunks)
            ids, bounds = prompt(sys_ids, docs, order, questions[r])
            first_tokens = {}
            for mode in (("eager", "replay") if r % 2 else ("replay", "eager")):
                llm.use_templates(mode == "replay")
                ttft, token, delta = timed(llm, ids, bounds)
                expected = {"hits": args.chunks, "misses": 0, "graph_replays": int(mode == "replay"),
                            "graph_fallbacks": 0}
                if delta != expected:
                    failures.append(f"round {r} {mode}: counters {delta}, expected {expected}")
                runs[mode].append(ttft)
                first_tokens[mode] = token
                log(f"round {r:2d} {mode:>6} {1e3 * ttft:8.1f} ms  {delta}")
            if first_tokens["eager"] != first_tokens["replay"]:
                failures.append(f"round {r}: first token {first_tokens}")
        manifest = llm.templates_manifest()  # capture time and memory, and replays, per bucket
    finally:
        load["end"] = os.getloadavg()
        llm.shutdown()

    stats = {mode: {"p50_s": float(np.percentile(t, 50)), "p90_s": float(np.percentile(t, 90)), "runs_s": t}
             for mode, t in runs.items()}
    result = {
        "device": device_name(),
        "replay_over_eager": stats["replay"]["p50_s"] / stats["eager"]["p50_s"],
        "eager": stats["eager"], "replay": stats["replay"],
        "what": "TTFT of an all-hit request (question-only cached-chunk prefill + sampling one token), "
                "templates on vs off in the same engine, alternating",
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "model": model, "context_tokens": context, "max_model_len": max_model_len,
                   "enable_prefix_caching": False},
        "templates": manifest, "engine_startup_s": startup, "warmup_all_miss_s": warm[0],
        "checks_passed": not failures, "failures": failures, "environment": {**versions(), "load_average": load},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.chunks} x {args.chunk_tokens} cached + {args.question_tokens}-token question, {args.dtype}, "
          f"{args.rounds} rounds on {result['device']}")
    for mode in ("eager", "replay"):
        print(f"  {mode:>6}: p50 {1e3 * stats[mode]['p50_s']:.1f} ms, p90 {1e3 * stats[mode]['p90_s']:.1f} ms")
    print(f"  replay_over_eager = {result['replay_over_eager']:.3f}")
    print(f"checks: {'passed' if not failures else 'FAILED'}")
    for failure in failures:
        print(f"  {failure}")
    print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
