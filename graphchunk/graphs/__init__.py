"""Buckets of the cached-chunk prefill: grids, the bucket a step maps to, and counts of how each
step ran on vLLM's graphs."""
