"""Blend mode: which reused chunk tokens get fresh KV (``recompute.py``) and moving cached keys
to another position (``rope.py``)."""
