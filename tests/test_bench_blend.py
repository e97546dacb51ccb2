"""CI-sized run of ``perf/answers/bench_blend.py`` (``--quick``): the benchmark that decides works end to end.

One run, as a user runs it (its ``main``, in this process: ``inprocess``): ``--quick`` (4 prompts,
one of each task family: ``fact``, ``paraphrase``, ``two_hop``, ``which_doc``; 3 documents of ~80
tokens, a 14-token continuation) with vanilla, the question-aware policy (the default's, the
baseline) and cacheblend r=1 (the exactness anchor), on the tiny Llama checkpoint (random weights:
the anchors are logprob distances, which need no trained model), ``--enforce-eager`` (vLLM's compile
would take longer than the run); each further setting runs through the same loop, so the others
(isolated, blend none) run in the benchmark's own ``--quick`` and the settings' refinements (key
temperature, scoring depth) are checked as the extra_args they send. Asserts that it exits 0 with
its checks passed, that every setting has a row over every prompt with each metric and its 95 %
bootstrap interval around it (overall and per task family), and that the exactness anchors hold:
vanilla against itself and cacheblend r=1 against vanilla stay below ``FULL_KL_TOL``. Quality and
timings are not asserted (four prompts decide nothing).
"""
from __future__ import annotations

import json

import pytest

from inprocess import run_main
from perf.answers import bench_blend
from perf.answers.blend_metrics import FULL_KL_TOL, METRICS, paired
from perf.answers.blend_task import TASK_KINDS, one_setting

pytestmark = pytest.mark.slow

SETTINGS = ["vanilla", "question r=0.3", "cacheblend r=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_blend")
    argv = ["--quick", "--model", "tiny-llama3", "--enforce-eager", "--settings",
            "vanilla,question:0.3,cacheblend:1.0", "--baseline", "question:0.3", "--out", str(out / "blend.json"),
            "--plot", str(out / "blend.png")]
    proc = run_main(bench_blend.main, argv, ["python", "-m", "perf.answers.bench_blend"])
    print(proc.stdout)
    result = json.loads((out / "blend.json").read_text()) if (out / "blend.json").exists() else None
    return proc, result, out


def _tail(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def test_exits_0_with_checks_passed(run):
    proc, result, out = run
    assert proc.returncode == 0, _tail(proc)
    assert result["checks_passed"] and not result["failures"], result["failures"]
    assert (out / "blend.png").stat().st_size > 0


def test_every_setting_has_every_prompt(run):
    _, result, _ = run
    n = result["config"]["prompts"]
    assert n == len(TASK_KINDS) and result["config"]["enforce_eager"] is True
    assert [row["label"] for row in result["rows"]] == SETTINGS
    for row in result["rows"]:
        assert row["n_prompts"] == n and not row["failed"], row["label"]
        assert len(row["per_prompt"]["kl"]) == n and row["ttft_ms"] > 0 and row["ttft_ms_all_hit"] > 0


def _check_interval(where: str, stats: dict) -> None:
    for metric in METRICS:
        value, ci = stats[metric], stats[metric + "_ci"]
        assert value is not None and len(ci) == 2, (where, metric, stats)
        assert ci[0] <= value <= ci[1], (where, metric, value, ci)


def test_every_metric_has_its_interval(run):
    _, result, _ = run
    for row in result["rows"]:
        _check_interval(row["label"], row)
        for kind in TASK_KINDS:
            assert row["by_task"][kind]["n_prompts"] == 1, (row["label"], kind)
            _check_interval(f"{row['label']} {kind}", row["by_task"][kind])
        assert 0 <= row["top1_agreement"] <= 1 and 0 <= row["exact_match"] <= 1


def test_every_task_family_with_gold_documents(run):
    _, result, _ = run
    tasks = result["tasks"]
    assert sorted(t["kind"] for t in tasks) == sorted(TASK_KINDS)
    for t in tasks:
        assert len(t["gold_docs"]) == (2 if t["kind"] == "two_hop" else 1), t
        assert len(set(t["gold_docs"])) == len(t["gold_docs"]), t
        assert t["distractors"] and all(d["doc"] not in t["gold_docs"] for d in t["distractors"]), t
        if t["kind"] == "which_doc":
            assert t["answer"] == t["titles"][t["gold_docs"][0]], t


def test_full_recompute_and_vanilla_match_full_prefill(run):
    _, result, _ = run
    rows = {row["label"]: row for row in result["rows"]}
    assert abs(rows["vanilla"]["kl"]) < FULL_KL_TOL, rows["vanilla"]["per_prompt"]["kl"]
    assert abs(rows["cacheblend r=1"]["kl"]) < FULL_KL_TOL, rows["cacheblend r=1"]["per_prompt"]["kl"]


def test_every_other_setting_is_paired_with_the_baseline(run):
    _, result, _ = run
    rows = {row["label"]: row for row in result["rows"]}
    base = rows.pop("question r=0.3")
    assert "vs_baseline" not in base
    for label, row in rows.items():
        pair = row["vs_baseline"]
        assert pair["baseline"] == "question r=0.3" and pair["n_prompts"] == result["config"]["prompts"], label
        expected = sum(a - b for a, b in zip(row["per_prompt"]["kl"], base["per_prompt"]["kl"])) / pair["n_prompts"]
        assert pair["kl_delta"] == pytest.approx(expected) and pair["kl_delta_ci"][0] <= expected <= pair["kl_delta_ci"][1]


def test_paired_differences_match_prompts_not_positions():
    """A setting's prompts in another order (or some missing) are paired by prompt index."""
    def row(label, prompts, kl, em):
        return {"label": label, "n_prompts": len(prompts),
                "per_prompt": {"prompt": prompts, "kl": kl, "exact_match": em}}

    rows = [row("base", [0, 1, 2], [0.1, 0.2, 0.3], [1, 0, 1]), row("other", [2, 0], [0.5, 0.1], [0, 1])]
    paired(rows, "base")
    pair = rows[1]["vs_baseline"]
    assert pair["n_prompts"] == 2 and pair["kl_delta"] == pytest.approx(0.1) and pair["exact_match_delta"] == -0.5
    assert "vs_baseline" not in rows[0]


def test_a_settings_refinements_are_the_extra_args_it_sends():
    """A refined setting is its label and the engine's per-request extra_args (what a row records)."""
    from graphchunk.engine.request_args import LAYERS_ARG, TEMPERATURE_ARG

    hot = one_setting("isolated:0.8")
    assert hot.label == "isolated T=0.8" and hot.extra == {"graphchunk_mode": "isolated", TEMPERATURE_ARG: 0.8}
    shallow = one_setting("question:0.3@2")
    assert shallow.label == "question r=0.3 L=2" and shallow.extra[LAYERS_ARG] == 2
    assert shallow.extra["graphchunk_recompute_ratio"] == 0.3 and shallow.extra["graphchunk_recompute"] == "question"
    # A label names its block: single tokens unless it says xB, whatever the deployment's default.
    assert shallow.extra["graphchunk_recompute_block"] == 1
    blocks = one_setting("question:0.15+4@2x16/chunk")
    assert blocks.label == "question r=0.15 s=4 L=2 B=16 /chunk" and blocks.extra["graphchunk_recompute_block"] == 16
