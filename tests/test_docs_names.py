"""The names the README and the docs pages give exist in the code: a renamed or removed setting,
metric or request argument fails here, not in a user's hands.

Read from every page as text: ``graphchunk_*`` words are /metrics names (``graphchunk_`` + a field
of ``metrics.SCHEMA``, ``_total`` added to counters) or request and document fields (the string
constants of ``engine/request_args.py``, ``engine/frontend.py`` and ``documents.py``); the keys of
every ``{"graphchunk": {...}}`` object and every ``graphchunk.NAME`` that is not a module are
``GraphChunkConfig`` fields. A known limit's refusal is tested where it is raised (tests/test_worker_config.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from graphchunk import metrics
from graphchunk.config import GraphChunkConfig

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(["README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
SETTINGS = {field.name for field in dataclasses.fields(GraphChunkConfig)}


def metric_names() -> set[str]:
    names = set()
    for name in metrics.EXPORTED:
        names.add(f"graphchunk_{name}" + ("_total" if metrics.SCHEMA[name][0] == "counter" else ""))
    return names


def field_names() -> set[str]:
    """The request arguments and document fields graphchunk reads: its modules' string constants."""
    found = set()
    for module in ("graphchunk.engine.request_args", "graphchunk.engine.frontend", "graphchunk.documents"):
        found |= {value for value in vars(importlib.import_module(module)).values()
                  if isinstance(value, str) and re.fullmatch(r"graphchunk_\w+", value)}
    return found


def names_in(text: str) -> tuple[set[str], set[str]]:
    """(graphchunk_* words, setting names) a page gives."""
    words = set(re.findall(r"\bgraphchunk_[a-z0-9_]+", text))
    settings = {key for block in re.findall(r'"graphchunk":\s*\{([^{}]*)\}', text)
                for key in re.findall(r'"(\w+)"\s*:', block)}
    settings |= {name for name in re.findall(r"\bgraphchunk\.([a-z_]+)\b", text)
                 if importlib.util.find_spec(f"graphchunk.{name}") is None}
    return words, settings


@pytest.mark.parametrize("page", PAGES)
def test_every_name_a_page_gives_exists(page):
    words, settings = names_in((REPO / page).read_text())
    known = metric_names() | field_names()
    assert not words - known, f"{page} names {sorted(words - known)}: no metric, request argument or document field"
    assert not settings - SETTINGS, f"{page} names settings {sorted(settings - SETTINGS)} GraphChunkConfig lacks"


def test_the_check_catches_a_stale_name():
    words, settings = names_in('Watch `graphchunk_hits_total` and `graphchunk_hitz_total`; set '
                               '`{"graphchunk": {"pool_tokens": 1, "pool_tokenz": 2}}` and graphchunk.store_pathz '
                               '(graphchunk.tools is a module).')
    assert words - (metric_names() | field_names()) == {"graphchunk_hitz_total"}
    assert settings - SETTINGS == {"pool_tokenz", "store_pathz"}
