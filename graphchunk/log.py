"""graphchunk's logger, a child of vLLM's: ``vllm.graphchunk``.

Its lines go where vLLM's go (vLLM's handler, format and ``VLLM_LOGGING_LEVEL``) in every process
vLLM starts; a logger of graphchunk's own name has no handler there, so its info lines (the pool's
size, the tier, the graph grid) were never shown.
"""
import logging

logger = logging.getLogger("vllm.graphchunk")
