"""The replicas benchmark end to end at its ``--quick`` size (``perf/serving/bench_replicas.py``): two
servers behind vllm-router's ``kv_aware`` (fed by the servers' KV events), on the tiny Llama
checkpoint (the single-server baseline, policy ``one``, runs in the full form only). Asserts what
could go wrong whatever the timings: every request completed and every document lookup accounted
for (pool, tier or computed, per replica); the router got each request's token ids from the
replicas' render endpoint (graphchunk places the documents there) rather than routing by load
alone, and looked each one up in the index built from the replicas' KV events. No timing is
asserted (nor where kv_aware sends a request: that is the router's choice; tests/test_router.py
checks the shared tier deterministically).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900  # ~2 min on 2 cores: two server starts, two passes


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-replicas")
    command = [sys.executable, "-m", "perf.serving.bench_replicas", "--quick", "--policies", "kv_aware",
               "--out", str(out / "replicas.json"), "--work-dir", str(out / "work")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    print(done.stdout[-4000:])
    if not (out / "replicas.json").exists():
        pytest.fail(f"bench_replicas.py exited {done.returncode} without a result\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-3000:]}", pytrace=False)
    return json.loads((out / "replicas.json").read_text())


def test_every_request_and_lookup_is_accounted_for(result):
    assert [(r["policy"], r["phase"]) for r in result["rows"]] == [("kv_aware", "cold"), ("kv_aware", "warm")]
    for row in result["rows"]:
        assert row["completed"] == row["num_prompts"] and not row["failed"], row
        assert sum(row["requests_per_replica"]) == row["num_prompts"]
        assert row["lookups"] == result["docs_per_prompt"] * row["num_prompts"]
        rates = row["pool_hit_rate"] + row["tier_hit_rate"] + row["computed_rate"]
        assert abs(rates - 1) < 1e-9, row
    assert all(len(row["per_replica"]) == 2 for row in result["rows"])


def test_kv_aware_saw_the_placed_prompts_and_the_events(result):
    """The router got requests' token ids from the replicas' /render and none was refused (vLLM
    answers 403 without --enable-scale-out: every request 'preparation_rejected', routed by load
    alone; a render slower than the router's 1 s budget counts 'preparation_unavailable', which a
    busy machine may see), and its routing decisions were lookups in the index its KV-event
    subscription built."""
    for row in result["rows"]:
        decisions = row["router_decisions"]
        rendered = decisions.get("vllm_router_kv_routing_inputs_total{result=render,transport=http}", 0)
        rejected = decisions.get("vllm_router_kv_routing_inputs_total{result=preparation_rejected,transport=http}", 0)
        assert rendered > 0 and rejected == 0, decisions
        lookups = sum(v for k, v in decisions.items() if k.startswith("vllm_router_kv_placement_lookups_total"))
        assert lookups > 0, decisions
