"""``perf/answers/pair_results.py``: rows of two bench_blend results paired prompt by prompt, only over the same prompts."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from perf.answers import pair_results


def result(kl, em):
    """A bench_blend result of three prompts and one row, ``label``."""
    per = {"prompt": [0, 1, 2], "kl": kl, "exact_match": em}
    return {"tasks": [{"index": i, "question": f"q{i}"} for i in range(3)],
            "reference": [{"prompt": i, "prompt_tokens": 100 + i, "continuation": [i, 7]} for i in range(3)],
            "rows": [{"label": "question r=0.3", "kl": sum(kl) / 3, "exact_match": sum(em) / 3, "per_prompt": per}]}


def test_pairs_prompt_by_prompt_and_refuses_other_prompts(tmp_path):
    base, other = result([0.1, 0.2, 0.3], [1, 0, 0]), result([0.1, 0.1, 0.1], [1, 1, 0])
    paths = [tmp_path / "base.json", tmp_path / "other.json", tmp_path / "out.json"]
    for path, data in zip(paths, (base, other)):
        path.write_text(json.dumps(data))
    label = "question r=0.3"
    assert pair_results.main([str(paths[0]), label, str(paths[1]), label, "--out", str(paths[2])]) == 0
    row = json.loads(paths[2].read_text())["rows"][0]
    assert row["n_prompts"] == 3 and row["kl_delta"] == pytest.approx(-0.1) and row["exact_match_delta"] == \
        pytest.approx(1 / 3)
    moved = copy.deepcopy(other)
    moved["reference"][1]["continuation"] = [9, 9]
    paths[1].write_text(json.dumps(moved))
    with pytest.raises(SystemExit, match="not the same prompts"):
        pair_results.main([str(paths[0]), label, str(paths[1]), label, "--out", str(paths[2])])
