"""The index of ``perf/results/``: every result file, the question its bench answers, the command
that writes it (as recorded in the file, its script's path as perf/ lays scripts out today) and the
docs pages that cite it, as a table written into ``docs/benchmarks.md`` between two markers.

    python -m perf.common.results_index           # write the table
    python -m perf.common.results_index --check   # exit 1 when the table is not current (CI)

Contract: ``rows()`` reads ``perf/results/`` and the docs only; each JSON's ``command`` is the
command that wrote it, rewritten by ``current_command`` (old flat ``perf/X.py`` paths to
``python -m perf.GROUP.MODULE``; a trailing note of the defaults dropped; ``--out``/``--plot`` pointed at the file's place in
perf/results); a plot or log beside a JSON of its name shares that JSON's row; a file that
records no command names it in ``UNRECORDED`` (or is refused: ``rows`` raises).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from perf.common import freshness
from perf.common.harness import REPO

PAGE = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results-index:begin -->", "<!-- results-index:end -->"

MOVED = {  # a script's flat path before perf/ was grouped -> its module now
    "bench_blend": "answers.bench_blend", "bench_oracle_quality": "answers.bench_oracle_quality",
    "pair_results": "answers.pair_results", "bench_serve": "serving.bench_serve",
    "bench_replicas": "serving.bench_replicas", "bench_ttft": "serving.bench_ttft", "soak": "soak.soak",
    "soak_pressure": "soak.pressure", "bench_forward_cost": "micro.bench_forward_cost",
    "bench_eviction": "micro.bench_eviction", "bench_fill_check": "micro.bench_fill_check",
}
QUESTIONS = {  # a module's group -> the question it answers (perf/README.md)
    "serving": "how much faster under my traffic?", "answers": "how close to full prefill?",
    "soak": "does it survive my clients?", "micro": "what does one piece cost?",
    "host": "what does graphchunk cost per step at my scale?",
    "gpu": "does the KV code hold on a GPU?", "contract": "which vLLM releases hold?",
}
UNRECORDED = {  # result files that record no command: (group, the command, where it is said)
    "gpu_kv.json": ("gpu", "python perf/gpu/gpu_kv.py --device cuda", "on a lent GPU machine; docs/gpu.md"),
    "gpu_kv_h100.json": ("gpu", "python perf/gpu/gpu_kv.py --device cuda --out perf/results/gpu_kv_h100.json",
                         "on a lent H100; docs/gpu.md"),
    "templates.json": ("micro", None, "a historical record: the graph templates it measured were removed "
                                      "(docs/benchmarks.md, graphchunk's own graph templates, removed)"),
    "demo_blend_context.log": ("serving", "make demo", "against a server with blend_entries context; docs/benchmarks.md"),
    "demo_blend_default.log": ("serving", "make demo", "against a server with blend's defaults; docs/benchmarks.md"),
}
FLAT = re.compile(r"(?:(?<=\s)|^)(?:(\S*python\S*)\s+)?perf/(\w+)\.py\b")


def current_command(command: str | list, name: str) -> str:
    """The recorded ``command`` as it runs today, writing ``name`` where it belongs."""
    text = command if isinstance(command, str) else shlex.join(command)
    text = re.sub(r"\s+\(defaults: [^)]*\)$", "", text)  # an early record's note of its defaults
    text = FLAT.sub(lambda m: f"{m[1] or '.venv/bin/python'} -m perf.{MOVED[m[2]]}" if m[2] in MOVED else m[0], text)
    # an argument with a newline, as bash writes it on one line: $'...\n...'
    text = re.sub(r"'([^']*\n[^']*)'", lambda m: "$'" + m[1].replace("\\", "\\\\").replace("\n", "\\n") + "'", text)
    stem = Path(name).stem
    return re.sub(r"(--out|--plot)\s+\S*/(" + re.escape(stem) + r")\.(json|png)\b",
                  lambda m: f"{m[1]} perf/results/{m[2]}.{m[3]}", text)


def group_of(command: str) -> str:
    found = re.search(r"-m perf\.(\w+)\.|perf/(\w+)/|graphchunk\.contract", command)
    if found is None:
        raise ValueError(f"no perf script in {command!r}")
    return "contract" if found[0].startswith("graphchunk") else found[1] or found[2]


def cited_by(names: list[str]) -> dict[str, list[str]]:
    """Each result file's citing pages (README.md and docs/, this index's own table left out)."""
    pages = {p.name: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    head, _, rest = pages[PAGE.name].partition(BEGIN)
    pages[PAGE.name] = head + rest.partition(END)[2]
    return {name: [page for page, text in pages.items() if name in text] for name in names}


def rows() -> list[tuple[str, list[str], str | None, str, list[str], str]]:
    """(group, the row's files, command, a note, citing pages, the code it measured: current,
    stale, pending or unrecorded, ``freshness.py``), a row per JSON (its plot and log beside it)
    and per file recorded in ``UNRECORDED``, by group then name."""
    files = sorted(f.name for f in freshness.RESULTS.iterdir() if f.is_file())
    citing, out, placed = cited_by(files), [], set()
    now, acks = freshness.code_digest(), freshness.load_acks()
    for name in files:
        if name in placed or not name.endswith(".json") and name not in UNRECORDED:
            continue
        beside = [n for n in files if n != name and Path(n).stem == Path(name).stem and n not in UNRECORDED]
        note = ""
        result = json.loads((freshness.RESULTS / name).read_text()) if name.endswith(".json") else {}
        if name in UNRECORDED:
            group, command, note = UNRECORDED[name]
        else:
            if not result.get("command"):
                raise ValueError(f"perf/results/{name} records no command: add it to UNRECORDED with its command")
            command = current_command(result["command"], name)
            group = group_of(command)
        code = freshness.verdict(result, group, now, acks)
        code = "pending" if code != "current" and name in acks["pending"] else code
        placed.update([name, *beside])
        out.append((group, [name, *beside], command, note, sorted({p for n in (name, *beside) for p in citing[n]}),
                    code))
    left = sorted(set(files) - placed)
    if left:
        raise ValueError(f"perf/results/ files in no row (no JSON of their name, not in UNRECORDED): {left}")
    order = list(QUESTIONS)
    return sorted(out, key=lambda r: (order.index(r[0]), r[1][0]))


def table(found: list) -> str:
    """The index as a Markdown table of ``rows()``' result."""
    lines = ["| question | files | command | cited in | code measured |", "|---|---|---|---|---|"]
    for group, files, command, note, pages, code in found:
        cell = f"`{command}`".replace("|", "\\|") if command else ""
        cell = f"{cell} ({note})" if command and note else cell or note
        lines.append(f"| {group}: {QUESTIONS[group]} | {', '.join(f'`{f}`' for f in files)} | {cell} | "
                     f"{', '.join(pages) or '—'} | {code} |")
    return "\n".join(lines)


def render(page: str, found: list | None = None) -> str:
    """``page`` with its index replaced by the table of ``found`` (``rows()`` when not given)."""
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        raise ValueError(f"{PAGE} lacks the markers {BEGIN} ... {END}")
    return f"{head}{BEGIN}\n{table(rows() if found is None else found)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md's table is not current")
    args = parser.parse_args(argv)
    page, found = PAGE.read_text(), rows()
    want = render(page, found)
    if args.check:
        if want != page:
            print(f"{PAGE.relative_to(REPO)}: the results index is stale; run python -m perf.common.results_index")
            return 1
        return 0
    PAGE.write_text(want)
    print(f"wrote the index of {len(found)} results rows into {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
