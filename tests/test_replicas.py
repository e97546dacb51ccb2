"""Two graphchunk replicas behind vLLM's router (``vllm-router``, ``perf/serving/replicas.py``), one
fleet for the module: two servers on the tiny Llama checkpoint (fp32, eager, the replicas
benchmark's ``--quick`` flags) sharing one persistent tier, each publishing its KV events, with two
routers over the same servers.

Round robin, deterministic: answers through the router equal the HF oracle token for token;
documents one replica computed are served to the other from the shared tier, not computed again;
each replica's /metrics counts its own work; a tenant's salt keeps it from the other tenant's tier
files, as vLLM's prefix cache would.

``kv_aware`` (fed by the replicas' KV events): the replicas benchmark's cold and warm passes
(``perf/serving/bench_replicas.py``'s ``run_pass`` at its ``--quick`` size) through vLLM's own load
generator. Asserts what could go wrong whatever the timings: every request completed and every
document lookup accounted for (pool, tier or computed, per replica); the router got each request's
token ids from the replicas' render endpoint (graphchunk places the documents there) rather than
routing by load alone, and looked each one up in the index built from the replicas' KV events. No
timing is asserted, nor where kv_aware sends a request (the router's choice). The benchmark's own
``--quick`` starts a fleet per policy and adds the single-server baseline.
"""
from __future__ import annotations

import random

import pytest
import torch
from pydoc_data.topics import topics

import engines
from graphchunk.config import GraphChunkConfig
from graphchunk.documents import document_messages, hf_render, place_documents
from graphchunk.reference.oracle import Oracle
from graphchunk.segments import split_at
from perf.common import harness as H
from perf.serving import bench_replicas
from perf.serving import serve_trace as T
from perf.serving.bench_serve import server_flags
from perf.serving.replicas import Replicas, Router, router_program

pytestmark = pytest.mark.slow

CONFIG = GraphChunkConfig()
LIMITS = dict(max_chunks=CONFIG.max_chunks, max_chunk_len=CONFIG.max_chunk_len)
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 900
SYS = "You answer from the documents; the router test."


def words(topic: str, count: int) -> str:
    return " ".join(topics[topic].replace("#", "").split()[:count])


DOCS = [{"title": topic, "text": words(topic, 45)} for topic in ("while", "return", "import")]


def quick_args():
    return H.parse_with_quick(bench_replicas.build_parser(), ["--quick", "--policies", "kv_aware"],
                              bench_replicas.QUICK)


@pytest.fixture(scope="module")
def args():
    return quick_args()


def build_fleet() -> Replicas:
    if router_program() is None:
        pytest.fail("vllm-router is not installed: the test extra installs it (pip install -e '.[cpu,test]')",
                    pytrace=False)
    args = quick_args()
    replicas = Replicas(H.resolve_model(args.model), n=2, dtype=args.dtype, graphchunk={"mode": args.mode},
                        tier=engines.scratch("shared-tier"), flags=server_flags(args),
                        policy="kv_aware", block_size=args.block_size, log_dir=engines.scratch("replicas"))
    try:
        replicas.start(STARTUP_TIMEOUT_S)
    except Exception as exc:
        pytest.fail(f"the replicas did not start: {exc}", pytrace=False)
    return replicas


fleet = engines.fixture(build_fleet, "fleet")


@pytest.fixture(scope="module")
def round_robin(fleet, tmp_path_factory):
    """A second router, round robin, over the fleet's servers (the fleet's own is kv_aware)."""
    router = Router([s.url for s in fleet.servers], "round_robin",
                    log_path=tmp_path_factory.mktemp("round-robin") / "router.log")
    try:
        router.start().wait_ready()
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def model_oracle(args):
    return Oracle(H.resolve_model(args.model), dtype=torch.float32)


@pytest.fixture(scope="module")
def model_tokenizer(args):
    return H.load_tokenizer(H.resolve_model(args.model))


# --- round robin: exact, and the other replica reads the shared tier ----------------------------

def ask(fleet, router, tokenizer, oracle, documents, **body) -> None:
    """One chat request through the round-robin router: its prompt is graphchunk's placement and
    its answer the oracle's, token for token."""
    from openai import OpenAI

    messages = document_messages(SYS, "Which statement ends a function?")
    placed = place_documents(hf_render(tokenizer), messages, documents, tokenizer, **LIMITS)
    seg = split_at(placed.token_ids, placed.boundaries, **LIMITS)
    expected = oracle.generate(list(placed.token_ids), seg.layout, MAX_TOKENS).tokens
    client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=fleet.servers[0].model, messages=messages, temperature=0,
                                           max_tokens=MAX_TOKENS,
                                           extra_body={"documents": documents, "return_token_ids": True, **body})
    assert reply.prompt_token_ids == placed.token_ids
    assert reply.choices[0].token_ids == expected


def counts(fleet, *names: str) -> list[tuple[float, ...]]:
    """Each replica's ``graphchunk_<name>_total`` counters, in replica order."""
    out = []
    for server in fleet.servers:
        found = server.metrics()
        out.append(tuple(found.get(f"vllm:graphchunk_{name}_total", 0.0) for name in names))
    return out


def moved(before, after) -> list[tuple[float, ...]]:
    return [tuple(a - b for a, b in zip(x, y)) for x, y in zip(after, before)]


def test_through_the_router_exact_and_the_other_replica_reads_the_shared_tier(fleet, round_robin, model_tokenizer,
                                                                               model_oracle):
    names = ("lookups", "misses", "tier_hits", "hits")
    before = counts(fleet, *names)
    orders = ([0, 1, 2], [1, 2, 0], [2, 0, 1])  # distinct first documents: vLLM's prefix cache shares no document
    for order in orders:
        ask(fleet, round_robin, model_tokenizer, model_oracle, [DOCS[i] for i in order])
    per_replica = moved(before, counts(fleet, *names))
    lookups = [c[0] for c in per_replica]
    # Round robin: both replicas served; each counts only its own lookups (3 per request).
    assert sum(lookups) == 3 * len(orders) and all(n > 0 for n in lookups), per_replica
    # Computed once in the fleet: the replica that did not compute the documents loaded them from the tier.
    assert sum(c[1] for c in per_replica) == len(DOCS), per_replica
    computed = max(range(len(per_replica)), key=lambda i: per_replica[i][1])
    other = per_replica[1 - computed]
    assert other[1] == 0 and other[2] == len(DOCS), per_replica


def test_a_tenant_salt_is_not_served_the_other_tenants_tier_files(fleet, round_robin, model_tokenizer, model_oracle):
    """The same documents under a cache_salt: computed again (on whichever replica), never read
    from the unsalted tier files, and still exact."""
    before = counts(fleet, "misses", "tier_hits")
    for order in ([1, 0, 2], [2, 1, 0]):
        ask(fleet, round_robin, model_tokenizer, model_oracle, [DOCS[i] for i in order], cache_salt="tenant-b")
    misses, tier_hits = (sum(column) for column in zip(*moved(before, counts(fleet, "misses", "tier_hits"))))
    # The first salted request computes the three documents; the second (the other replica) reads
    # the salted entries the first wrote: tenant b's own files.
    assert misses == len(DOCS) and tier_hits == len(DOCS), (misses, tier_hits)


# --- kv_aware: the replicas benchmark's passes ------------------------------------------------

@pytest.fixture(scope="module")
def bench_rows(fleet, args, model_tokenizer, tmp_path_factory):
    """The benchmark's cold and warm passes through the kv_aware router (its rows, as its result
    file holds them)."""
    [level] = T.build_levels(model_tokenizer, args.concurrency[:1], args, random.Random(args.seed))
    work = tmp_path_factory.mktemp("bench-replicas")
    rows = [bench_replicas.run_pass(args, fleet, "kv_aware", phase, level, work) for phase in ("cold", "warm")]
    print(bench_replicas.table(rows))
    return rows


def test_every_request_and_lookup_is_accounted_for(bench_rows, args):
    assert [(r["policy"], r["phase"]) for r in bench_rows] == [("kv_aware", "cold"), ("kv_aware", "warm")]
    for row in bench_rows:
        assert row["completed"] == row["num_prompts"] and not row["failed"], row
        assert sum(row["requests_per_replica"]) == row["num_prompts"]
        assert row["lookups"] == args.docs_per_prompt * row["num_prompts"]
        rates = row["pool_hit_rate"] + row["tier_hit_rate"] + row["computed_rate"]
        assert abs(rates - 1) < 1e-9, row
        assert len(row["per_replica"]) == 2


def test_kv_aware_saw_the_placed_prompts_and_the_events(bench_rows):
    """The router got requests' token ids from the replicas' /render and none was refused (vLLM
    answers 403 without --enable-scale-out: every request 'preparation_rejected', routed by load
    alone; a render slower than the router's 1 s budget counts 'preparation_unavailable', which a
    busy machine may see), and its routing decisions were lookups in the index its KV-event
    subscription built."""
    for row in bench_rows:
        decisions = row["router_decisions"]
        rendered = decisions.get("vllm_router_kv_routing_inputs_total{result=render,transport=http}", 0)
        rejected = decisions.get("vllm_router_kv_routing_inputs_total{result=preparation_rejected,transport=http}", 0)
        assert rendered > 0 and rejected == 0, decisions
        lookups = sum(v for k, v in decisions.items() if k.startswith("vllm_router_kv_placement_lookups_total"))
        assert lookups > 0, decisions
