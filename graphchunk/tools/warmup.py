"""Captures every bucket of a graph-template grid for a model, ahead of traffic, and writes a manifest.

    graphchunk-warmup --templates cpu [--model PATH] [--manifest templates-manifest.json]
    python -m graphchunk.tools.warmup --templates graph_templates/cpu.toml --dtype float32

It starts the engine the server would start (``GraphChunkLLM`` with ``graphchunk.templates``, vLLM's
own compilation and graphs on unless ``--enforce-eager``), which captures with a progress bar,
then prints what was captured and writes it as JSON: per bucket, graphchunk's capture time and
memory (backends ``compile``, ``eager``), and the graphs vLLM captured itself (compilation mode,
cudagraph mode and capture sizes, which with backend ``vllm`` include the grid's token counts).
On CPU the compiled kernels land in torch inductor's on-disk cache (vLLM's own graph in its
``torch_compile_cache``), so a server started later with the same grid, model and dtype loads them.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="graphchunk-warmup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--templates", default="cpu", help="grid name in graph_templates/ or a .toml path")
    parser.add_argument("--model", help="model path (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--manifest", type=Path, default=Path("templates-manifest.json"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--pool-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true", help="as vLLM's flag: no vLLM graphs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from graphchunk import GraphChunkLLM
    from graphchunk.config import ConfigError
    from graphchunk.graphs.buckets import load_grid
    from graphchunk.reference import models

    try:
        grid = load_grid(args.templates)  # a bad spec fails here, before an engine starts
    except ConfigError as exc:
        print(f"graphchunk-warmup: error: {exc}", file=sys.stderr)
        return 2
    model = args.model or str(models.smollm2_path())
    print(f"graphchunk-warmup: {len(grid.buckets)} buckets of {grid.source} ({grid.backend}) for {model}",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    with GraphChunkLLM(model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       graphchunk={"templates": args.templates, "pool_tokens": args.pool_tokens}) as llm:
        manifest = llm.templates_manifest()
        dtype = str(llm.llm.llm_engine.model_config.dtype)
    manifest.update(model=model, dtype=dtype, machine=platform.machine(), processor=platform.processor(),
                    wall_seconds=time.perf_counter() - started, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    args.manifest.write_text(json.dumps(manifest, indent=1))
    vllm = manifest["vllm_graphs"]
    print(f"vLLM: compilation {vllm['compilation_mode']}, cudagraph mode {vllm['cudagraph_mode']}, "
          f"capture sizes {vllm['cudagraph_capture_sizes'] or 'none'}")
    if manifest["captured_by"] == "vllm":
        sizes = sorted({row_tokens(row["bucket"]) for row in manifest["buckets"]})
        print(f"{len(manifest['buckets'])} buckets of {len(sizes)} token counts {sizes} run on vLLM's graphs; "
              f"graphchunk captured nothing; wrote {args.manifest}")
        return 0
    print(f"{'bucket':<28} {'tokens':>6} {'capture s':>9} {'memory MiB':>10}")
    for row in manifest["buckets"]:
        print(f"{row['bucket']:<28} {row['num_tokens']:>6} {row['seconds']:>9.2f} {row['memory_bytes'] / 2**20:>10.1f}")
    total = sum(row["seconds"] for row in manifest["buckets"])
    print(f"captured {len(manifest['buckets'])} templates in {total:.1f} s; wrote {args.manifest}")
    return 0


def row_tokens(bucket_name: str) -> int:
    """``b2-c8x384-s96-q32`` -> 64 (batch * question tokens)."""
    parts = bucket_name.split("-")
    return int(parts[0][1:]) * int(parts[-1][1:])


if __name__ == "__main__":
    sys.exit(main())
