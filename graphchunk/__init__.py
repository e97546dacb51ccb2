"""graphchunk: position-independent chunk KV cache for vLLM.

``graphchunk.Runner`` (for ``--worker-cls``) and ``graphchunk.GraphChunkLLM`` are imported
lazily, so the engine-independent core works without vLLM installed.
"""
from functools import cache

__version__ = "0.1.0"
__all__ = ["Runner", "GraphChunkLLM"]


@cache
def _runner_class():
    from graphchunk.engine.worker import make_runner_class
    return make_runner_class()


def __getattr__(name: str):
    if name == "Runner":
        return _runner_class()
    if name == "GraphChunkLLM":
        from graphchunk.llm import GraphChunkLLM
        return GraphChunkLLM
    raise AttributeError(f"module 'graphchunk' has no attribute {name!r}")
