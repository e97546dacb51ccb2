"""The persistent tier end to end: ``graphchunk-precompute`` fills a directory, servers started on
it serve those chunks as tier hits, two live servers reuse each other's chunks, bad files are
never served, tenants never share — every output checked against the HF oracle. The second
server's pool is left unset, so it also shows the start-up sizing of an unset pool.

Tiny Llama-llama3 checkpoint in fp32 (fast engines); "servers" are ``GraphChunkLLM`` engines
(each an engine-core process of its own, as a ``vllm serve`` has); the soak test drives the
OpenAI server with a restart over a tier.
"""
from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import xxhash
from pydoc_data.topics import topics

import engines
from exactness import LIMITS, MAX_TOKENS, Reference, assert_matches_oracle, assert_matches_reference, blend_reference, \
    reference, sampling
from graphchunk.blend.recompute import cacheblend_tokens
from graphchunk.cache.context_plan import context_identity
from graphchunk.config import GraphChunkConfig
from graphchunk.documents import document_messages, hf_render, place_documents
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.reference.oracle import Oracle
from graphchunk.segments import SeparatorSplitter, split_at
from inprocess import run_main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

ENGINE = dict(dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 27, block_size=32)
SYS = "Answer from the documents."
QUESTION = "Which statement is described first?"
_TOPICS = iter(sorted(topics))


def docs(n: int) -> list[str]:
    """``n`` documents no other test of this module uses: the start of CPython help topics."""
    return [" ".join(topics[next(_TOPICS)].split()[:40]) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return str(models.tiny_checkpoint("llama3"))


@pytest.fixture(scope="module")
def tiny_oracle(tiny):
    return Oracle(tiny, dtype=torch.float32)


CORPORA = {
    # name: (corpus lines, graphchunk-precompute's options), run in this order into one directory
    "plain": ([{"text": d} for d in docs(3)] + [{"text": d, "mode": "blend"} for d in docs(2)], ()),
    # --format documents: two isolated documents (one with a title), one blend
    "documents": ([{"document": {"title": "Statements", "text": t}} for t in docs(1)]
                  + [{"text": t} for t in docs(1)] + [{"text": t, "mode": "blend"} for t in docs(1)],
                  ("--format", "documents")),
    # --context list: a behind c and b, b behind a, c behind nothing but the sys prompt
    "context": ([{**r, "text": t} for r, t in zip([{"id": "a", "context": ["c", "b"]}, {"id": "b", "context": ["a"]},
                                                   {"id": "c", "mode": "blend"}], docs(3))],
                ("--mode", "auto", "--context", "list")),
    # --format separator: two isolated documents behind SYS, one behind an empty sys, one blend
    "separator": ([{"text": d} for d in docs(2)] + [{"text": d, "sys": ""} for d in docs(1)]
                  + [{"text": d, "mode": "blend"} for d in docs(1)], ("--format", "separator")),
}


def precompute_argv(tiny, store, corpus_path, options) -> list[str]:
    return ["--model", tiny, "--store", str(store), "--corpus", str(corpus_path), "--sys", SYS, "--dtype", "float32",
            "--block-size", "32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 27),
            "--mode", "isolated", *options]


def tier_files(store) -> set:
    return set(store.rglob("*.gckv"))


class Precomputed(NamedTuple):
    store: Path
    corpora: Path
    runs: dict  # name -> (its subprocess.CompletedProcess, the tier files it wrote)


def build_precomputed() -> Precomputed:
    """graphchunk-precompute over ``CORPORA`` into a new tier directory, each run its console script's
    process: started ahead of this module (``engines``), they take a minute or more of one core."""
    tiny = str(models.tiny_checkpoint("llama3"))
    store, corpora = engines.scratch("tier"), engines.scratch("corpora")
    runs = {}
    for name, (records, options) in CORPORA.items():
        path = corpora / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        before = tier_files(store)
        done = engines.run_ahead("graphchunk.tools.precompute", precompute_argv(tiny, store, path, options))
        runs[name] = (done, tier_files(store) - before)
    return Precomputed(store, corpora, runs)


precomputes = engines.fixture(build_precomputed, "precomputes")


@pytest.fixture(scope="module")
def store(precomputes):
    return precomputes.store


def _precomputed(precomputes, name: str) -> tuple[subprocess.CompletedProcess, set]:
    done, written = precomputes.runs[name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, written


@pytest.fixture(scope="module")
def precomputed(precomputes):
    return _precomputed(precomputes, "plain")


@pytest.fixture(scope="module")
def precomputed_documents(precomputes):
    return _precomputed(precomputes, "documents")


@pytest.fixture(scope="module")
def precomputed_context(precomputes):
    return _precomputed(precomputes, "context")


@pytest.fixture(scope="module")
def precomputed_separator(precomputes):
    return _precomputed(precomputes, "separator")


@pytest.fixture(scope="module")
def corpus(precomputes):
    return precomputes.corpora / "plain.jsonl", CORPORA["plain"][0]


@pytest.fixture(scope="module")
def documents_corpus(precomputes):
    return precomputes.corpora / "documents.jsonl", [r["document"] if "document" in r else {"text": r["text"]}
                                                   for r in CORPORA["documents"][0]]


@pytest.fixture(scope="module")
def context_corpus(precomputes):
    return precomputes.corpora / "context.jsonl", tuple(r["text"] for r in CORPORA["context"][0])


def engine(tiny, store, **settings):
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(tiny, graphchunk={"pool_tokens": 4096, "store_path": str(store), "mode": "isolated", **settings}, **ENGINE)


@pytest.fixture(scope="module")
def server_a(tiny, store, precomputed, precomputed_documents):
    llm = engine(tiny, store)
    yield llm
    engines.close_soon(llm)


@pytest.fixture(scope="module")
def server_b(tiny, store, server_a):
    # with a host-memory tier in front of the directory; unchunkable documents run as ordinary
    # prompts; its pool left unset (sized from the KV-cache budget at start-up)
    llm = engine(tiny, store, host_bytes=64 << 20, documents_fallback="ordinary", pool_tokens=0)
    yield llm
    engines.close_soon(llm)


def run(llm, oracle, prompt: RagPrompt, salt: str | None = None) -> dict[str, float]:
    """Generates ``prompt`` (with ``cache_salt``), checks it against the oracle (isolated: the
    masked reference; blend: LegoLink's, with the request's token count or the default's), returns
    how the counters moved."""
    ids, boundaries = llm.encode(prompt)
    params = sampling()
    params.extra_args = {**(params.extra_args or {}), **prompt.extra, "graphchunk_boundaries": boundaries}
    request = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
    before = llm.stats()
    (output,) = llm.llm.generate([request], params, use_tqdm=False)
    after = llm.stats()
    mode = prompt.extra.get("graphchunk_mode")
    check(output, split_at(ids, boundaries, **LIMITS), oracle, mode, prompt.extra.get("graphchunk_recompute_tokens"))
    return counters_moved(before, after)


def check(output, seg, oracle, mode: str | None, recompute_tokens: int | None = None) -> None:
    """``output`` against the oracle over ``seg``: isolated, the masked reference; blend, LegoLink's
    with ``recompute_tokens`` (default: the deployment default's)."""
    if mode == "blend":
        k = GraphChunkConfig().recompute_tokens if recompute_tokens is None else recompute_tokens
        assert_matches_reference(output, blend_reference(oracle, seg, f"legolink:{k}"), "blend")
    else:
        assert_matches_oracle(output, seg, oracle)


def counters_moved(before: dict, after: dict) -> dict[str, float]:
    """How the counters moved between two ``stats()``."""
    return {name: after[name] - before[name] for name in after}


def run_chat(llm, oracle, messages, documents, mode: str | None = None) -> dict[str, float]:
    """``llm.chat(messages, documents=)``: the prompt is ``place_documents``' under the model's
    template, the output the oracle's (blend: LegoLink's, asked for, with the default token count); returns
    how the counters moved."""
    before = llm.stats()
    (output,) = llm.chat(messages, sampling(), documents=documents, mode=mode,
                         recompute="legolink" if mode == "blend" else None)
    after = llm.stats()
    placed = place_documents(hf_render(llm.tokenizer), messages, documents, llm.tokenizer, max_chunks=8,
                             max_chunk_len=1 << 20)
    assert list(output.prompt_token_ids) == placed.token_ids
    check(output, split_at(placed.token_ids, placed.boundaries, **LIMITS), oracle, mode)
    return counters_moved(before, after)


def test_references_are_kept_per_oracle(oracle, tiny_oracle, tokenizer):
    """This module's tiny oracle and the session's SmolLM2 oracle share a tokenizer, so the same
    prompt is the same token ids to both: each gets its own reference (the cache is keyed by oracle)."""
    seg = split_at(tokenizer.encode(f"{SYS} ## {docs(1)[0]} ## {QUESTION}"), [0], **LIMITS)
    mine, session = reference(tiny_oracle, seg, 2), reference(oracle, seg, 2)
    assert mine is reference(tiny_oracle, seg, 2) and session is not mine
    assert (mine.logprobs[0] - session.logprobs[0]).abs().max() > 1


def test_precompute_writes_every_document(precomputed):
    result, written = precomputed
    assert "5 documents" in result.stdout
    # isolated: the sys prompt and 3 chunks; blend: 2 chunks and its (causal) sys prompt
    assert len(written) == 1 + 3 + 2 + 1
    assert "it/s" in result.stderr or "Processed prompts" in result.stderr  # vLLM's progress bar


def test_a_server_started_afterwards_serves_the_corpus_from_the_tier(server_a, tiny_oracle, corpus):
    _, corpus = corpus
    isolated = [r["text"] for r in corpus if "mode" not in r]
    moved = run(server_a, tiny_oracle, RagPrompt(SYS, isolated[::-1], QUESTION))
    assert (moved["tier_hits"], moved["misses"], moved["hits"]) == (3, 0, 0)
    assert moved["tier_loads"] == 4 and moved["tokens_computed"] < 20  # sys too; only the question is computed
    blend = [r["text"] for r in corpus if r.get("mode") == "blend"]
    legolink = {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink"}  # the oracle's blend reference
    moved = run(server_a, tiny_oracle, RagPrompt("Be brief.", blend, QUESTION, extra=legolink))
    assert (moved["tier_hits"], moved["blend_tier_hits"], moved["misses"]) == (2, 2, 0)


def test_documents_requests_hit_a_documents_precompute_from_the_first_request(server_a, tiny_oracle,
                                                                              precomputed_documents, documents_corpus):
    """--format documents: the chat template's system message (SYS) and the documents' chunks; a
    server's documents requests (GraphChunkLLM.chat, the server's renderer path) hit them, reordered."""
    result, written = precomputed_documents
    assert "3 documents" in result.stdout
    assert len(written) == 1 + 2 + 1 + 1  # isolated: sys and 2 chunks; blend: 1 chunk and its sys
    _, (titled, plain, blended) = documents_corpus
    moved = run_chat(server_a, tiny_oracle, document_messages(SYS, QUESTION), [plain, titled])
    assert (moved["tier_hits"], moved["misses"], moved["hits"]) == (2, 0, 0)
    assert moved["tier_loads"] == 3  # sys too
    moved = run_chat(server_a, tiny_oracle, document_messages("Be brief.", QUESTION), [blended], mode="blend")
    assert (moved["blend_tier_hits"], moved["misses"]) == (1, 0)


def run_separated(llm, oracle, text: str, mode: str = "isolated") -> dict[str, float]:
    """``text`` in the seeds' form (``graphchunk_separator`` '##'), checked against the oracle over
    the segments the server's splitter finds (blend: LegoLink's reference); how the counters moved."""
    params = sampling()
    params.extra_args = {**(params.extra_args or {}), "graphchunk_mode": mode,
                         **({"graphchunk_recompute": "legolink"} if mode == "blend" else {})}
    before = llm.stats()
    (output,) = llm.generate([text], params, separator="##")
    after = llm.stats()
    check(output, SeparatorSplitter(llm.tokenizer, "##", **LIMITS).split(list(output.prompt_token_ids)), oracle, mode)
    return counters_moved(before, after)


def test_seeds_form_requests_hit_a_separator_precompute(server_a, tiny_oracle, precomputed_separator, corpus):
    """--format separator: a request ``sys ## d2 ## d1 ## question`` (completions' text with
    ``graphchunk_separator``) finds its chunks, each the separator's tokens and its document's in
    context, in the tier; behind an empty sys both openings (``## d ## q``, `` ## d ## q``) hit;
    a blend request too. The same request over documents precomputed as segments finds none."""
    result, written = precomputed_separator
    assert "4 documents" in result.stdout
    assert len(written) == 2 + 2 + 1  # isolated: 2 chunks (SYS's entry is there), the empty sys' twice; blend: 1
    texts = [r["text"] for r in CORPORA["separator"][0]]
    moved = run_separated(server_a, tiny_oracle, " ## ".join([SYS, texts[1], texts[0], QUESTION]))
    assert (moved["tier_hits"], moved["misses"], moved["hits"]) == (2, 0, 0)
    for text in (f"## {texts[2]} ## {QUESTION}", f" ## {texts[2]} ## {QUESTION}"):
        moved = run_separated(server_a, tiny_oracle, text)
        assert (moved["tier_hits"], moved["misses"]) == (1, 0)
    moved = run_separated(server_a, tiny_oracle, " ## ".join(["Be brief.", texts[3], QUESTION]), "blend")
    assert (moved["blend_tier_hits"], moved["misses"]) == (1, 0)
    segments = [r["text"] for r in corpus[1] if "mode" not in r]  # precomputed (and served) as segments
    moved = run_separated(server_a, tiny_oracle, " ## ".join([SYS, *segments, QUESTION]))
    assert (moved["tier_hits"], moved["hits"], moved["misses"]) == (0, 0, 3)


def test_contextualized_entries_are_served_as_hf_computes_them_behind_their_context(
        tiny, server_a, tiny_oracle, store, context_corpus, precomputed_context):
    """``--context list``: each document's blend entry is its KV in the causal forward of
    ``sys ‖ its context ‖ it`` (the header names that context), keys moved back to [0, L). A blend
    request over [b, a] then loads both from the tier and equals HF's blend over that KV: each
    chunk's keys moved by HF's own rotary embedding from where it sat in its own precompute request
    to where it lands, 30 % of the context recomputed as the question policy picks by HF's
    attention; the same request over entries computed alone answers otherwise. A second run with
    the same settings starts no engine (the journal)."""
    result, written = precomputed_context
    a, b, c = context_corpus[1]
    assert len(written) == 3 and "0 not written" in result.stdout
    sources = {doc: split_at(*server_a.encode(RagPrompt(SYS, [*context, doc], "?")), **LIMITS)
               for doc, context in ((a, [c, b]), (b, [a]), (c, []))}
    headers = [_header(path) for path in written]
    assert sorted(h["context"] for h in headers) == sorted(
        context_identity(source.token_ids[:source.layout.chunk_starts()[-1]]) for source in sources.values())
    prompt = RagPrompt(SYS, [b, a], QUESTION, extra={"graphchunk_mode": "blend", "graphchunk_recompute": "question",
                                                     "graphchunk_recompute_ratio": 0.3, "graphchunk_recompute_block": 1})
    before = server_a.stats()
    (output,) = server_a.generate([prompt], sampling())
    moved = {name: server_a.stats()[name] - before[name] for name in before}
    assert (moved["tier_hits"], moved["misses"]) == (2, 0)
    seg = split_at(*server_a.encode(prompt), **LIMITS)
    ids, lay = list(seg.token_ids), seg.layout
    kv = {doc: tiny_oracle.contextual_kv(ids, lay, list(sources[doc].token_ids), sources[doc].layout) for doc in (a, b)}
    a_start = lay.chunk_starts()[1]  # b's KV from b's source, a's (and the question's place on) from a's
    context = [(torch.cat([kb[:, :, :a_start], ka[:, :, a_start:]], 2), torch.cat([vb[:, :, :a_start], va[:, :, a_start:]], 2))
               for (kb, vb), (ka, va) in zip(kv[b], kv[a])]
    chunk_tokens = np.arange(lay.sys_len, lay.context_len)
    scores = tiny_oracle.question_attention(ids, lay, context_kv=context)
    picked = cacheblend_tokens(chunk_tokens, scores[chunk_tokens], 0.3)
    tokens, logprobs = tiny_oracle.blend_generate(ids, lay, picked, MAX_TOKENS, context_kv=context)
    assert_matches_reference(output, Reference(tokens, logprobs), "blend over precomputed contextualized entries")
    _, alone = tiny_oracle.blend_generate(ids, lay, picked, 1)
    assert (alone[0] - logprobs[0]).abs().max() > 1e-3
    from graphchunk.tools import precompute

    again = run_main(precompute.main, precompute_argv(tiny, store, context_corpus[0], CORPORA["context"][1]),
                     ["graphchunk-precompute"])  # in this process (``inprocess``): it starts no engine
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "all 3 documents were written by an earlier run with these settings" in again.stdout


def test_an_unset_pool_over_host_memory_takes_a_quarter_of_the_kv_cache_budget_at_start_up(tiny, server_b):
    """The worker sizes the pool from the budget vLLM resolved (vLLM's own blocks are the rest:
    ``determine_available_memory``): a quarter of it, server_b having host memory below its pool."""
    import transformers

    from graphchunk.engine.worker import POOL_SHARE_OVER_HOST

    hf = transformers.AutoConfig.from_pretrained(tiny)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_bytes = ENGINE["block_size"] * 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4  # fp32 K, V
    assert server_b.stats()["pool_blocks_total"] == int(ENGINE["kv_cache_memory_bytes"] * POOL_SHARE_OVER_HOST) // block_bytes


def test_two_live_servers_reuse_each_others_chunks(server_a, server_b, tiny_oracle):
    mine = docs(3)
    moved = run(server_a, tiny_oracle, RagPrompt(SYS, mine, QUESTION))
    assert (moved["misses"], moved["tier_writes"]) == (3, 3)
    moved = run(server_b, tiny_oracle, RagPrompt(SYS, [mine[2], mine[0], mine[1]], QUESTION))
    assert (moved["tier_hits"], moved["misses"], moved["tier_rejected"]) == (3, 0, 0)
    assert moved["tier_bytes_read"] > 0
    server_b.reset_pool()  # the loaded entries stay in B's host-memory tier: no file is read again
    moved = run(server_b, tiny_oracle, RagPrompt(SYS, [mine[1], mine[2], mine[0]], QUESTION))
    assert (moved["tier_hits"], moved["tier_host_hits"], moved["tier_bytes_read"]) == (3, 4, 0)
    theirs = docs(2)
    blend = {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink", "graphchunk_recompute_tokens": 4}
    assert run(server_b, tiny_oracle, RagPrompt("Be brief.", theirs, QUESTION, extra=blend))["misses"] == 2
    moved = run(server_a, tiny_oracle, RagPrompt("Say it once.", theirs[::-1], QUESTION, extra=blend))
    assert (moved["blend_tier_hits"], moved["misses"]) == (2, 0)


AFTER_QUESTION = """{% for m in messages %}{{ m['content'] }}
{% endfor %}{% for d in documents %}{{ d['text'] }}
{% endfor %}"""
"""A chat template graphchunk cannot chunk documents under: they follow the question."""


def test_documents_fallback_runs_unchunkable_requests_as_ordinary_prompts(server_a, server_b, tiny_oracle):
    """documents_fallback='ordinary' (server B): documents its template puts after the question run
    as vLLM renders them, an ordinary prompt (HF's causal forward), counted; the separator inside a
    document splits nothing. Server A (the default, 'refuse') answers the same request with an error."""
    messages = document_messages(SYS, QUESTION)
    documents = [{"text": "Rome ## Italy"}, *({"text": d} for d in docs(1))]
    with pytest.raises(ValueError, match="places the documents after the question"):
        server_a.chat(messages, sampling(), documents=documents, chat_template=AFTER_QUESTION)
    before = server_b.stats()
    (output,) = server_b.chat(messages, sampling(), documents=documents, chat_template=AFTER_QUESTION)
    moved = {name: server_b.stats()[name] - before[name] for name in before}
    text = hf_render(server_b.tokenizer, chat_template=AFTER_QUESTION)(messages, documents)
    assert list(output.prompt_token_ids) == server_b.tokenizer.encode(text, add_special_tokens=False)
    expected, _ = tiny_oracle.causal_generate(list(output.prompt_token_ids), len(output.outputs[0].token_ids))
    assert list(output.outputs[0].token_ids) == expected
    assert (moved["documents_unchunked"], moved["lookups"]) == (1, 0)


def _header(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[12:12 + struct.unpack_from("<I", raw, 8)[0]])


def _rewrite_header(path, change) -> None:
    """A valid file (checksum recomputed) whose header ``change`` edited: another engine's file."""
    raw = path.read_bytes()
    header_len = struct.unpack_from("<I", raw, 8)[0]
    header = json.loads(raw[12:12 + header_len])
    change(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    body = new + raw[12 + header_len:-16]
    path.write_bytes(raw[:8] + struct.pack("<I", len(new)) + body + xxhash.xxh3_128_digest(body))


def test_bad_tier_files_are_never_served(server_a, server_b, store, tiny_oracle):
    """Server A computes three documents; their files are then corrupted, truncated and replaced
    by another model's; server B computes them instead (exact), removes the broken two, leaves
    the foreign one to its owner and writes its own over all three."""
    bad = docs(3)
    files = []
    for doc in bad:  # one request each, so each new file is known
        before = tier_files(store)
        assert run(server_a, tiny_oracle, RagPrompt(SYS, [doc], QUESTION))["misses"] == 1
        (new,) = tier_files(store) - before
        files.append(new)
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    files[1].write_bytes(files[1].read_bytes()[:-1000])
    _rewrite_header(files[2], lambda h: h["engine"].update(weights_digest="another model"))
    moved = run(server_b, tiny_oracle, RagPrompt(SYS, bad, QUESTION))
    assert (moved["tier_rejected"], moved["tier_hits"], moved["misses"], moved["tier_writes"]) == (3, 0, 3, 3)
    for path in files:  # B's own files now, complete
        assert path.exists()
        assert b"another model" not in path.read_bytes()
    moved = run(server_a, tiny_oracle, RagPrompt(SYS, bad[::-1], QUESTION))
    assert moved["tier_rejected"] == 0  # A still holds them in its pool: hits
    assert moved["hits"] == 3


def test_tenants_never_share_tier_entries(server_a, server_b, tiny_oracle):
    (doc,) = docs(1)
    assert run(server_a, tiny_oracle, RagPrompt(SYS, [doc], QUESTION), salt="tenant-1")["misses"] == 1
    moved = run(server_b, tiny_oracle, RagPrompt(SYS, [doc], QUESTION), salt="tenant-2")
    assert (moved["tier_hits"], moved["misses"]) == (0, 1)
    moved = run(server_b, tiny_oracle, RagPrompt(SYS, [doc], QUESTION), salt="tenant-1")
    assert (moved["tier_hits"], moved["misses"]) == (1, 0)
    moved = run(server_b, tiny_oracle, RagPrompt(SYS, [doc], QUESTION))
    assert (moved["tier_hits"], moved["misses"]) == (0, 1)


def test_no_reference_or_block_leaks(server_a, server_b):
    for llm in (server_a, server_b):
        stats = llm.stats()
        assert stats["pool_refs_held"] == 0 and stats["pool_blocks_leaked"] == 0
        assert stats["tier_write_errors"] == 0


def test_a_store_key_signs_every_file_a_server_writes(tiny, tiny_oracle, tmp_path):
    """``store_key_file`` reaches the workers' tier: the engine answers as the oracle does, and every
    file it writes is keyed (its header says so, and the unkeyed checksum does not match it), so a
    writer without the key cannot make one it serves (``test_store``)."""
    import os

    key = tmp_path / "tier.key"
    key.write_bytes(os.urandom(32))
    store = engines.scratch("keyed-tier")
    llm = engine(tiny, store, store_key_file=str(key))
    try:
        moved = run(llm, tiny_oracle, RagPrompt(SYS, docs(2), QUESTION))
    finally:
        engines.close_soon(llm)
    files = tier_files(store)
    assert len(files) == moved["tier_writes"] >= 2
    assert all(_header(path)["mac"] == "keyed" for path in files)
    assert all(xxhash.xxh3_128_digest(raw[12:-16]) != raw[-16:] for raw in map(Path.read_bytes, files))
