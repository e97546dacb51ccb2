"""Data parallelism of a dense model: ``vllm serve MODEL --worker-cls graphchunk.Runner
--data-parallel-size 2`` on vLLM's CPU backend. vLLM runs each rank as an independent engine
core (its own scheduler, KV connector, worker and chunk pool) behind one API server that balances
requests between them. Answers equal the HF oracle token for token whichever engine serves them;
each engine's graphchunk metrics are its own (label ``engine``); with a shared tier, documents one
engine computed are loaded by the other, not computed again.

One SmolLM2 server (fp32, eager; two API server processes, vLLM's default under data parallelism:
graphchunk's metrics come through vLLM's own connector metrics path, which holds across them,
docs/metrics.md); isolated mode (its oracle is exact).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from pydoc_data.topics import topics

import engines
from graphchunk.documents import document_messages, hf_render, place_documents
from graphchunk.reference import models
from graphchunk.segments import split_at
from graphchunk.tools.serve_demo import SERVER_FLAGS, VllmServer

pytestmark = pytest.mark.slow

GC = {"pool_tokens": 8192, "mode": "isolated", "max_chunks": 8, "max_chunk_len": 512}
LIMITS = dict(max_chunks=GC["max_chunks"], max_chunk_len=GC["max_chunk_len"])
MAX_TOKENS = 12
SYS = "You answer from the documents; the data-parallel test."
DOCS = [{"title": t, "text": " ".join(topics[t].replace("#", "").split()[:45])} for t in ("for", "del", "global")]


def build_server() -> VllmServer:
    tier = engines.scratch("dp-tier")
    srv = VllmServer(models.smollm2_path(), dtype="float32", graphchunk={**GC, "store_path": str(tier)},
                     flags=[*SERVER_FLAGS, "--max-model-len", "2048", "--block-size", "32",
                            "--data-parallel-size", "2", "--api-server-count", "2"])
    srv.start()
    try:
        srv.wait_healthy(900)
    except Exception as exc:
        srv.stop()
        pytest.fail(f"the data-parallel server did not start: {exc}", pytrace=False)
    return srv


server = engines.fixture(build_server, "server")


def ask(server, tokenizer, oracle, order) -> None:
    from openai import OpenAI

    documents = [DOCS[i] for i in order]
    messages = document_messages(SYS, "Which statement loops over a sequence?")
    placed = place_documents(hf_render(tokenizer), messages, documents, tokenizer, **LIMITS)
    expected = oracle.generate(list(placed.token_ids), split_at(placed.token_ids, placed.boundaries, **LIMITS).layout,
                               MAX_TOKENS).tokens
    reply = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"documents": documents, "return_token_ids": True})
    assert reply.prompt_token_ids == placed.token_ids and reply.choices[0].token_ids == expected, order


def test_both_engines_serve_exactly_with_their_own_pools_and_the_shared_tier(server, tokenizer, oracle):
    log = server.log_path.read_text(errors="replace")
    assert "each engine core has its own chunk pool and KV connector" in log
    assert log.count("graphchunk: chunk pool of") == 2, "one pool per engine core"
    ask(server, tokenizer, oracle, [0, 1, 2])  # one engine computes the documents (and writes the tier)
    orders = [[2, 0, 1], [1, 2, 0], [0, 2, 1], [2, 1, 0], [1, 0, 2]]
    with ThreadPoolExecutor(2) as pool:  # two at a time: vLLM's balancer spreads them over the engines
        list(pool.map(lambda order: ask(server, tokenizer, oracle, order), orders))
    engines = server.engine_metrics()
    served = requests_by_engine(server)
    lookups = {e: m.get("vllm:graphchunk_lookups_total", 0) for e, m in engines.items()}
    assert set(engines) == set(served) == {"0", "1"} and all(served.values()) and all(lookups.values()), \
        (engines, served)
    assert sum(served.values()) == 1 + len(orders)
    # Each engine counts its own requests' lookups (3 documents each; fewer where vLLM's own prefix
    # cache on that engine already held a document's blocks), never the other's.
    assert all(lookups[e] <= 3 * served[e] for e in engines), (lookups, served)
    misses = sum(m.get("vllm:graphchunk_misses_total", 0) for m in engines.values())
    tier_hits = sum(m.get("vllm:graphchunk_tier_hits_total", 0) for m in engines.values())
    assert misses == len(DOCS) and tier_hits >= len(DOCS), engines  # computed once; the other engine loads them


def requests_by_engine(server) -> dict[str, float]:
    """vLLM's own count of finished requests per engine core (``vllm:request_success_total``)."""
    import re
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    served: dict[str, float] = {}
    for labels, value in re.findall(r'^vllm:request_success_total\{([^}]*)\} (\S+)$', text, re.M):
        engine = re.search(r'engine="(\d+)"', labels).group(1)
        served[engine] = served.get(engine, 0.0) + float(value)
    return served
