"""Bucket grids (``graph_templates/*.toml``) and the choice of a bucket per step.

A bucket is one static shape of the cached-chunk prefill: up to ``batch`` requests, each with up
to ``num_chunks`` chunks of at most ``max_chunk_len`` tokens after a sys prompt of at most
``max_sys_len`` tokens, computing at most ``question_tokens`` question tokens. A step maps to the
smallest bucket that holds every request in it (fewest padded tokens, then least context). The
buckets' token counts (``batch * question_tokens``) are what vLLM's graphs capture
(``engine/graph_config.py``): a grid's only backend is ``vllm``.
"""
from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from graphchunk.config import ConfigError

AXES = ("batch", "num_chunks", "max_chunk_len", "max_sys_len", "question_tokens")
BACKEND = "vllm"
"""The only backend: vLLM's own graphs replay the buckets; graphchunk captures nothing."""
GRID_DIR = Path(__file__).resolve().parents[2] / "graph_templates"
"""The grids shipped with the source tree; ``load_grid`` also takes a path."""


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    num_chunks: int
    max_chunk_len: int
    max_sys_len: int
    question_tokens: int

    @property
    def num_tokens(self) -> int:
        """Tokens a step on this bucket's graph computes (its static shape)."""
        return self.batch * self.question_tokens

    @property
    def max_context_len(self) -> int:
        return self.max_sys_len + self.num_chunks * self.max_chunk_len

    @property
    def name(self) -> str:
        return (f"b{self.batch}-c{self.num_chunks}x{self.max_chunk_len}"
                f"-s{self.max_sys_len}-q{self.question_tokens}")

    def holds(self, req: "RequestShape") -> bool:
        return (len(req.chunk_lens) <= self.num_chunks and max(req.chunk_lens) <= self.max_chunk_len
                and req.sys_len <= self.max_sys_len and req.question_tokens <= self.question_tokens)


@dataclass(frozen=True)
class RequestShape:
    """One request of a cached-chunk prefill step: its context and the question tokens it computes."""
    sys_len: int
    chunk_lens: tuple[int, ...]
    question_tokens: int


@dataclass(frozen=True)
class BucketGrid:
    backend: str
    buckets: tuple[Bucket, ...]
    """Smallest first: fewest padded tokens, then least context."""
    source: str

    @property
    def token_counts(self) -> list[int]:
        """The distinct static token counts of the buckets, ascending."""
        return sorted({b.num_tokens for b in self.buckets})

    def bucket_for(self, requests: list[RequestShape]) -> Bucket | None:
        """The smallest bucket holding every request, or None (no bucket holds the step)."""
        return next((b for b in self.buckets if len(requests) <= b.batch and all(b.holds(r) for r in requests)),
                    None)


def load_grid(name_or_path: str) -> BucketGrid:
    """Reads a grid by name (``cpu`` -> ``graph_templates/cpu.toml``) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = GRID_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in GRID_DIR.glob("*.toml"))
        raise ConfigError(f"graphchunk.templates: grid {name_or_path!r} not found (no file {path}); "
                          f"shipped grids: {known}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"graphchunk.templates: grid {path}: {exc}") from exc
    return parse_grid(raw, str(path))


def parse_grid(raw: dict, source: str) -> BucketGrid:
    if "checked" in raw:
        raise ConfigError(f"{source}: key 'checked' was removed with graphchunk's own graph templates "
                          f"(vLLM's graphs replay the buckets); delete it")
    unknown = sorted(set(raw) - {"backend", "grid", "platform", "notes"})
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known: backend, grid, platform, notes")
    backend = raw.get("backend", BACKEND)
    if backend == "torchair":
        raise ConfigError(f"{source}: backend 'torchair' is gone (vllm-ascend dropped torchair graph mode in "
                          f"v0.12.0rc1); use backend 'vllm' (vllm-ascend's ACL graphs)")
    if backend != BACKEND:
        raise ConfigError(f"{source}: backend {backend!r} is not supported: graphchunk's own graph templates "
                          f"were removed and vLLM's graphs replay the buckets; use backend 'vllm' (or leave "
                          f"the key out)")
    grid = raw.get("grid")
    if not isinstance(grid, dict) or sorted(grid) != sorted(AXES):
        raise ConfigError(f"{source}: [grid] must list exactly {AXES}, got {sorted(grid or {})}")
    axes = []
    for axis in AXES:
        values = grid[axis]
        if (not isinstance(values, list) or not values
                or any(not isinstance(v, int) or isinstance(v, bool) or v < (0 if axis == "max_sys_len" else 1)
                       for v in values)):
            raise ConfigError(f"{source}: grid.{axis} must be a non-empty list of positive integers, got {values!r}")
        axes.append(sorted(set(values)))
    buckets = sorted((Bucket(*shape) for shape in itertools.product(*axes)),
                     key=lambda b: (b.num_tokens, b.max_context_len, b))
    return BucketGrid(backend, tuple(buckets), source)
