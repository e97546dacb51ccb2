"""MkDocs hook: the pages' generated parts, from the code that defines them (never written twice).

``<!-- settings -->`` becomes the table of ``GraphChunkConfig``'s fields (key, default, the
field's docstring); ``<!-- metrics -->`` the table of ``graphchunk.metrics.SCHEMA`` (the name as
/metrics exports it, its kind, its help text); ``<!-- quality: perf/results/X.json -->`` the
table of a ``perf/answers/bench_blend.py`` result (exact match per setting and family, its paired
difference to full prefill, KL, all-hit TTFT); ``<!-- serving: perf/results/X.json -->`` the table
of a ``perf/serving/bench_serve.py`` result (every server and pass: requests per second and time to
first token against vanilla's same pass, TPOT, hit rates, preemptions). Run by ``mkdocs build``
(``mkdocs.yml``: hooks).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path

from graphchunk import metrics
from graphchunk.config import GraphChunkConfig


def field_docs(cls) -> dict[str, str]:
    """Each dataclass field's docstring: the string literal right after its annotated assignment."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table() -> str:
    docs = field_docs(GraphChunkConfig)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(GraphChunkConfig):
        rows.append(f"| `{f.name}` | `{json.dumps(f.default)}` | {_cell(docs[f.name])} |")
    return "\n".join(rows)


def metrics_table() -> str:
    rows = ["| metric | kind | meaning |", "|---|---|---|"]
    for name in metrics.EXPORTED:
        kind, help_text = metrics.SCHEMA[name]
        exported = metrics.PROMETHEUS_PREFIX + name + ("_total" if kind == "counter" else "")
        rows.append(f"| `{exported}` | {kind} | {_cell(help_text)} |")
    return "\n".join(rows)


def _interval(ci) -> str:
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def quality_table(result_path: Path) -> str:
    """A bench_blend result as a table: every setting's answers against full prefill, and its speed;
    with a baseline (``--baseline``), each setting's paired differences from it."""
    result = json.loads(result_path.read_text())
    families = list(result["rows"][0]["by_task"])
    baseline = next((r["vs_baseline"]["baseline"] for r in result["rows"] if "vs_baseline" in r), None)
    paired = [f"KL − {baseline} [95 %]", f"EM − {baseline} [95 %]"] if baseline else []
    rows = ["| setting | exact match | EM − full prefill [95 %] | " + " | ".join(families)
            + " | KL, continuation | " + "".join(f"{p} | " for p in paired) + "all-hit TTFT ms | x full prefill |",
            "|---" * (6 + len(families) + len(paired)) + "|"]
    for r in result["rows"]:
        per_family = " | ".join(f"{r['by_task'][f]['exact_match']:.2f}" for f in families)
        pair = r.get("vs_baseline")
        vs = (f"{pair['kl_delta']:+.3f} [{pair['kl_delta_ci'][0]:+.3f}, {pair['kl_delta_ci'][1]:+.3f}] | "
              f"{pair['exact_match_delta']:+.2f} {_interval(pair['exact_match_delta_ci'])} | " if pair
              else "baseline | baseline | " if baseline else "")
        rows.append(f"| {r['label']} | {r['exact_match']:.2f} | {r['exact_match_delta']:+.2f} "
                    f"{_interval(r['exact_match_delta_ci'])} | {per_family} | {r['kl']:.3g} | {vs}"
                    f"{r['ttft_ms_all_hit']:.0f} | {r['ttft_all_hit_over_full_prefill']:.2f} |")
    return "\n".join(rows)


REPO = Path(__file__).resolve().parents[1]
GENERATED = {"<!-- settings -->": settings_table, "<!-- metrics -->": metrics_table}


def serving_table(result_path: Path) -> str:
    """A bench_serve result as a table: a row per server kind and pass, by concurrency."""
    result = json.loads(result_path.read_text())

    def times(row, key):
        ratio = (row.get("vs_vanilla") or {}).get(key)
        return f" ({ratio:.2f}x)" if ratio else ""

    rows = ["| c | server | pass | req/s (x vanilla) | p50 TTFT ms (x faster) | p99 TTFT ms | p50 TPOT ms | "
            "chunk hit rate | prefix-cache hit rate | preemptions |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(result["rows"], key=lambda r: r["concurrency"]):
        cache = row["cache"]
        hit, preempted = cache.get("chunk_hit_rate"), cache.get("preemptions")
        rows.append(f"| {row['concurrency']} | {row['kind']} | {row['phase']} | {row['request_throughput']:.2f}"
                    f"{times(row, 'request_throughput')} | {row['ttft_ms']['p50']:.0f}{times(row, 'ttft_p50_speedup')} | "
                    f"{row['ttft_ms']['p99']:.0f} | {row['tpot_ms']['p50']:.0f} | "
                    f"{'' if hit is None else f'{hit:.2f}'} | {cache.get('prefix_cache_hit_rate') or 0:.2f} | "
                    f"{'' if preempted is None else f'{preempted:.0f}'} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    markdown = re.sub(r"<!-- serving: (\S+) -->", lambda m: serving_table(REPO / m.group(1)), markdown)
    return re.sub(r"<!-- quality: (\S+) -->", lambda m: quality_table(REPO / m.group(1)), markdown)
