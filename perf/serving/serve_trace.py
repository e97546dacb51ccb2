"""The serving benchmark's traces: RAG requests over CPython help-topic text, written as JSONL rows
for ``vllm bench serve --dataset-name custom`` (no I/O beyond the tokenizer and the files written).

* ``Level`` / ``build_levels()``: one disjoint slice of the corpus per concurrency level (cold on
  a level = documents its server never saw), each with a fixed Zipf popularity order over its
  documents, and two traces drawn over it from that popularity: ``cold`` and ``warm`` (the same
  documents, other combinations, orders, system prompts and questions);
* ``chat_rows()`` / ``completion_rows()``: the rows of a trace as each server kind is sent them;
* ``write_jsonl()``, ``precompute_corpus()`` (``graphchunk-precompute --format documents`` lines),
  ``working_set_tokens()`` (the pool entries a level's traces need).

Chat rows: ``{"prompt", "messages", "documents"}`` for graphchunk (the documents travel in the
request body's ``documents`` field, as RAG clients send them), ``{"prompt", "messages"}`` for
vanilla vLLM, whose user message carries the same documents written in as graphchunk places them
(``graphchunk.documents.inlined``): the same prompt tokens. ``prompt`` (the question) is only
there because vLLM's custom loader requires the column; the shim in ``bench_serve.py`` sends
``messages`` and ``documents``. Completion rows: ``{"prompt": "sys ## doc ## ... ## question"}``,
the same text for every kind (graphchunk splits at the separators), sent as is.

Corpus, system prompts and popularity weights come from ``perf.common.trace`` (the soak's). Deterministic:
the same tokenizer, arguments and seed give the same rows.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from perf.common.trace import SEP, SYSTEMS, build_corpus, zipf_weights

from graphchunk.cache.pool import cdiv


@dataclass(frozen=True)
class Request:
    sys: str
    doc_ids: tuple[int, ...]
    """Indices into ``Level.docs`` (a level's own documents)."""
    question: str


@dataclass
class Level:
    concurrency: int
    docs: list[dict[str, str]]
    """{"title", "text"}: the documents as a RAG client sends them."""
    doc_tokens: list[int]
    traces: dict[str, list[Request]]
    """'cold' and 'warm'."""
    token_gaps: dict[str, list[int | None]] = field(default_factory=dict)
    """Per trace: ``expected_token_gap`` of each request (chat form), 0 for completions."""


def build_levels(tokenizer, concurrencies: list[int], args, rng: random.Random) -> list[Level]:
    """A corpus of ``len(concurrencies) * args.docs_per_level`` documents cut into one slice per
    level; per level a popularity order (a random permutation, Zipf(``args.zipf``) weights by
    rank) and the two traces of ``args.num_prompts[level]`` requests drawn from it."""
    import numpy as np

    total = len(concurrencies) * args.docs_per_level
    corpus = build_corpus(tokenizer, total, args.doc_tokens, args.questions, args.question_words, rng)
    levels = []
    for i, c in enumerate(concurrencies):
        lo = i * args.docs_per_level
        docs = [{"title": f"Python reference, part {lo + j + 1}", "text": text}
                for j, text in enumerate(corpus.docs[lo:lo + args.docs_per_level])]
        nrng = np.random.default_rng(rng.randrange(2**32))
        order = nrng.permutation(len(docs))
        traces = {phase: draw_trace(order, args.zipf, args.num_prompts[i], args.docs_per_prompt,
                                    corpus.questions, nrng, rng) for phase in ("cold", "warm")}
        levels.append(Level(c, docs, corpus.doc_tokens[lo:lo + args.docs_per_level], traces))
    return levels


def draw_trace(order, zipf: float, n: int, k: int, questions: list[str], nrng, rng: random.Random) -> list[Request]:
    """``n`` requests: a system prompt (uniform over ``SYSTEMS``), ``k`` distinct documents drawn by
    popularity (rank r of ``order`` has weight ~ r^-zipf), in the drawn order, and a question."""
    popularity = zipf_weights(len(order), zipf)
    trace = []
    for _ in range(n):
        ranks = nrng.choice(len(order), size=k, replace=False, p=popularity)
        trace.append(Request(rng.choice(SYSTEMS), tuple(int(order[r]) for r in ranks), rng.choice(questions)))
    return trace


def chat_rows(level: Level, phase: str, documents_field: bool) -> list[dict]:
    """The rows of a level's trace as chat requests: with the ``documents`` field (graphchunk), or
    the documents inlined into the user message as graphchunk places them (vanilla)."""
    from graphchunk.documents import document_messages, inlined

    rows = []
    for req in level.traces[phase]:
        messages = document_messages(req.sys, req.question)
        documents = [level.docs[d] for d in req.doc_ids]
        if documents_field:
            rows.append({"prompt": req.question, "messages": messages, "documents": documents})
        else:
            rows.append({"prompt": req.question, "messages": inlined(messages, documents)})
    return rows


def completion_rows(level: Level, phase: str) -> list[dict]:
    """The rows as completions prompts: ``sys ## doc text ## ... ## question``."""
    return [{"prompt": SEP.join([req.sys, *(level.docs[d]["text"] for d in req.doc_ids), req.question])}
            for req in level.traces[phase]]


def expected_token_gap(tokenizer, level: Level, phase: str) -> list[int | None]:
    """Per chat request of the trace: vanilla's prompt tokens minus graphchunk's, as both will count
    them, or None where the two prompt texts differ. graphchunk places the documents with the
    chat template (``place_documents``, what its server runs) and tokenizes segment by segment;
    vanilla's server tokenizes the inlined messages' rendering whole. The same text may take a
    different number of tokens: SmolLM2's tokenizer makes the "\\n\\n" ending a segment one token
    and, before the next document's first word, two."""
    from graphchunk.documents import document_messages, hf_render, inlined, place_documents

    render = hf_render(tokenizer)
    gaps = []
    for req in level.traces[phase]:
        messages = document_messages(req.sys, req.question)
        documents = [level.docs[d] for d in req.doc_ids]
        placed = place_documents(render, messages, documents, tokenizer, max_chunks=len(documents),
                                 max_chunk_len=1 << 20)
        text = render(inlined(messages, documents), None)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        gaps.append(len(ids) - len(placed.token_ids) if text == placed.text else None)
    return gaps


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def precompute_corpus(levels: list[Level], mode: str) -> list[dict]:
    """``graphchunk-precompute --format documents`` corpus lines for every document of every level:
    the whole document (``{"document": ..., "sys": ...}``), once per system prompt in isolated mode
    (its entries are keyed by the system prompt too), once in blend mode (they are not)."""
    systems = SYSTEMS if mode == "isolated" else SYSTEMS[:1]
    lines = []
    for level in levels:
        for doc in level.docs:
            lines += [{"document": doc, "sys": sys_prompt, "mode": mode} for sys_prompt in systems]
    return lines


def working_set_tokens(level: Level, mode: str, block_size: int, header_tokens: int = 16) -> int:
    """An upper bound of the pool tokens a level's two traces need: each distinct entry (isolated:
    (system prompt, document); blend: the document) rounded up to whole blocks, plus a block of
    margin for its start offset and ``header_tokens`` for the template text around it."""
    entries = {(req.sys if mode == "isolated" else "", d) for trace in level.traces.values()
               for req in trace for d in req.doc_ids}
    blocks = sum(cdiv(level.doc_tokens[d] + header_tokens, block_size) + 1 for _, d in entries)
    return blocks * block_size
