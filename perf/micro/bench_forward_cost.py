"""What graphchunk's own forwards cost per forward and per token (issue 36: blend's misses, scoring
pass and recompute run as separate small forwards beside vLLM's; is their cost per forward or per
token?), measured inside a real engine's worker on the paths graphchunk uses.

    python -m perf.micro.bench_forward_cost [--model smollm2] [--tokens 1,4,16,64,256] [--repeats 5]
                                      [--out perf/results/forward_cost.json]

One GraphChunkLLM (vLLM's compilation on, as users run it). In its worker, between steps, over
pool blocks borrowed and restored (``tests/test_compiled_forward.py``'s pattern), each path runs a
pseudo-sequence of n new tokens over a context of ``--context`` tokens already in place, n from
``--tokens``, twice untimed (a new shape's first calls compile and allocate), then ``--repeats``
times (the median is kept):

* ``compiled``: ``RunnerKV.prefill`` at full depth (misses, blend's recompute): vLLM's compiled graph;
* ``plain``: the same through vLLM's plain forward (CacheBlend's check pass runs so, at fewer layers);
* ``scoring``: ``RunnerKV.context_attention`` (the question-aware policy's scoring pass: the plain
  forward with a hook per attention layer and the question's attention to the context computed
  from the cache);
* ``split``: ``--split`` sequences of n/split tokens, as ``--split`` separate compiled forwards, and
  as one forward of ``--split`` sequences: what batching requests into one forward saves;
* ``copies``: the ``--context`` slots of the first sequence copied into the second's one slot
  later, as a fill copies (``KVCopier.copy_slots``) and as blend's rotated copy; where the layout is
  not affine (vLLM's CPU backend in bf16 with AMX), also with element-by-element writes instead of
  the backend's write op, side by side (``copies.element_writes_over_backend_op``).

A least-squares line t = a + b n per path gives ``a`` (per forward) and ``b`` (per token), the
fit's largest relative residual beside them. Times are the worker's wall clock around each call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from perf.common import harness as H


def measure_in_worker(worker, tokens: list[int], context: int, repeats: int, split: int) -> dict:
    """Runs in the engine's worker between steps: every path at every size, median seconds."""
    import time

    import numpy as np
    import torch

    from graphchunk.device import PseudoSeq

    runner = worker.model_runner
    pool, kv = runner.chunk_engine.pool, runner.chunk_engine.kv
    longest = context + max(tokens)
    per_seq = -(-longest // pool.block_size)
    needed = per_seq * split
    blocks = list(range(pool.first_block + pool.num_blocks - needed, pool.first_block + pool.num_blocks))
    saved = kv.read_blocks(blocks)
    ids = (np.arange(longest * split) % 5000 + 100).tolist()

    def seq(i: int, n: int) -> PseudoSeq:
        own = blocks[i * per_seq:(i + 1) * per_seq]
        toks = ids[i * longest:i * longest + context + n]
        return PseudoSeq(toks, np.arange(context + n), own, context)

    def timed(fn) -> float:
        for _ in range(2):  # a new shape's first calls pay for compilation and allocation: not timed
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    out: dict = {"compiled": {}, "plain": {}, "scoring": {}, "split_separate": {}, "split_batched": {}}
    try:
        with torch.inference_mode():
            for i in range(split):  # the contexts' KV in place, computed once
                kv.prefill([PseudoSeq(ids[i * longest:i * longest + context], np.arange(context),
                                      blocks[i * per_seq:(i + 1) * per_seq], 0)])
            for n in tokens:
                out["compiled"][n] = timed(lambda: kv.prefill([seq(0, n)]))
                out["plain"][n] = timed(lambda: kv.prefill([seq(0, n)], num_layers=10**6))
                out["scoring"][n] = timed(lambda: kv.context_attention([seq(0, n)]))
                if n % split == 0:
                    part = n // split
                    out["split_separate"][n] = timed(lambda: [kv.prefill([seq(i, part)]) for i in range(split)])
                    out["split_batched"][n] = timed(lambda: kv.prefill([seq(i, part) for i in range(split)]))
            copies = measure_copies(kv, blocks[:per_seq], blocks[per_seq:2 * per_seq], context, timed) \
                if split >= 2 else {}
    finally:
        kv.write_blocks(blocks, saved)
    return {"seconds": out, "num_layers": len(kv.layers), "block_size": pool.block_size,
            "compilation_mode": str(runner.compilation_config.mode), "copies": copies}


def measure_copies(kv, src_blocks: list[int], dst_blocks: list[int], n: int, timed) -> dict:
    """``n`` slots copied from ``src_blocks`` to ``dst_blocks`` one slot later (not block-aligned):
    median ms of the fill's copy and blend's rotated copy, and on a layout that is not affine the
    same with the copier's backend writers set aside (element-by-element writes), in this run."""
    import numpy as np

    from graphchunk.device import slots_of

    copier, bs = kv.copier, kv.runner.cache_config.block_size
    src, dst = slots_of(src_blocks, np.arange(n), bs), slots_of(dst_blocks, np.arange(n) + 1, bs)
    deltas = np.full(n, 7, np.int64)
    paths = {"plain": lambda: copier.copy_slots(src, dst)}
    if kv.blend.rotation is not None:
        paths["rotated"] = lambda: copier.copy_slots_rotated(src, dst, deltas, kv.blend.rotation)
    ms = {name: round(timed(run) * 1e3, 3) for name, run in paths.items()}
    result = {"slots": n, "layout_affine": copier.views is not None, "ms": ms}
    if copier.views is None and copier.writers is not None:
        writers, copier.writers = copier.writers, None
        try:
            elements = {name: round(timed(run) * 1e3, 3) for name, run in paths.items()}
        finally:
            copier.writers = writers
        result["ms_element_writes"] = elements
        result["element_writes_over_backend_op"] = {name: round(elements[name] / ms[name], 3) for name in ms}
    return result


def fit(points: dict) -> dict:
    """t = a + b n by least squares over {n: seconds}: a and b in ms, the largest relative residual."""
    ns, ts = list(map(int, points)), list(points.values())
    if len(ns) < 2:
        return {}
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
    b = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / sum((n - mean_n) ** 2 for n in ns)
    a = mean_t - b * mean_n
    worst = max(abs(a + b * n - t) / t for n, t in zip(ns, ts))
    return {"per_forward_ms": round(a * 1e3, 3), "per_token_ms": round(b * 1e3, 4),
            "max_relative_residual": round(worst, 3),
            "tokens_costing_one_forward": round(a / b, 1) if b > 0 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="perf/micro/bench_forward_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256])
    parser.add_argument("--context", type=int, default=512, help="context tokens in place before the new ones")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--split", type=int, default=4, help="sequences of the split comparison")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", type=Path, default=H.REPO / "perf/results/forward_cost.json")
    args = H.parse_with_quick(parser, argv, dict(model="tiny-llama3", tokens=[1, 8, 32], context=64, repeats=2,
                                                 out=Path(tempfile.gettempdir()) / "forward_cost_quick.json"))
    H.script_env()
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the measurement runs in the worker
    import cloudpickle

    from graphchunk.llm import GraphChunkLLM

    clock = H.RunClock()
    model = H.resolve_model(args.model)
    max_len = args.context + max(args.tokens) + 64
    llm = GraphChunkLLM(str(model), dtype=args.dtype, max_model_len=max(2048, max_len), kv_cache_memory_bytes=1 << 30,
                        max_num_batched_tokens=max(2048, max_len), block_size=128, enforce_eager=args.enforce_eager,
                        graphchunk={"pool_tokens": 8192, "mode": "isolated"})
    started = time.perf_counter()
    try:
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        found = llm.llm.collective_rpc(measure_in_worker, args=(args.tokens, args.context, args.repeats,
                                                                 args.split))[0]
    finally:
        llm.shutdown()
    seconds = found.pop("seconds")
    result = {"benchmark": "forward_cost", "command": H.command_line(__file__, argv), "device": H.device_name(),
              "environment": clock.environment(), "config": H.config_dict(args, skip=("out",)), **found,
              "ms": {path: {str(n): round(t * 1e3, 3) for n, t in points.items()} for path, points in seconds.items()},
              "fit": {path: fit(points) for path, points in seconds.items() if not path.startswith("split")},
              "split_batched_over_separate": {str(n): round(seconds["split_batched"][n] / seconds["split_separate"][n], 3)
                                              for n in seconds["split_batched"]},
              "measure_s": round(time.perf_counter() - started, 1)}
    H.write_json(args.out, result)
    for path, line in result["fit"].items():
        print(f"{path:9s} {line}")
    print("split: one forward of", args.split, "sequences over", args.split, "forwards:",
          result["split_batched_over_separate"])
    print("copies:", result["copies"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
