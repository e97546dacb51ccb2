"""graphchunk inside vLLM: the general plugin and request side (API process), the worker and the
chunk-aware model runner (worker processes). ``graphchunk.Runner`` is ``worker.py``'s class."""
