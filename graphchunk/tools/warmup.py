"""Starts the engine on a grid ahead of traffic, so vLLM compiles its model and captures its graphs
at the grid's sizes, and writes a manifest.

    graphchunk-warmup --templates cpu [--model PATH] [--manifest templates-manifest.json]
    python -m graphchunk.tools.warmup --templates graph_templates/cpu.toml --dtype float32

It starts the engine the server would start (``GraphChunkLLM`` with ``graphchunk.templates``, vLLM's
own compilation and graphs on unless ``--enforce-eager``): vLLM compiles its model and, on CUDA or
Ascend, captures its graphs at its capture sizes, which include the grid's token counts
(``engine/graph_config.py``). graphchunk captures nothing. It prints what vLLM's graphs run with
(compilation mode, cudagraph mode, capture sizes) and which grid token counts are among the capture
sizes, and writes the manifest as JSON (``GraphChunkLLM.templates_manifest()``: the grid, vLLM's
graphs, per bucket the steps counted so far) with the model, dtype and machine. The compiled
kernels land in vLLM's ``torch_compile_cache``, keyed by the engine's whole configuration
(graphchunk's settings among it), so a server started later on the same model and settings can
load them. On CPU (vLLM 0.32, torch 2.13) vLLM's AOT-compiled artifact does not load ("'function'
object has no attribute 'finalize_loading'") and every start compiles again; with
``VLLM_USE_AOT_COMPILE=0`` vLLM loads its other compile cache (the tests' SmolLM2 engine: 90 s of
start-up compiling, 19 s loading).
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
    parser.add_argument("--pool-tokens", type=int, default=0, help="chunk-pool tokens (0: half the KV-cache budget)")
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
    print(f"graphchunk-warmup: {len(grid.buckets)} buckets of {grid.source} for {model}",
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
    sizes = vllm["cudagraph_capture_sizes"]
    print(f"vLLM: compilation {vllm['compilation_mode']}, cudagraph mode {vllm['cudagraph_mode']}, "
          f"capture sizes {sizes or 'none'}")
    print(f"{len(grid.buckets)} buckets, token counts {grid.token_counts}; among vLLM's capture sizes: "
          f"{[n for n in grid.token_counts if n in sizes] or 'none'}; wrote {args.manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
