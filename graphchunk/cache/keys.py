"""Content keys of cached KV (DESIGN.md §3).

In isolated mode every layer after the first mixes ``sys`` into a chunk, so a chunk's KV is a
function of (model, dtype, parallel layout, sys tokens, chunk tokens), and ``cache_salt`` keeps
tenants apart. A blend chunk is computed alone (after the deployment's fixed ``blend_prefix``, if
any), so its key has no sys tokens, only that prefix in their place; the mode is part of
every key, so isolated and blend entries never satisfy each other's lookups. The key is a 128-bit
xxhash of all of them; a hit is still verified against the stored tokens, since a hash makes
collisions unlikely, not impossible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash


@dataclass(frozen=True)
class KeySpace:
    """What makes KV computed by one engine incompatible with another's."""

    model: str
    dtype: str
    parallel_layout: str = "tp1-pp1"
    blend_prefix: tuple[int, ...] = ()
    """Tokens computed before every blend chunk (``GraphChunkConfig.blend_prefix``): a blend
    chunk's key and entry are those of ``blend_prefix ‖ chunk``."""

    def header(self, cache_salt: str | None) -> bytes:
        fields = (self.model, self.dtype, self.parallel_layout, cache_salt or "")
        return "\x1f".join(fields).encode() + b"\x1e"


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    # Length-prefixed, so (sys, chunk) boundaries cannot slide: ([1, 2], [3]) != ([1], [2, 3]).
    arr = np.asarray(tokens, dtype=np.int64)
    return np.int64(arr.size).tobytes() + arr.tobytes()


def chunk_key(space: KeySpace, sys_tokens: Sequence[int], chunk_tokens: Sequence[int],
              cache_salt: str | None = None, mode: str = "isolated") -> bytes:
    """16-byte key of a chunk's KV computed after ``sys_tokens`` (blend: alone, ``sys_tokens`` empty)."""
    h = xxhash.xxh3_128(space.header(cache_salt))
    h.update(mode.encode() + b"\x1fchunk")
    h.update(_tokens_bytes(sys_tokens))
    h.update(_tokens_bytes(chunk_tokens))
    return h.digest()


def sys_key(space: KeySpace, sys_tokens: Sequence[int], cache_salt: str | None = None,
            mode: str = "isolated") -> bytes:
    """16-byte key of a sys prompt's KV (ordinary causal attention from position 0)."""
    h = xxhash.xxh3_128(space.header(cache_salt))
    h.update(mode.encode() + b"\x1fsys")
    h.update(_tokens_bytes(sys_tokens))
    return h.digest()
