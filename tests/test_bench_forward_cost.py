"""The forward-cost measurement end to end at its ``--quick`` size (``perf/micro/bench_forward_cost.py``):
every path (compiled, plain, scoring pass, split and batched) timed inside a real engine's worker
at every size, a line fitted per path, the borrowed pool blocks given back. No timing is asserted,
so the engine runs ``--enforce-eager`` (vLLM's compile would take ~40 s of CI; the forward under
vLLM's compilation is tests/test_compiled_forward.py's, on the session engine)."""
from __future__ import annotations

import json

import pytest

from inprocess import run_main
from perf.micro import bench_forward_cost

pytestmark = pytest.mark.slow


def test_quick_run_measures_every_path(tmp_path):
    out = tmp_path / "forward_cost.json"
    done = run_main(bench_forward_cost.main, ["--quick", "--enforce-eager", "--out", str(out)],
                    ["python", "-m", "perf.micro.bench_forward_cost"])  # in this process: ``inprocess``
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    sizes = [str(n) for n in result["config"]["tokens"]]
    for path in ("compiled", "plain", "scoring"):
        assert list(result["ms"][path]) == sizes and all(t > 0 for t in result["ms"][path].values())
        assert set(result["fit"][path]) >= {"per_forward_ms", "per_token_ms", "max_relative_residual"}
    split = result["config"]["split"]
    assert list(result["ms"]["split_batched"]) == [n for n in sizes if int(n) % split == 0]
    copies = result["copies"]
    assert copies["slots"] == result["config"]["context"] and all(t > 0 for t in copies["ms"].values())
    assert "plain" in copies["ms"]
    assert result["num_layers"] == 2  # the tiny checkpoint's layers, every one hooked by the scoring pass
