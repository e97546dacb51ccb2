"""perf/ as a newcomer meets it: the results index in docs/benchmarks.md is current, and every
perf command the README, the docs and perf/'s READMEs show (the index's rows included) names a
script that exists and whose own parser accepts the arguments as written.

A command is checked short of running it: its module is imported and its ``main`` called with the
arguments, with argparse's ``parse_args`` stopped right after it parsed them.
"""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from perf.common import freshness, results_index

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(["README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
                *(str(p.relative_to(REPO)) for p in (REPO / "perf").rglob("README.md"))])
COMMAND = re.compile(r"python[\w.]* -m (perf(?:\.[a-z_]+)+)([^\n`#|&>;]*)")


class Parsed(Exception):
    pass


def commands(text: str) -> list[tuple[str, str]]:
    """(module, arguments) of each ``python -m perf...`` in a page (continued lines joined)."""
    text = re.sub(r"\\\n\s*", " ", text)
    return [(m[1], m[2].strip()) for m in COMMAND.finditer(text)]


def test_the_results_index_is_current():
    page = results_index.PAGE.read_text()
    assert results_index.render(page) == page, "docs/benchmarks.md's index is stale: python -m perf.common.results_index"


def test_every_result_file_has_a_row():
    named = {f for _, files, *_ in results_index.rows() for f in files}
    assert named == {f.name for f in freshness.RESULTS.iterdir() if f.is_file()}


def test_an_unknown_result_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "mystery.png").write_bytes(b"")
    monkeypatch.setattr(freshness, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="mystery.png"):
        results_index.rows()


def test_recorded_commands_run_from_today_s_layout():
    old = ".venv/bin/python perf/soak_pressure.py --mode both --out /tmp/x/soak_pressure.json  (defaults: --seed 0)"
    assert results_index.current_command(old, "soak_pressure.json") == \
        ".venv/bin/python -m perf.soak.pressure --mode both --out perf/results/soak_pressure.json"
    assert results_index.current_command(["perf/bench_fill_check.py", "--out", "a b.json"], "fill_check.json") == \
        ".venv/bin/python -m perf.micro.bench_fill_check --out 'a b.json'"


ALL = sorted({(page, *c) for page in PAGES for c in commands((REPO / page).read_text())})


def test_the_pages_show_perf_commands():
    pages = {page for page, *_ in ALL}
    assert {"docs/benchmarks.md", "docs/quality.md", "perf/README.md"} <= pages, pages


@pytest.mark.parametrize("page,module,args", ALL, ids=[f"{p}:{m}:{i}" for i, (p, m, _) in enumerate(ALL)])
def test_every_perf_command_parses_as_written(page, module, args, monkeypatch):
    script = importlib.import_module(module)
    parse = argparse.ArgumentParser.parse_args

    def parsed(self, argv=None, namespace=None):
        raise Parsed(parse(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setenv("PYTHONPATH", "")
    with pytest.raises(Parsed):
        script.main(shlex.split(args))
