"""graphchunk's configuration, validated once at start-up.

Given to vLLM as ``--additional-config '{"graphchunk": {...}}'`` (or ``additional_config=`` in
Python); every key is optional.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

MODES = ("isolated", "blend")


class ConfigError(ValueError):
    """A graphchunk setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class GraphChunkConfig:
    separator: str = "##"
    """Text that splits a prompt into sys / chunks / question; '' turns separator detection off."""
    max_chunks: int = 32
    """Most chunks one prompt may have."""
    max_chunk_len: int = 2048
    """Most tokens one chunk may have (separator tokens included)."""
    pool_tokens: int = 65536
    """Chunk-pool budget in tokens of KV (rounded up to whole blocks)."""
    mode: str = "isolated"
    """'isolated' (exact, DESIGN.md §2) or 'blend' (approximate reuse)."""
    templates: str = ""
    """Graph-template grid captured at start-up: a name in graph_templates/ ('cpu') or a .toml path;
    '' runs every step eager."""

    def __post_init__(self):
        for name, kind in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ConfigError(f"graphchunk.{name} must be {kind.__name__}, got {value!r}")
        for name in ("max_chunks", "max_chunk_len", "pool_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"graphchunk.{name} must be >= 1, got {getattr(self, name)}")
        if self.mode not in MODES:
            raise ConfigError(f"graphchunk.mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "GraphChunkConfig":
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown graphchunk setting(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_additional_config(cls, additional_config: dict[str, Any] | None) -> "GraphChunkConfig":
        """Reads the ``graphchunk`` section of vLLM's ``additional_config``."""
        section = (additional_config or {}).get("graphchunk", {})
        if not isinstance(section, dict):
            raise ConfigError(f"additional_config['graphchunk'] must be a dict, got {section!r}")
        return cls.from_dict(section)


_TYPES = {"separator": str, "max_chunks": int, "max_chunk_len": int, "pool_tokens": int, "mode": str, "templates": str}
