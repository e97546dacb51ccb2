"""Two graphchunk replicas behind vLLM's router (``vllm-router``, round robin), sharing one
persistent tier (``perf/serving/replicas.py``): answers through the router equal the HF oracle token for
token; documents one replica computed are served to the other from the shared tier, not computed
again; each replica's /metrics counts its own work; a tenant's salt keeps it from the other tenant's
tier files, as vLLM's prefix cache would.

Two SmolLM2 servers (fp32, eager) for the module, started together; isolated mode (its oracle is
exact).
"""
from __future__ import annotations


import pytest
from pydoc_data.topics import topics

from graphchunk.documents import document_messages, hf_render, place_documents
from graphchunk.segments import split_at
from graphchunk.tools.serve_demo import SERVER_FLAGS
from perf.serving.replicas import Replicas, router_program

pytestmark = pytest.mark.slow

GC = {"pool_tokens": 8192, "mode": "isolated", "max_chunks": 8, "max_chunk_len": 512}
LIMITS = dict(max_chunks=GC["max_chunks"], max_chunk_len=GC["max_chunk_len"])
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 900
SYS = "You answer from the documents; the router test."


def words(topic: str, count: int) -> str:
    return " ".join(topics[topic].replace("#", "").split()[:count])


DOCS = [{"title": topic, "text": words(topic, 45)} for topic in ("while", "return", "import")]


@pytest.fixture(scope="module")
def fleet(smollm2_path, tmp_path_factory):
    if router_program() is None:
        pytest.fail("vllm-router is not installed: the test extra installs it (pip install -e '.[cpu,test]')",
                    pytrace=False)
    logs = tmp_path_factory.mktemp("router")
    replicas = Replicas(smollm2_path, graphchunk=GC, tier=tmp_path_factory.mktemp("shared-tier"),
                        flags=[*SERVER_FLAGS, "--max-model-len", "2048", "--block-size", "32"], policy="round_robin",
                        block_size=32,
                        log_dir=logs)
    try:
        replicas.start(STARTUP_TIMEOUT_S)
    except Exception as exc:
        pytest.fail(f"the replicas did not start: {exc}", pytrace=False)
    try:
        yield replicas
    finally:
        replicas.stop()


def ask(fleet, tokenizer, oracle, documents, **body) -> None:
    """One chat request through the router: its prompt is graphchunk's placement and its answer the
    oracle's, token for token."""
    from openai import OpenAI

    messages = document_messages(SYS, "Which statement ends a function?")
    placed = place_documents(hf_render(tokenizer), messages, documents, tokenizer, **LIMITS)
    seg = split_at(placed.token_ids, placed.boundaries, **LIMITS)
    expected = oracle.generate(list(placed.token_ids), seg.layout, MAX_TOKENS).tokens
    client = OpenAI(base_url=fleet.router.url + "/v1", api_key="unused", max_retries=0)
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
        out.append(tuple(found.get(f"graphchunk_{name}_total", 0.0) for name in names))
    return out


def test_through_the_router_exact_and_the_other_replica_reads_the_shared_tier(fleet, tokenizer, oracle):
    orders = ([0, 1, 2], [1, 2, 0], [2, 0, 1])  # distinct first documents: vLLM's prefix cache shares no document
    for order in orders:
        ask(fleet, tokenizer, oracle, [DOCS[i] for i in order])
    per_replica = counts(fleet, "lookups", "misses", "tier_hits", "hits")
    lookups = [c[0] for c in per_replica]
    # Round robin: both replicas served; each counts only its own lookups (3 per request).
    assert sum(lookups) == 3 * len(orders) and all(n > 0 for n in lookups), per_replica
    # Computed once in the fleet: the replica that did not compute the documents loaded them from the tier.
    assert sum(c[1] for c in per_replica) == len(DOCS), per_replica
    computed = max(range(len(per_replica)), key=lambda i: per_replica[i][1])
    other = per_replica[1 - computed]
    assert other[1] == 0 and other[2] == len(DOCS), per_replica


def test_a_tenant_salt_is_not_served_the_other_tenants_tier_files(fleet, tokenizer, oracle):
    """The same documents under a cache_salt: computed again (on whichever replica), never read
    from the unsalted tier files, and still exact."""
    before = counts(fleet, "misses", "tier_hits")
    for order in ([1, 0, 2], [2, 1, 0]):
        ask(fleet, tokenizer, oracle, [DOCS[i] for i in order], cache_salt="tenant-b")
    after = counts(fleet, "misses", "tier_hits")
    misses = sum(a[0] - b[0] for a, b in zip(after, before))
    tier_hits = sum(a[1] - b[1] for a, b in zip(after, before))
    # The first salted request computes the three documents; the second (the other replica) reads
    # the salted entries the first wrote: tenant b's own files.
    assert misses == len(DOCS) and tier_hits == len(DOCS), (before, after)
