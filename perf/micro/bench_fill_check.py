"""What the fill check costs (``cache/context_run.py``: every copy from the pool compares its
entry's blocks' epochs with the plan's), beside the copy it guards, measured in one run.

    python -m perf.micro.bench_fill_check [--chunks 8] [--chunk-tokens 200] [--out perf/results/fill_check.json]

A fill of ``--chunks`` chunks of ``--chunk-tokens`` tokens behind a 64-token system prompt, as
``ContextRunner.copy`` runs it, over a KV cache shaped like SmolLM2-135M's (30 layers, 3 KV heads
of 64, fp32, blocks of 32) in a plain torch tensor on the CPU (the copy is torch's ``index_copy_``
per layer, as the CPU copy path does per layer): the copy with the check (the default, and only,
way), the check alone, and their ratio. Median of ``--repeats`` runs each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from graphchunk.cache.context_plan import UnitCopy
from graphchunk.cache.context_run import ContextRunner
from graphchunk.metrics import CacheMetrics

LAYERS, HEADS, HEAD_SIZE, BLOCK = 30, 3, 64, 32


class TensorDevice:
    """The copies of a ``KVDevice`` over one [layers, slots, 2 x heads x head_size] tensor."""

    def __init__(self, num_blocks: int):
        self.kv = torch.randn(LAYERS, num_blocks * BLOCK, 2 * HEADS * HEAD_SIZE)

    def copy_slots(self, src, dst, key_temperature=1.0):
        src, dst = torch.from_numpy(src), torch.from_numpy(dst)
        for layer in self.kv:
            layer.index_copy_(0, dst, layer.index_select(0, src))


def fill(num_chunks: int, chunk_tokens: int, sys_tokens: int = 64):
    units, first = [], 0
    begin = sys_tokens
    runner = ContextRunner(BLOCK, 4096, CacheMetrics())
    for i in range(num_chunks):
        blocks = tuple(range(first, first + -(-(sys_tokens % BLOCK + chunk_tokens) // BLOCK)))
        first += len(blocks)
        for block in blocks:
            runner.epochs[block] = i + 1
        units.append(UnitCopy(blocks, sys_tokens % BLOCK, begin, begin + chunk_tokens, begin, "chunk", i + 1))
        begin += chunk_tokens
    request_blocks = list(range(first, first + -(-begin // BLOCK)))
    prompt = SimpleNamespace(block_ids=request_blocks, key_temperature=1.0)
    return runner, prompt, units, first + len(request_blocks)


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runner, prompt, units, num_blocks = fill(args.chunks, args.chunk_tokens)
    device = TensorDevice(num_blocks)
    assert runner.copy([(prompt, units)], device) == [prompt] and not runner.invalid
    copy_s = timed(lambda: runner.copy([(prompt, units)], device), args.repeats)
    check_s = timed(lambda: [runner._check(prompt, units) for _ in range(100)], args.repeats) / 100
    result = {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "blocks_checked": sum(len(u.entry_blocks) for u in units),
              "copy_with_check_ms": copy_s * 1e3, "check_us": check_s * 1e6, "check_share_of_fill": check_s / copy_s,
              "torch_threads": 1, "numpy": np.__version__, "torch": torch.__version__,
              "command": " ".join(["perf/micro/bench_fill_check.py", *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
