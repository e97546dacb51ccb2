"""graphchunk: position-independent chunk KV cache for vLLM.

``graphchunk.Runner`` (for ``--worker-cls``; the worker class, also named ``graphchunk.Worker``)
and ``graphchunk.GraphChunkLLM`` are imported lazily, so the engine-independent core works without
vLLM installed.
"""
from functools import cache

__version__ = "0.1.0"
__all__ = ["Runner", "Worker", "GraphChunkLLM"]


@cache
def _worker_class():
    from graphchunk.engine.worker import make_worker_class
    return make_worker_class()


def __getattr__(name: str):
    if name in ("Runner", "Worker"):
        return _worker_class()
    if name == "GraphChunkLLM":
        from graphchunk.llm import GraphChunkLLM
        return GraphChunkLLM
    raise AttributeError(f"module 'graphchunk' has no attribute {name!r}")
