"""CI-sized run of ``perf/answers/bench_oracle_quality.py`` (``--quick``): the oracle's quality benchmark
works end to end. One run as a user runs it (its ``main``, in this process: ``inprocess``; 4 prompts,
one per task family, 3 documents of ~80 tokens; ``SETTINGS``, the ones asserted here) on the tiny Llama
checkpoint (random weights: 8 s, against ~2 minutes on SmolLM2): it exits 0 with its checks passed,
every setting has a row over every prompt with exact match, KL and their 95 % intervals around them
(overall and per family), full prefill is its own reference and recomputing every chunk token equals
it. Quality is not asserted (four prompts decide nothing, and the tiny model answers nothing right)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from inprocess import run_main
from perf.answers import bench_oracle_quality
from perf.answers.blend_metrics import FULL_KL_TOL
from perf.answers.rag_tasks import FAMILIES

pytestmark = pytest.mark.slow

SETTINGS = ["full", "isolated", "ape:0.9:0.9", "ape-prefix:0.9:0.9", "question:0.15", "question:0.15/prefix",
            "blocks:0.15:16", "recompute:1", "recompute:1/prefix"]
"""``--quick``'s settings less blend's naive reuse and LegoLink (nothing here asserts of them; they
run through the same loop as question:0.15 in the benchmark's own ``--quick``)."""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle_quality")
    argv = ["--quick", "--model", "tiny-llama3", "--settings", ",".join(SETTINGS), "--out", str(out / "q.json"), "--plot", str(out / "q.png")]
    proc = run_main(bench_oracle_quality.main, argv, ["python", "-m", "perf.answers.bench_oracle_quality"])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert (out / "q.png").stat().st_size > 0
    return json.loads((out / "q.json").read_text())


def test_every_setting_has_every_prompt_and_family(result):
    assert result["checks_passed"] and not result["failures"]
    (run,) = result["lengths"]
    labels = [row["label"] for row in run["rows"]]
    assert labels[0] == "full" and sorted(labels) == sorted(SETTINGS)
    for row in run["rows"]:
        assert row["n_prompts"] == len(FAMILIES) and set(row["by_family"]) == set(FAMILIES), row["label"]
        for stats in [row, *row["by_family"].values()]:
            for metric in ("exact_match", "exact_match_delta", "kl", "kl_first"):
                lo, hi = stats[metric + "_ci"]
                assert lo <= stats[metric] <= hi, (row["label"], metric)


def test_full_prefill_is_the_reference_and_full_recompute_equals_it(result):
    rows = {row["label"]: row for row in result["lengths"][0]["rows"]}
    assert rows["full"]["exact_match_delta"] == 0 and abs(rows["full"]["kl"]) < FULL_KL_TOL
    assert abs(rows["recompute:1"]["kl"]) < FULL_KL_TOL
    assert rows["recompute:1"]["per_prompt"]["answer"] == rows["full"]["per_prompt"]["answer"]
    assert abs(rows["recompute:1/prefix"]["kl"]) < FULL_KL_TOL  # every chunk token recomputed: no prefix left


def test_a_fixed_prefix_changes_blend_and_rows_pair_with_the_baseline(result):
    """``/prefix`` settings compute chunks after ``--blend-prefix`` (another context than alone);
    every row carries its prompt-by-prompt difference to ``--baseline`` (zero for the baseline)."""
    rows = {row["label"]: row for row in result["lengths"][0]["rows"]}
    assert result["config"]["blend_prefix"] and result["config"]["baseline"] == "question:0.15"
    assert rows["question:0.15/prefix"]["per_prompt"]["kl"] != rows["question:0.15"]["per_prompt"]["kl"]
    for row in rows.values():
        pair = row["vs_baseline"]
        assert pair["label"] == "question:0.15" and pair["n_prompts"] == row["n_prompts"]
        mine, base = np.asarray(row["per_prompt"]["kl"]), np.asarray(rows["question:0.15"]["per_prompt"]["kl"])
        assert pair["kl_delta"] == pytest.approx(float((mine - base).mean()))
    assert rows["question:0.15"]["vs_baseline"]["kl_delta"] == 0


def test_blocks_recompute_as_many_tokens_in_fewer_runs(result):
    """``blocks:R:B`` recomputes as many chunk tokens as ``question:R``, in runs of consecutive tokens
    (its pseudo-sequences) no more than its blocks, and never more runs than scattered picks."""
    rows = {row["label"]: row for row in result["lengths"][0]["rows"]}
    blocks, question = rows["blocks:0.15:16"]["per_prompt"], rows["question:0.15"]["per_prompt"]
    assert blocks["recomputed"] == question["recomputed"] and min(blocks["recomputed"]) > 0
    for runs, n, scattered in zip(blocks["runs"], blocks["recomputed"], question["runs"]):
        assert runs <= -(-n // 16) + 1 + 8 and runs <= scattered  # blocks: 16 tokens, each chunk's last shorter
    assert rows["full"]["runs_mean"] == 0 and rows["recompute:1"]["runs_mean"] >= 1


def test_block_tokens_take_the_highest_blocks_and_cut_the_last():
    from graphchunk.layout import Layout

    layout = Layout(2, (5, 4), 1)  # chunks [2, 7) and [7, 11); blocks of 2: [2,4) [4,6) [6,7) [7,9) [9,11)
    scores = np.array([0, 1, 5, 0, 9, 0, 3, 3, 0])  # per chunk token from index 2
    # block sums 1, 5, 9, 3, 3: [6, 7) whole, [4, 6) whole, then the first two of [7, 9)
    assert bench_oracle_quality.block_tokens(layout, scores, 5, 2) == [4, 5, 6, 7, 8]
    assert bench_oracle_quality.block_tokens(layout, scores, 2, 2) == [4, 6]  # [6, 7), then [4, 6) cut to one
    assert bench_oracle_quality.runs_of([4, 5, 6, 7, 8]) == 1 and bench_oracle_quality.runs_of([4, 6]) == 2
    assert bench_oracle_quality.runs_of([]) == 0
