"""The scale benchmark of graphchunk's host cost per step (``perf/host/bench_host_scale.py``) end to end
at its smallest: vLLM's own scheduler with and without graphchunk's connector, the worker's host path
over a null device, 8 running requests over 100 pool entries, isolated and blend, every phase. Only
the result's structure is asserted, never a timing: the acceptance's verdicts are checked on made-up
configurations (``test_acceptance_reads_the_criteria``)."""
from __future__ import annotations

import json

from inprocess import run_main
from perf.host import bench_host_scale as bench
from perf.host import report

PHASE_FIELDS = {"vllm_own_ms", "connector_ms", "worker_host_ms", "total_ms", "connector_ratio", "worker_ratio",
                "running_mean", "waiting_mean", "admitted", "finished", "fills", "pseudo_seqs", "scored_seqs",
                "connector_by_method_ms_p50"}


def test_quick_run_has_every_phase_and_field(tmp_path, smollm2_path):
    out, png = tmp_path / "host_scale.json", tmp_path / "host_scale.png"
    argv = ["--quick", "--running", "8", "--entries", "100", "--decode-steps", "3", "--steady-steps", "3",
            "--model", str(smollm2_path), "--label", "before", "--out", str(out), "--plot", str(png)]
    done = run_main(bench.main, argv, ["python", "-m", "perf.host.bench_host_scale"])  # in this process
    assert done.returncode == 0 and out.exists() and png.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["labels"] == ["before"] and "perf.host.bench_host_scale" in result["command"]
    run = result["runs"]["before"]
    assert run["graphchunk"]["path"] and run["environment"]["vllm"]
    assert [(c["mode"], c["running"], c["entries"]) for c in run["configs"]] == \
        [("isolated", 8, 100), ("blend", 8, 100)]
    vanilla = run["vanilla"]["8"]["phases"]
    assert vanilla["admission"]["admitted"] == 8 and vanilla["decode"]["steps"] == 3 and vanilla["steady"]["steps"] == 3
    for config in run["configs"]:
        assert config["pool"]["entries"] == 101  # every document and the system prompt
        phases = config["phases"]
        assert set(phases) == {"admission", "decode", "steady"}
        for name, phase in phases.items():
            assert PHASE_FIELDS <= set(phase), (name, set(phase))
            for field in ("vllm_own_ms", "connector_ms", "worker_host_ms", "total_ms"):
                assert set(phase[field]) >= {"p50", "p99", "mean", "max", "n"} and phase[field]["n"] == phase["steps"]
            assert phase["connector_ms"]["p50"] > 0 and phase["worker_host_ms"]["p50"] > 0  # each step calls both
            assert "build_connector_meta" in phase["connector_by_method_ms_p50"]
            assert config[f"connector_ratio_{name}"] == phase["connector_ratio"]
            assert config["vanilla_ms_p50"][name] == vanilla[name]["total_ms"]["p50"]
        admission, decode, steady = phases["admission"], phases["decode"], phases["steady"]
        assert admission["admitted"] == admission["fills"] == 8 and admission["running_mean"] <= 8
        assert decode["steps"] == 3 and decode["running_mean"] == 8 and decode["admitted"] == decode["finished"] == 0
        assert steady["steps"] == 3 and steady["finished"] > 0 and steady["admitted"] > 0  # replaced at once
        assert admission["worker_host_ms_per_admitted_request"] > 0
        if config["mode"] == "blend":  # one request a step under the recompute budget; scattered picks
            assert admission["steps"] == 8 and admission["scored_seqs"] == 8
            assert admission["pseudo_seqs_per_admitted_request"] > 8
        else:
            assert admission["pseudo_seqs"] == admission["scored_seqs"] == 0
    assert [(f["mode"], f["entries"], f["worker_us_per_running_request"]) for f in run["fits"]] == \
        [("blend", 100, None), ("isolated", 100, None)]  # one running count: no slope
    verdicts = run["acceptance"]
    assert verdicts["passed"] is None and verdicts["connector_ratio"] == []
    assert verdicts["criteria"] == report.ACCEPTANCE

    merged = bench.merge(out, "after", run)  # a second label keeps the first; the command is the 'after' run's
    assert merged["labels"] == ["after", "before"] and merged["runs"]["before"] == run
    report.plot(merged, tmp_path / "both.png")
    assert (tmp_path / "both.png").stat().st_size > 0


def phase(connector: float, own: float, worker: float = 0.1) -> dict:
    return dict(steps=5, connector_ms={"p50": connector}, vllm_own_ms={"p50": own}, worker_host_ms={"p50": worker})


def config(mode, running, entries, decode, steady, worker=0.1) -> dict:
    d, s = phase(decode, 1.0, worker), phase(steady, 1.0)
    return dict(mode=mode, running=running, entries=entries, phases=dict(decode=d, steady=s),
                connector_ratio_decode=decode, connector_ratio_steady=steady)


def test_acceptance_reads_the_criteria():
    configs = [config("isolated", r, e, 0.05, 0.2, worker=0.1 + 0.001 * r)
               for r in (256, 1024) for e in (1000, 100000)]
    fits = report.fit_slopes(configs)
    assert [(f["mode"], f["entries"], f["running"]) for f in fits] == [("isolated", 1000, [256, 1024]),
                                                                      ("isolated", 100000, [256, 1024])]
    assert all(abs(f["worker_us_per_running_request"] - 1.0) < 1e-6 for f in fits)  # 0.001 ms a request
    verdict = report.acceptance(configs, fits)
    assert [(r["running"], r["entries"]) for r in verdict["connector_ratio"]] == [(256, 100000), (1024, 100000)]
    assert verdict["passed"] is True and len(verdict["pool_growth"]) == 4
    worse = configs[:-1] + [config("isolated", 1024, 100000, 0.2, 0.2, worker=0.1 + 0.003 * 1024)]
    verdict = report.acceptance(worse, report.fit_slopes(worse))
    assert verdict["connector_ratio_ok"] is False and verdict["pool_growth_ok"] is False
    assert verdict["worker_slope_ok"] is False and verdict["passed"] is False
