"""The soaks' workload (``perf/soak``; ``perf/serving/serve_trace`` builds on it): text, corpus,
Zipf trace and the request encoder (no I/O beyond the tokenizer).

* ``build_corpus()``: documents, questions and the canaries' unused documents cut from
  CPython's help topics (``graphchunk.reference.text.help_paragraphs``, as the tests read them),
  seeded by the caller's ``random.Random``;
* ``Item`` / ``build_trace()``: one request of the trace (system prompt, documents by Zipf
  popularity, question, text or token-id form, client action and its delay share);
* ``working_set_tokens()``: the KV tokens the trace's distinct pool entries hold;
* ``Encoder``: an item as the server sees it (text with separators, or token ids with
  boundaries) and the ``/v1/completions`` body.

Deterministic: the same tokenizer, arguments and seed give the same corpus and trace.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

SEP = " ## "
SYSTEMS = (
    "You answer questions about Python using only the documents below.",
    "Answer from the documents. Be brief and precise.",
    "You are a Python expert. Use only the documents, and say so when they do not answer the question.",
)
CANARY_SYS = "Canary system prompt {}: answer only from these documents, which nobody else sends."
ACTIONS = ("complete", "abort_stream", "abort_prefill", "abort_nostream")


# --- text ---------------------------------------------------------------------------------------

@dataclass
class Corpus:
    systems: list[str]
    docs: list[str]
    doc_tokens: list[int]
    questions: list[str]
    canary_docs: list[str]
    """Documents no trace request uses: two per canary, and two for the final check."""


def build_corpus(tokenizer, num_docs: int, doc_tokens: tuple[int, int], num_questions: int,
                 question_words: tuple[int, int], rng: random.Random) -> Corpus:
    """Documents of log-uniform length in ``doc_tokens`` cut from consecutive paragraphs (each
    starts a fresh paragraph, so all differ), questions from word windows of other paragraphs."""
    from graphchunk.reference.text import help_paragraphs

    pool = help_paragraphs()
    rng.shuffle(pool)
    texts, lengths = [], []
    for _ in range(num_docs + 6):
        target = int(round(math.exp(rng.uniform(math.log(doc_tokens[0]), math.log(doc_tokens[1])))))
        ids: list[int] = []
        while len(ids) < target:
            if not pool:
                raise SystemExit(f"the corpus ran out of text after {len(texts)} documents: ask for fewer "
                                 f"--docs or shorter --doc-tokens")
            ids += tokenizer.encode(" " + pool.pop(), add_special_tokens=False)
        text = tokenizer.decode(ids[:target]).strip()
        texts.append(text)
        lengths.append(len(tokenizer.encode(" " + text, add_special_tokens=False)))
    source = help_paragraphs()
    questions = []
    for _ in range(num_questions):
        words = rng.choice(source).split()
        n = rng.randint(*question_words)
        start = rng.randrange(max(1, len(words) - n))
        questions.append(f"Question: {' '.join(words[start:start + n]).rstrip('.,;:')}?\nAnswer:")
    return Corpus(list(SYSTEMS), texts[:num_docs], lengths[:num_docs], questions, texts[num_docs:])


# --- trace --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    index: int
    sys: str
    docs: tuple[str, ...]
    question: str
    as_ids: bool
    action: str = "complete"
    delay: float = 0.0
    """abort_prefill / abort_nostream: share of the typical time to first token / latency waited."""
    doc_ids: tuple[int, ...] = ()
    tag: str = ""
    """'' for trace requests; canary / final requests are tagged."""


def zipf_weights(n: int, s: float) -> list[float]:
    weights = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def build_trace(corpus: Corpus, args, rng: random.Random) -> list[Item]:
    """Zipf popularity over a random permutation of the documents (popularity independent of
    length); per request 1 system prompt (uniform), k documents (no repeats, popularity-drawn,
    in random order), a question, a format and an action."""
    import numpy as np

    nrng = np.random.default_rng(rng.randrange(2**32))
    order = nrng.permutation(len(corpus.docs))
    popularity = zipf_weights(len(corpus.docs), args.zipf)
    rates = {"abort_stream": args.abort_stream, "abort_prefill": args.abort_prefill,
             "abort_nostream": args.abort_nostream}
    items = []
    for index in range(args.requests):
        k = rng.randint(*args.docs_per_request)
        ranks = nrng.choice(len(corpus.docs), size=k, replace=False, p=popularity)
        doc_ids = tuple(int(order[r]) for r in ranks)
        action = draw_action(rng, rates)
        items.append(Item(index, rng.choice(corpus.systems), tuple(corpus.docs[d] for d in doc_ids),
                          rng.choice(corpus.questions), rng.random() < args.ids_fraction, action,
                          rng.random(), doc_ids))
    return items


def draw_action(rng: random.Random, rates: dict[str, float]) -> str:
    """A request's client action: each of ``rates``' abort kinds at its rate, else 'complete'."""
    u = rng.random()
    for name, rate in rates.items():
        if u < rate:
            return name
        u -= rate
    return "complete"


def working_set_tokens(items: list[Item], corpus: Corpus, sys_tokens: dict[str, int]) -> int:
    """Tokens of KV the trace's distinct pool entries hold (isolated keys are (sys, chunk); the
    text and token-id forms of a document are different chunks)."""
    lengths = {doc: n for doc, n in zip(corpus.docs, corpus.doc_tokens)}
    entries = {(item.sys, doc, item.as_ids) for item in items for doc in item.docs}
    systems = {item.sys for item in items}
    return sum(lengths[doc] + sys_tokens[s] for s, doc, _ in entries) + sum(sys_tokens[s] for s in systems)


class Encoder:
    """Prompts as the server sees them: text with separators, or token ids with boundaries."""

    def __init__(self, tokenizer, model: str, max_tokens: int):
        self.tokenizer = tokenizer
        self.model = model
        self.max_tokens = max_tokens
        self.prefix = tokenizer("").input_ids  # what the tokenizer adds in front (none for SmolLM2)

    def text(self, item: Item) -> str:
        return SEP.join([item.sys, *item.docs, item.question])

    def ids(self, item: Item) -> tuple[list[int], list[int]]:
        encode = self.tokenizer.encode
        token_ids = self.prefix + encode(item.sys, add_special_tokens=False)
        boundaries = [len(token_ids)]
        for doc in item.docs:
            token_ids = token_ids + encode(" " + doc, add_special_tokens=False)
            boundaries.append(len(token_ids))
        return token_ids + encode(" " + item.question, add_special_tokens=False), boundaries

    def body(self, item: Item, stream: bool) -> dict:
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}
        if item.as_ids:
            body["prompt"], boundaries = self.ids(item)
            body["vllm_xargs"] = {"graphchunk_boundaries": boundaries}
        else:
            body["prompt"] = self.text(item)
        return body
