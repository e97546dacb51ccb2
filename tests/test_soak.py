"""CI-sized soak (``perf/soak/soak.py``): concurrent clients over the OpenAI server with faults.

The tiny Llama-llama3 checkpoint in fp32 (fast on two cores), a few hundred requests from 6
client threads over 40 documents of CPython help-topic text with Zipf popularity, a chunk pool an
eighth of the working set, client disconnects mid-stream / before the first token / before any
response byte, one server restart with a truncated tier file planted while it is down, one tier
file corrupted while traffic runs. Asserts the soak's invariants: every completed request checked
is token-for-token the HF oracle's, no request failed, the server is alive and correct afterwards,
its memory is bounded, aborts happened, it restarted once, the persistent tier survived the
restart, both planted corruptions were rejected and recomputed (the canary request's answers
checked against the oracle), the pool's accounting is exact at the end
(``graphchunk_pool_refs_held`` and ``graphchunk_pool_blocks_leaked`` 0) and vLLM's KV cache given
back (``vllm:kv_cache_usage_perc`` 0 once drained), and the tier stays within
its budget. Nothing here depends on timing: faults happen at trace positions, and every wait
polls a condition against a deadline.

The full-size run (SmolLM2, thousands of requests, vanilla vLLM's throughput on the same trace)
is ``perf/soak/soak.py``'s default; README "Soak" has the command.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import engines
from perf.soak import soak

pytestmark = pytest.mark.slow

ARGV = ["--model", "tiny-llama3", "--requests", "300", "--concurrency", "6", "--docs", "40",
        "--doc-tokens", "32,200", "--docs-per-request", "2,4", "--max-tokens", "8",
        "--abort-stream", "0.05", "--abort-prefill", "0.05", "--abort-nostream", "0.05",
        "--restart-at", "0.5", "--corrupt-at", "0.75", "--check", "-1", "--warmup", "30",
        "--kv-cache-bytes", str(1 << 27), "--max-model-len", "1024", "--max-num-batched-tokens", "128",
        "--store-bytes", str(256 << 20), "--throughput-requests", "0", "--startup-timeout", "600"]


def build_soak() -> engines.Ahead:
    """The soak with its first server launched ahead of this module (``engines``)."""
    log_dir = engines.scratch("soak")
    argv = [*ARGV, "--log-dir", str(log_dir), "--out", str(log_dir / "soak.json")]
    run = soak.Soak(soak.build_parser().parse_args(argv))
    return engines.Ahead((run, argv, log_dir), (run.launch(),))


soak_ahead = engines.fixture(build_soak, "soak_ahead")


@pytest.fixture(scope="module")
def result(soak_ahead):
    (run, argv, log_dir), (launched,) = soak_ahead
    found = run.run(shlex.join(["python", "-m", "perf.soak.soak", *argv]), launched)
    (log_dir / "soak.json").write_text(json.dumps(found, indent=1))
    print(json.dumps({k: v for k, v in found.items() if k not in ("memory", "per_server", "config")}, indent=1))
    return found


def _logs(result) -> str:
    tails = []
    for path in result["server_logs"]:
        lines = Path(path).read_text(errors="replace").splitlines()
        tails.append(f"--- {path}\n" + "\n".join(lines[-40:]))
    return "\n".join(tails)


def test_every_checked_output_matches_the_oracle(result):
    assert result["checked_outputs"] >= 100, result["oracle"]
    assert result["wrong_outputs"] == 0, result["oracle"]["wrong"]
    assert not result["oracle"]["tagged_not_completed"], result["alive_after"]
    # The canaries (planted corruptions) and the final request were checked too.
    tagged = result["oracle"]["tagged_checked"]
    assert tagged.get("final") in ("equal", "tie"), tagged
    for tag in ("canary-before-restart", "canary-after-restart", "canary-after-live-corruption"):
        assert tagged.get(tag) in ("equal", "tie"), tagged


def test_no_request_failed_and_the_server_survived(result):
    assert result["errors"] == 0, (result["error_samples"], _logs(result))
    assert result["invariants"]["server_alive_after"], (result["alive_after"], _logs(result))
    assert "server_died" not in result["faults"], _logs(result)


def test_faults_happened(result):
    assert result["aborts"] > 0, result["aborts_by_kind"]
    assert result["aborts_by_kind"]["abort_stream"] > 0, result["aborts_by_kind"]
    assert result["aborts_by_kind"]["abort_prefill"] + result["aborts_by_kind"]["abort_nostream"] > 0
    assert result["restarts"] == 1, result["faults"]
    assert result["evictions"] > 0  # the pool is much smaller than the working set
    assert result["pool"]["pool_over_working_set"] <= 0.2, result["pool"]


def test_memory_bounded(result):
    assert result["invariants"]["memory_bounded"] is True, result["memory"]["per_server"]


def test_pool_accounting_exact(result):
    """Refcounts and blocks: 0 held, 0 leaked after the traffic drained (and at the restart)."""
    assert result["leaked_refs"] == 0, result["leaks"]
    assert result["leaked_blocks"] == 0, result["leaks"]
    assert result["kv_cache_usage_idle"] == 0, result["leaks"]  # vLLM's blocks too, cancelled requests' included


def test_tier_survives_restart_and_rejects_planted_corruption(result):
    tier, faults, inv = result["tier"], result["faults"], result["invariants"]
    assert result["tier_hits"] > 0 and inv["tier_survived_restart"], tier
    restart = faults["restart"]
    assert restart["truncated"], restart  # the canary's entries were written through to the tier
    assert inv["restart_corruption_detected"], restart
    live = faults["live_corruption"]
    assert live.get("file") and live.get("target") == "canary file", live
    assert inv["live_corruption_detected"] is True, live  # None: the canary was still in the pool
    assert inv["tier_within_budget"], tier
