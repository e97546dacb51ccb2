"""End to end through vLLM's OpenAI server: ``vllm serve MODEL --worker-cls graphchunk.Runner``.

One server (SmolLM2-135M, fp32, eager) for the module; answers are compared token for token with
the HF oracle (``graphchunk.reference.oracle``) on the segmentation graphchunk documents, bad input must
come back as a 4xx naming the problem, and the server must keep answering correctly afterwards.
"""
import http.client
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from pydoc_data.topics import topics

import engines
from conftest import GC_LLM_TEMPLATES
from exactness import MAX_TOKENS, blend_reference, string_parts_render
from graphchunk.documents import DOCUMENT_PART, document_messages, hf_render, place_document_parts, place_documents
from graphchunk.engine.request_args import SEPARATOR_ARG
from graphchunk.layout import Layout
from graphchunk.metrics import EXPORTED, PROMETHEUS_PREFIX, SCHEMA
from graphchunk.reference import models
from graphchunk.segments import SeparatorSplitter, split_at
from graphchunk.tools.serve_demo import SERVER_FLAGS, VllmServer

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
GC = {"pool_tokens": 8192, "mode": "isolated", "max_chunks": 8, "max_chunk_len": 512, "templates": str(GC_LLM_TEMPLATES)}
"""With the test session's grid: question steps counted by bucket and by how vLLM ran them."""
STARTUP_TIMEOUT_S = 900  # ~40-80 s alone; much more when other engines share the 2 cores

SYS = "You answer questions about Python using only the documents below."
QUESTION = "Question: Which statement inserts debugging assertions into a program? Answer:"


def words(topic: str, count: int) -> str:
    """The first ``count`` words of a CPython help topic, '#' removed (no separators inside)."""
    return " ".join(topics[topic].replace("#", "").split()[:count])


DOCS = [words("assert", 60), words("break", 40), words("pass", 50)]
SEPARATED = {SEPARATOR_ARG: "##"}
"""The seeds' form asked for per request: this server runs the default settings (no separator)."""


def build_server() -> VllmServer:
    store = engines.scratch("server-tier")  # with a persistent tier: every entry written through
    srv = VllmServer(models.smollm2_path(), dtype="float32", graphchunk={**GC, "store_path": str(store)},
                     flags=[*SERVER_FLAGS, "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "32",
                            "--enable-scale-out"],  # vLLM's /render and /inference/v1/generate
                     env={"VLLM_ENABLE_COHERE_API": "1"})  # vLLM's /cohere/v2/chat, for the cohere SDK
    srv.start()
    try:
        srv.wait_healthy(STARTUP_TIMEOUT_S)
    except Exception as exc:
        srv.stop()
        pytest.fail(f"the server did not start: {exc}", pytrace=False)
    return srv


server = engines.fixture(build_server, "server")


@pytest.fixture(scope="module")
def splitter(tokenizer):
    return SeparatorSplitter(tokenizer, "##", max_chunks=GC["max_chunks"], max_chunk_len=GC["max_chunk_len"])


def complete(server, prompt, **extra) -> tuple[int, dict]:
    body = {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS,
            "return_token_ids": True, **extra}
    return server.post("/v1/completions", body)


def generated(server, prompt, **extra) -> tuple[list[int], list[int]]:
    """(prompt token ids, generated token ids) of a request that must succeed."""
    status, body = complete(server, prompt, **extra)
    assert status == 200, f"{status} {body}\n{server.log_tail()}"
    choice = body["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def oracle_tokens(oracle, token_ids, layout) -> list[int]:
    return oracle.generate(list(token_ids), layout, MAX_TOKENS).tokens


def check_text_prompt(server, oracle, splitter, tokenizer, text) -> list[int]:
    """Serves ``text`` split at '##' (``SEPARATED``) and compares with the oracle on the splitter's
    segmentation (causal when there is no separator). Returns the generated tokens."""
    prompt_ids, tokens = generated(server, text, vllm_xargs=SEPARATED)
    assert prompt_ids == tokenizer(text).input_ids
    seg = splitter.split(prompt_ids)
    layout = seg.layout if seg is not None else Layout(0, (), len(prompt_ids))
    assert tokens == oracle_tokens(oracle, prompt_ids, layout)
    assert len(tokens) >= 2
    return tokens


def rag_text(docs, question=QUESTION) -> str:
    return " ## ".join([SYS, *docs, question])


# --- correct answers ----------------------------------------------------------------------------

def test_separators_in_text_match_oracle_and_reuse_hits(server, oracle, splitter, tokenizer):
    first = server.metrics() if _published(server) else {}
    tokens = check_text_prompt(server, oracle, splitter, tokenizer, rag_text(DOCS))
    after_first = server.metrics()
    assert after_first["vllm:graphchunk_misses_total"] - first.get("vllm:graphchunk_misses_total", 0) == len(DOCS)

    # The same prompt again: the same answer, nothing computed again (vLLM's prefix cache may
    # serve the leading full blocks, graphchunk the rest).
    assert generated(server, rag_text(DOCS), vllm_xargs=SEPARATED)[1] == tokens
    after_repeat = server.metrics()
    assert after_repeat["vllm:graphchunk_misses_total"] == after_first["vllm:graphchunk_misses_total"]

    # Reordered documents: another layout (so no prefix-cache hit past sys), every chunk a hit.
    reordered = rag_text(DOCS[::-1])
    check_text_prompt(server, oracle, splitter, tokenizer, reordered)
    after_reorder = server.metrics()
    assert after_reorder["vllm:graphchunk_hits_total"] - after_repeat["vllm:graphchunk_hits_total"] == len(DOCS)
    assert after_reorder["vllm:graphchunk_misses_total"] == after_repeat["vllm:graphchunk_misses_total"]
    assert after_reorder["vllm:graphchunk_tokens_reused_total"] > after_repeat["vllm:graphchunk_tokens_reused_total"]
    # Its question step is counted, by how vLLM ran it: this server runs --enforce-eager (SERVER_FLAGS),
    # so without a graph (graphchunk captures none of its own).
    counted = {kind: after_reorder[f"vllm:graphchunk_graph_{kind}_total"] - after_repeat[f"vllm:graphchunk_graph_{kind}_total"]
               for kind in ("replays", "padded", "eager")}
    assert counted["eager"] >= 1 and counted["replays"] == counted["padded"] == 0


def test_token_ids_with_explicit_boundaries_match_oracle(server, oracle, tokenizer):
    sys_ids = tokenizer(SYS).input_ids
    chunks = [tokenizer(" " + doc).input_ids for doc in DOCS[:2]]
    question = tokenizer(" " + QUESTION).input_ids
    token_ids = sys_ids + [t for chunk in chunks for t in chunk] + question
    boundaries = [len(sys_ids), len(sys_ids) + len(chunks[0]), len(sys_ids) + len(chunks[0]) + len(chunks[1])]
    _, tokens = generated(server, token_ids, vllm_xargs={"graphchunk_boundaries": boundaries})
    layout = Layout(len(sys_ids), tuple(len(c) for c in chunks), len(question))
    assert tokens == oracle_tokens(oracle, token_ids, layout)


def test_chat_with_separators_in_the_user_message(server):
    user = " ## ".join(["Documents:", *DOCS, "Question: What does the pass statement do?"])
    status, body = server.post("/v1/chat/completions", {
        "model": server.model, "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "system", "content": SYS}, {"role": "user", "content": user}], "vllm_xargs": SEPARATED})
    assert status == 200, f"{status} {body}\n{server.log_tail()}"
    text = body["choices"][0]["message"]["content"]
    assert text.strip()
    assert "##" not in text


UNMARKED = {
    "code-comments": "x = load()  ## read the input\ny = parse(x)  ## then parse it\nWhat does this code do?",
    "markdown": f"# Loops\n\n## for\n\n{words('for', 20)} ## {words('while', 10)}\n\n### Which loop is it?",
    "csharp": "How do I write a LINQ query in C#? ## In C# ## or in F#?",
    "seeds-form": rag_text(DOCS[:2]),
}


def test_unmarked_requests_run_exactly_as_vanilla(server, oracle, tokenizer):
    """This server runs the default settings. Completions and chat requests that are not marked,
    whatever their text holds (code comments, Markdown, C#, the seeds' separator form itself),
    and a documents request sent with graphchunk_mode 'off' (its documents placed, nothing
    reused), answer HF's causal forward token for token, and graphchunk looks nothing up."""
    def lookups():
        found = server.metrics()
        return found.get("vllm:graphchunk_lookups_total", 0), found.get("vllm:graphchunk_blend_lookups_total", 0)

    before = lookups()
    client = sdk(server)
    for name, text in UNMARKED.items():
        prompt_ids, tokens = generated(server, text, ignore_eos=True)
        assert prompt_ids == tokenizer(text).input_ids
        assert tokens == oracle.causal_generate(prompt_ids, MAX_TOKENS)[0], name
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "system", "content": SYS}, {"role": "user", "content": text}],
            temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.choices[0].token_ids == oracle.causal_generate(reply.prompt_token_ids, MAX_TOKENS)[0], name
    messages = document_messages(DOC_SYS, "Which statement repeats?")
    documents = [{"text": words("for", 30)}, {"text": words("while", 30)}]
    placed = place_documents(hf_render(tokenizer), messages, documents, tokenizer, **SERVER_LIMITS)
    reply = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"documents": documents, "vllm_xargs": {"graphchunk_mode": "off"}, "ignore_eos": True,
                    "return_token_ids": True})
    assert reply.prompt_token_ids == placed.token_ids
    assert reply.choices[0].token_ids == oracle.causal_generate(placed.token_ids, MAX_TOKENS)[0]
    assert lookups() == before


# --- documented non-errors ----------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    pytest.param(f"{SYS} {DOCS[0]} {QUESTION}", id="no-separator"),
    pytest.param(" ## ".join(["", *DOCS[:2], QUESTION]), id="separator-first"),  # " ## doc": S = 0
    pytest.param(f"{SYS} ## ## {DOCS[1]} ## {DOCS[2]} ## {QUESTION}", id="consecutive-separators"),
])
def test_degenerate_but_valid_prompts_match_oracle(server, oracle, splitter, tokenizer, text):
    check_text_prompt(server, oracle, splitter, tokenizer, text)


def test_no_separator_is_an_ordinary_prompt(splitter, tokenizer):
    assert splitter.split(tokenizer(f"{SYS} {DOCS[0]} {QUESTION}").input_ids) is None


def test_blend_mode_through_the_server(server, oracle, tokenizer):
    """Recomputing every chunk token equals full prefill (HF's causal forward); the same documents
    reordered behind another system prompt hit in blend mode (its keys have no sys)."""
    before = server.metrics() if _published(server) else {}
    full = {"graphchunk_mode": "blend", "graphchunk_recompute": "cacheblend", "graphchunk_recompute_ratio": 1.0}
    prompt_ids, tokens = generated(server, rag_text(DOCS), vllm_xargs={**full, **SEPARATED}, ignore_eos=True)
    assert tokens == oracle.causal_generate(prompt_ids, MAX_TOKENS)[0]
    after = server.metrics()
    assert after["vllm:graphchunk_blend_misses_total"] - before.get("vllm:graphchunk_blend_misses_total", 0) == len(DOCS)
    other_sys = " ## ".join(["Answer briefly.", *DOCS[::-1], QUESTION])
    generated(server, other_sys, vllm_xargs={"graphchunk_mode": "blend", "graphchunk_recompute": "legolink", **SEPARATED})
    again = server.metrics()
    assert again["vllm:graphchunk_blend_hits_total"] - after["vllm:graphchunk_blend_hits_total"] == len(DOCS)
    assert again["vllm:graphchunk_blend_misses_total"] == after["vllm:graphchunk_blend_misses_total"]
    assert again["vllm:graphchunk_blend_tokens_recomputed_total"] > after["vllm:graphchunk_blend_tokens_recomputed_total"]


# --- bad input: a 4xx naming the problem, and the server keeps serving --------------------------

def _ids(n: int) -> list[int]:
    return list(range(1000, 1000 + n))


BAD = {
    "too-many-chunks": (dict(prompt=" ## ".join(["sys", *(f"doc {i}" for i in range(9)), "q?"]), vllm_xargs=SEPARATED),
                        "9 chunks, more than max_chunks=8"),
    "chunk-too-long": (dict(prompt="sys ## " + "word " * 600 + "## q?", vllm_xargs=SEPARATED), "more than max_chunk_len=512"),
    "separator-last": (dict(prompt=f"{SYS} ## {DOCS[0]} ##", vllm_xargs=SEPARATED), r"question \(last segment\) is empty"),
    "over-max-model-len": (dict(prompt=_ids(2100), vllm_xargs={"graphchunk_boundaries": [100, 500, 900, 1300, 1700]}),
                           "maximum context length is 2048"),
    "over-max-model-len-text": (dict(prompt=" ## ".join(["sys", *["word " * 450] * 5, "q?"]), vllm_xargs=SEPARATED),
                                "maximum context length is 2048"),
    "boundaries-not-a-list": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": 3}), "must be a list"),
    "boundaries-a-string": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": "2,4"}), "must be a list"),
    "boundaries-floats": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": [2.5, 4]}), "must be integers"),
    "boundaries-strings": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": ["2", 4]}), "must be integers"),
    "boundaries-booleans": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": [True, 5]}),
                            r"graphchunk_boundaries must be .*, got \[true, 5\]: JSON booleans are not accepted"),
    "boundaries-decreasing": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": [5, 2]}), "non-decreasing"),
    "boundaries-past-the-end": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": [2, 99]}),
                                r"must lie within \[0, 8\]"),
    "boundaries-negative": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": [-1, 4]}),
                            r"must lie within \[0, 8\]"),
    "boundaries-empty": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": []}), "at least the question"),
    "boundaries-empty-question": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_boundaries": [2, 8]}),
                                  "question .* is empty"),
    "prompt-logprobs": (dict(prompt=rag_text(DOCS[:1]), prompt_logprobs=1, vllm_xargs=SEPARATED), "prompt_logprobs"),
    # graphchunk's own salt mark: on an ordinary prompt it would read a segmented request's KV
    "forged-salt": (dict(prompt="Hello there", cache_salt="|graphchunk:0123456789abcdef"),
                    r"cache_salt must not contain '\|graphchunk:'"),
    "forged-salt-segmented": (dict(prompt=rag_text(DOCS[:1]), cache_salt="tenant|graphchunk:blend:none:00",
                                   vllm_xargs=SEPARATED),
                              "cache_salt must not contain"),
    "mode-unknown": (dict(prompt=rag_text(DOCS[:1]), vllm_xargs={"graphchunk_mode": "fast"}),
                     r"graphchunk_mode must be one of \('isolated', 'blend', 'off'\), got 'fast'"),
    "separator-blank": (dict(prompt=rag_text(DOCS[:1]), vllm_xargs={SEPARATOR_ARG: "  "}),
                        "graphchunk_separator must be a text with a non-whitespace character"),
    "off-with-boundaries": (dict(prompt=_ids(8), vllm_xargs={"graphchunk_mode": "off", "graphchunk_boundaries": [2, 4]}),
                            "graphchunk_mode 'off' runs the request as in vanilla vLLM; it takes no graphchunk_boundaries"),
    "recompute-unknown": (dict(prompt=rag_text(DOCS[:1]), vllm_xargs={"graphchunk_mode": "blend",
                                                                       "graphchunk_recompute": "all"}),
                          "graphchunk_recompute must be one of"),
    "ratio-out-of-range": (dict(prompt=rag_text(DOCS[:1]), vllm_xargs={"graphchunk_mode": "blend",
                                                                        "graphchunk_recompute_ratio": 1.5}),
                           r"graphchunk_recompute_ratio must be a number in \[0, 1\], got 1.5"),
    "ratio-boolean": (dict(prompt=rag_text(DOCS[:1]), vllm_xargs={"graphchunk_mode": "blend",
                                                                   "graphchunk_recompute_ratio": True}),
                      "JSON booleans are not accepted"),
    "recompute-in-isolated-mode": (dict(prompt=rag_text(DOCS[:1]), vllm_xargs={"graphchunk_recompute_tokens": 4}),
                                   "only apply to blend mode"),
    "beam-search-boundaries": (dict(prompt=_ids(8), use_beam_search=True, vllm_xargs={"graphchunk_boundaries": [2, 4]}),
                               "use_beam_search cannot carry graphchunk's chunks"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_client_error_naming_the_problem(server, case):
    import re

    request, message = BAD[case]
    status, body = complete(server, **request)
    assert 400 <= status < 500, f"{case}: {status} {body}\n{server.log_tail()}"
    text = body.get("error", {}).get("message", "")
    assert re.search(message, text), f"{case}: {status} {text!r}"
    assert server.process.poll() is None, server.log_tail()


def test_still_serves_correct_answers_after_bad_input(server, oracle, splitter, tokenizer):
    for case in ("too-many-chunks", "boundaries-decreasing", "prompt-logprobs"):
        request, _ = BAD[case]
        assert complete(server, **request)[0] == 400
    check_text_prompt(server, oracle, splitter, tokenizer, rag_text([DOCS[2], DOCS[0]]))
    status, body = server.post("/v1/completions", {"model": server.model, "prompt": "Hello", "max_tokens": 2})
    assert status == 200


# --- tenants -------------------------------------------------------------------------------------

def test_cache_salt_tenants_never_share_chunks(server, oracle, splitter, tokenizer):
    """The same documents under two tenants' ``cache_salt``: each tenant computes its own (pool
    and tier: the server writes through to its tier), the same tenant reuses; every answer the
    oracle's (a salt separates caches, it does not change what the model computes)."""
    docs = [words("while", 45), words("import", 45)]
    texts = [rag_text(docs), rag_text(docs[::-1])]  # reordered: vLLM's prefix cache cannot serve the chunks
    expected = []
    for text in texts:
        prompt_ids = tokenizer(text).input_ids
        expected.append(oracle_tokens(oracle, prompt_ids, splitter.split(prompt_ids).layout))
    moves = []
    for salt, which in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 1), ("tenant-b", 1)):
        before = server.metrics()
        assert generated(server, texts[which], cache_salt=salt, vllm_xargs=SEPARATED)[1] == expected[which], salt
        after = server.metrics()
        moves.append(tuple(after[f"vllm:graphchunk_{name}_total"] - before.get(f"vllm:graphchunk_{name}_total", 0)
                           for name in ("misses", "hits", "tier_hits")))
    assert moves == [(2, 0, 0), (2, 0, 0), (0, 2, 0), (0, 2, 0)]


# --- metrics -------------------------------------------------------------------------------------

def _published(server) -> bool:
    return "vllm:graphchunk_lookups_total" in server.metrics()


def test_metrics_are_exported(server):
    """graphchunk's series come through vLLM's connector metrics path: named and labelled as
    vLLM's own, counters and gauges as the schema declares them, ratios left to PromQL."""
    generated(server, rag_text(DOCS[:2]), vllm_xargs=SEPARATED)
    found = server.metrics()
    exported = {PROMETHEUS_PREFIX + name + ("_total" if SCHEMA[name][0] == "counter" else "") for name in EXPORTED}
    assert exported <= set(found), sorted(exported - set(found))
    assert not {f"{PROMETHEUS_PREFIX}hit_rate", f"{PROMETHEUS_PREFIX}pool_utilization"} & set(found)
    assert found["vllm:graphchunk_lookups_total"] == (found["vllm:graphchunk_hits_total"]
                                                      + found["vllm:graphchunk_misses_total"]
                                                      + found["vllm:graphchunk_tier_hits_total"]) > 0
    assert found["vllm:graphchunk_tier_writes_total"] > 0 and found["vllm:graphchunk_tier_bytes"] > 0
    assert found["vllm:graphchunk_pool_refs_held"] == found["vllm:graphchunk_pool_blocks_leaked"] == 0
    assert found["vllm:graphchunk_pool_blocks_total"] == GC["pool_tokens"] // 32
    assert 0 < found["vllm:graphchunk_pool_blocks_used"] <= found["vllm:graphchunk_pool_blocks_total"]
    text = metrics_text(server)
    assert re.search(rf'^vllm:graphchunk_lookups_total{{engine="0",model_name="{re.escape(server.model)}"}} ', text,
                     re.M), text[:2000]
    # graphchunk's start-up lines reach the server's log, in vLLM's format (its logger is vLLM's child)
    log = server.log_path.read_text(errors="replace")
    assert f"graphchunk: chunk pool of {GC['pool_tokens'] // 32} blocks" in log, server.log_tail()
    assert "graphchunk: persistent chunk tier at" in log, server.log_tail()


def test_every_series_the_dashboard_queries_exists(server):
    """deploy/grafana/graphchunk-dashboard.json queries only series a graphchunk server exports (its own
    and vLLM's), each with the ``model_name`` label its panels select by."""
    generated(server, rag_text(DOCS[:2]), vllm_xargs=SEPARATED)
    dashboard = json.loads((REPO / "deploy" / "grafana" / "graphchunk-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs.append(next(v["query"] for v in dashboard["templating"]["list"] if v["name"] == "model_name"))
    queried = {name for expr in exprs for name in re.findall(r"\b(vllm:\w+)", expr)}
    assert any(name.startswith(PROMETHEUS_PREFIX) for name in queried) and len(exprs) > 10
    text = metrics_text(server)
    missing = [name for name in sorted(queried)
               if not re.search(rf'^{re.escape(name)}{{[^}}]*model_name="{re.escape(server.model)}"', text, re.M)]
    assert not missing, f"the dashboard queries series /metrics does not have: {missing}"


def metrics_text(server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


# --- requests that leave early -----------------------------------------------------------------

def vllm_samples(server, name: str) -> float:
    """vLLM's own metric ``name`` on /metrics (summed over its label sets)."""
    text = metrics_text(server)
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def settled(server, deadline_s: float) -> float:
    """Polls until vLLM runs and queues nothing; returns its KV-cache usage then."""
    deadline = time.monotonic() + deadline_s
    while True:
        busy = vllm_samples(server, "vllm:num_requests_running") + vllm_samples(server, "vllm:num_requests_waiting")
        if not busy or time.monotonic() > deadline:
            return vllm_samples(server, "vllm:kv_cache_usage_perc")
        time.sleep(0.2)


def streamed(server, prompt: str) -> http.client.HTTPConnection:
    """A streamed completion, once its response has started (before its first token): closing the
    connection then is a client going away (vLLM aborts the request on the disconnect)."""
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "vllm_xargs": SEPARATED}),
        {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200
    return conn


def test_requests_cancelled_while_waiting_for_misses_give_the_kv_cache_back(server, oracle, splitter, tokenizer):
    """16 streamed requests, each with two documents no other request has: once graphchunk has
    planned half of them (their misses counted: they wait, blocks allocated, while the workers
    compute the misses a budget per step), every client goes away. vLLM's KV-cache usage returns to
    its idle value once the workers have caught up, and a request afterwards is answered, exactly
    (before, a request cancelled while waiting for its misses kept its blocks for good: the usage
    stayed up with nothing running, and long prompts stopped being admitted)."""
    idle = settled(server, 60)
    misses = server.metrics()["vllm:graphchunk_misses_total"]
    completed = vllm_samples(server, "vllm:request_success_total")  # (a cancelled request is not counted)
    conns = [streamed(server, rag_text([f"Note {i}-{k}: " + words(topic, 80) for k, topic in enumerate(("for", "while"))]))
             for i in range(16)]
    deadline = time.monotonic() + 120
    while server.metrics()["vllm:graphchunk_misses_total"] < misses + 16 and time.monotonic() < deadline:
        time.sleep(0.2)  # polls: 8 of them planned
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + 120
    while settled(server, 5) > idle and time.monotonic() < deadline:
        pass
    assert settled(server, 5) == idle, f"vLLM's KV cache stays used with nothing running\n{server.log_tail()}"
    cancelled = 16 - (vllm_samples(server, "vllm:request_success_total") - completed)
    assert cancelled >= 8, cancelled  # half or more went away while they waited
    check_text_prompt(server, oracle, splitter, tokenizer, rag_text(DOCS[::-1]))


# --- documents: the openai SDK, as a RAG client sends them ---------------------------------------

DOC_SYS = "You answer from the documents; the server's documents test."


def sdk(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


SERVER_LIMITS = dict(max_chunks=GC["max_chunks"], max_chunk_len=GC["max_chunk_len"])


def placed_reference(oracle, tokenizer, messages, documents) -> tuple[list[int], list[int]]:
    """(prompt token ids, the oracle's tokens) of a documents request (``graphchunk.documents``)."""
    return oracle_reference(oracle, place_documents(hf_render(tokenizer), messages, documents, tokenizer,
                                                    **SERVER_LIMITS))


def oracle_reference(oracle, placed) -> tuple[list[int], list[int]]:
    """(prompt token ids, the oracle's tokens) of a placed documents prompt."""
    seg = split_at(placed.token_ids, placed.boundaries, **SERVER_LIMITS)
    return placed.token_ids, oracle_tokens(oracle, placed.token_ids, seg.layout)


def sdk_answers(server, tokenizer, messages, body: dict, stream: bool, prompt_ids, expected) -> None:
    """One chat completion through the openai SDK, streamed or not: its answer is ``expected``
    (unstreamed, token for token, and its prompt ``prompt_ids``)."""
    reply = sdk(server).chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                max_tokens=MAX_TOKENS, stream=stream,
                                                extra_body={**body, "return_token_ids": True})
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
    else:
        assert reply.prompt_token_ids == prompt_ids and reply.choices[0].token_ids == expected


def moved(server, before: dict, *names: str) -> tuple[float, ...]:
    after = server.metrics()
    return tuple(after[f"vllm:graphchunk_{n}_total"] - before.get(f"vllm:graphchunk_{n}_total", 0) for n in names)


def test_documents_through_the_openai_sdk_match_the_oracle_and_hit_reordered(server, oracle, tokenizer):
    """extra_body documents (and chat_template_kwargs.documents), streamed and not: one lookup per
    document, every one a hit when they come back reordered, answers equal to the oracle's."""
    docs = [{"title": topic, "text": words(topic, 40)} for topic in ("for", "try", "with")]
    messages = document_messages(DOC_SYS, "Which statement handles exceptions?")
    cases = [([0, 1, 2], "documents", False, "misses"), ([2, 0, 1], "documents", True, "hits"),
             ([1, 2, 0], "chat_template_kwargs", False, "hits")]
    for order, where, stream, counted in cases:
        documents = [docs[i] for i in order]
        prompt_ids, expected = placed_reference(oracle, tokenizer, messages, documents)
        body = {"documents": documents} if where == "documents" else {"chat_template_kwargs": {"documents": documents}}
        before = server.metrics() if _published(server) else {}
        sdk_answers(server, tokenizer, messages, body, stream, prompt_ids, expected)
        assert moved(server, before, "lookups", counted) == (3, 3), (order, where)


def test_blend_documents_reordered_behind_another_system_prompt_hit(server, oracle, tokenizer):
    """Blend mode (vllm_xargs) documents: reordered behind another system prompt, all hits (blend
    keys have no sys); answers equal HF's reuse reference (each document's KV alone, nothing
    recomputed)."""
    docs = [{"title": topic, "text": words(topic, 40)} for topic in ("yield", "del", "nonlocal")]
    xargs = {"graphchunk_mode": "blend", "graphchunk_recompute": "none"}
    for sys_prompt, order, counted in ((DOC_SYS, [0, 1, 2], "blend_misses"), ("Answer in one word.", [2, 0, 1],
                                                                              "blend_hits")):
        messages = document_messages(sys_prompt, "Which statement deletes a name?")
        documents = [docs[i] for i in order]
        placed = place_documents(hf_render(tokenizer), messages, documents, tokenizer, **SERVER_LIMITS)
        seg = split_at(placed.token_ids, placed.boundaries, **SERVER_LIMITS)
        before = server.metrics() if _published(server) else {}
        reply = sdk(server).chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
            extra_body={"documents": documents, "vllm_xargs": xargs, "ignore_eos": True, "return_token_ids": True})
        assert reply.prompt_token_ids == placed.token_ids
        assert reply.choices[0].token_ids == blend_reference(oracle, seg, "naive", MAX_TOKENS).tokens, sys_prompt
        assert moved(server, before, counted) == (3,), sys_prompt


def test_content_part_documents_through_the_openai_sdk(server, oracle, tokenizer):
    """Documents as content parts (marked per part, or every part but the last per request),
    streamed and not: the message as vLLM renders it, one lookup per part, all hits reordered,
    answers equal to the oracle's."""
    texts = [f"# {topic}\n\n## Usage\n\n{words(topic, 30)}" for topic in ("function", "class", "lambda")]
    for order, every_part, stream, counted in (([0, 1, 2], False, False, "misses"), ([2, 1, 0], False, True, "hits"),
                                               ([1, 0, 2], True, False, "hits")):
        parts = [{"type": "text", "text": texts[i], **({} if every_part else {DOCUMENT_PART: True})} for i in order]
        messages = [{"role": "system", "content": DOC_SYS},
                    {"role": "user", "content": [*parts, {"type": "text", "text": "Which defines a function?"}]}]
        placed = place_document_parts(string_parts_render(tokenizer), messages, tokenizer, every_part=every_part,
                                      **SERVER_LIMITS)
        prompt_ids, expected = oracle_reference(oracle, placed)
        body = {"chat_template_kwargs": {"graphchunk_document_parts": True}} if every_part else {}
        before = server.metrics() if _published(server) else {}
        sdk_answers(server, tokenizer, messages, body, stream, prompt_ids, expected)
        assert moved(server, before, "lookups", counted) == (3, 3), (order, every_part)


def test_a_markdown_document_is_one_chunk(server, oracle, tokenizer):
    markdown = f"# Loops\n\n## for\n\n{words('for', 30)}\n\n### while\n\n{words('while', 30)}"
    messages = document_messages(DOC_SYS, "Which loops are described?")
    prompt_ids, expected = placed_reference(oracle, tokenizer, messages, [{"text": markdown}])
    before = server.metrics() if _published(server) else {}
    reply = sdk(server).chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                max_tokens=MAX_TOKENS,
                                                extra_body={"documents": [{"text": markdown}], "return_token_ids": True})
    assert reply.prompt_token_ids == prompt_ids and reply.choices[0].token_ids == expected
    assert moved(server, before, "lookups")[0] == 1


def test_documents_through_the_cohere_sdk(server, oracle, tokenizer):
    """vLLM's /cohere/v2/chat (VLLM_ENABLE_COHERE_API=1) with the official cohere SDK: a document,
    a string or ``{"id", "data"}``, is its data (the id is not rendered), the same chunk as the
    documents field's; reordered and with other ids, all hits; answers equal to the oracle's."""
    import cohere

    client = cohere.ClientV2(base_url=server.url + "/cohere", api_key="unused")
    data = [{"title": topic, "snippet": words(topic, 30)} for topic in ("if", "while", "return")]
    messages = document_messages(DOC_SYS, "Which statement leaves a function?")
    for order, ids, counted in (([0, 1, 2], "python-", "misses"), ([2, 0, 1], None, "hits")):
        documents = [{"data": data[i], **({"id": f"{ids}{i}"} if ids else {})} for i in order]
        _, expected = placed_reference(oracle, tokenizer, messages, [data[i] for i in order])
        before = server.metrics() if _published(server) else {}
        reply = client.chat(model=server.model, messages=messages, documents=documents, temperature=0,
                            max_tokens=MAX_TOKENS)
        assert reply.message.content[0].text == tokenizer.decode(expected, skip_special_tokens=True), order
        assert moved(server, before, "lookups", counted) == (3, 3), order
    text = words("pass", 30)  # a string document is {"text": ...}
    _, expected = placed_reference(oracle, tokenizer, messages, [{"text": text}])
    reply = client.chat(model=server.model, messages=messages, documents=[text], temperature=0, max_tokens=MAX_TOKENS)
    assert reply.message.content[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_documents_through_langchain(server, oracle, tokenizer):
    """A LangChain RAG turn: retrieved ``Document``s sent as the request's documents through
    ``ChatOpenAI`` (``extra_body``); answers equal to the oracle's, all hits reordered."""
    from langchain_core.documents import Document
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    retrieved = [Document(page_content=words(topic, 30), metadata={"title": topic})
                 for topic in ("import", "raise", "global")]
    question = "Which statement signals an error?"
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=server.model, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0)
    for order, counted in (([0, 1, 2], "misses"), ([1, 2, 0], "hits")):
        documents = [{"title": retrieved[i].metadata["title"], "text": retrieved[i].page_content} for i in order]
        _, expected = placed_reference(oracle, tokenizer, document_messages(DOC_SYS, question), documents)
        before = server.metrics() if _published(server) else {}
        reply = chat.invoke([SystemMessage(DOC_SYS), HumanMessage(question)], extra_body={"documents": documents})
        assert reply.content == tokenizer.decode(expected, skip_special_tokens=True), order
        assert moved(server, before, "lookups", counted) == (3, 3), order


def test_the_render_endpoint_carries_the_documents_chunks(server, oracle, tokenizer):
    """vLLM's scale-out pair: /v1/chat/completions/render of a documents request answers with its
    tokens and, in its sampling params, the documents' boundaries; /inference/v1/generate of that
    answer is chunked as the chat request would be: the oracle's tokens, all hits reordered."""
    docs = [{"title": topic, "text": words(topic, 30)} for topic in ("function", "del", "nonlocal")]
    messages = document_messages(DOC_SYS, "Which statement deletes a name?")
    for order, counted in (([0, 1, 2], "misses"), ([2, 1, 0], "hits")):
        documents = [docs[i] for i in order]
        placed = place_documents(hf_render(tokenizer), messages, documents, tokenizer, **SERVER_LIMITS)
        status, rendered = server.post("/v1/chat/completions/render", {
            "model": server.model, "messages": messages, "documents": documents, "temperature": 0,
            "max_tokens": MAX_TOKENS})
        assert status == 200, f"{status} {rendered}"
        assert rendered["token_ids"] == placed.token_ids
        assert rendered["sampling_params"]["extra_args"]["graphchunk_boundaries"] == placed.boundaries
        before = server.metrics() if _published(server) else {}
        # vLLM drops max_tokens equal to SamplingParams' default (16) from the rendered params, and
        # generate then fills the context: send it explicitly.
        rendered["sampling_params"]["max_tokens"] = MAX_TOKENS
        status, body = server.post("/inference/v1/generate", rendered)
        assert status == 200, f"{status} {body}\n{server.log_tail()}"
        assert body["choices"][0]["token_ids"] == oracle_reference(oracle, placed)[1], order
        assert moved(server, before, "lookups", counted) == (3, 3), order


BAD_DOCUMENTS = {
    "duplicate": ({"documents": [{"text": "a"}, {"text": "a"}]}, "document 2 repeats document 1"),
    "empty": ({"documents": [{"text": "a"}, {"text": " "}]}, "document 2 is empty"),
    "nested": ({"chat_template_kwargs": {"documents": [{"text": "a", "meta": {"k": "v"}}]}},
               "document 1's 'meta' must be a string, got dict"),
    "not-a-list": ({"chat_template_kwargs": {"documents": "a"}}, "documents must be a list"),
    "too-many": ({"documents": [{"text": f"doc {i}"} for i in range(9)]}, "9 documents, more than max_chunks=8"),
    "too-long": ({"documents": [{"text": "word " * 600}]}, "document 1 has .* tokens, more than max_chunk_len=512"),
    "with-boundaries": ({"documents": [{"text": "a"}], "vllm_xargs": {"graphchunk_boundaries": [1, 2]}},
                        "cannot also send graphchunk_boundaries"),
    "part-after-question": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Which?"}, {"type": "text", "text": "a", DOCUMENT_PART: True}]}]},
        "content part 2 is marked as a document but follows the question"),
    "parts-and-documents": ({"documents": [{"text": "b"}], "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", DOCUMENT_PART: True}, {"type": "text", "text": "Which?"}]}]},
        "either in the documents field or as content parts, not both"),
    "parts-not-a-list": ({"chat_template_kwargs": {"graphchunk_document_parts": True}},
                         "needs the last user message's content as a list of parts"),
    "beam-search": ({"documents": [{"text": "a"}], "use_beam_search": True}, "use_beam_search cannot carry"),
}


@pytest.mark.parametrize("case", list(BAD_DOCUMENTS))
def test_bad_documents_are_a_400_naming_the_document(server, case):
    import openai

    body, message = dict(BAD_DOCUMENTS[case][0]), BAD_DOCUMENTS[case][1]
    messages = body.pop("messages", [{"role": "user", "content": "Which?"}])
    with pytest.raises(openai.BadRequestError, match=message):
        sdk(server).chat.completions.create(model=server.model, max_tokens=2, extra_body=body, messages=messages)
    assert server.process.poll() is None, server.log_tail()
