"""``graphchunk-precompute``: fills a persistent chunk tier from a corpus, so a deployment starts warm.

    graphchunk-precompute --store /srv/graphchunk --corpus docs.jsonl [--model PATH] [--mode isolated]
        [--sys "Answer from the documents."] [--format segments|documents|separator] [--separator "##"]
        [--chat-template T] [--dtype bfloat16] [--block-size 128]

The corpus is JSONL, one document per line: ``{"text": "...", "sys": "...", "mode": "isolated"}``,
or ``{"document": {"title": "...", "text": "..."}, ...}`` for a documents request's document with
more fields (``sys`` and ``mode`` optional, defaulting to ``--sys`` and ``--mode``; mode 'auto',
the default, is the engine's default mode, as for a server with the default ``graphchunk.mode``). Each document
is run once as a one-chunk request through a ``GraphChunkLLM`` engine whose ``store_path`` is the
tier, with one generated token; the chunk's KV (and the sys prompt's) is written through to the
tier, and a server started on the same directory serves it as tier hits from its first request.

With ``--context list`` or ``--context bm25`` the blend entries are contextualized (FusionRAG's
offline method, docs/tier.md): each document is computed behind the system prompt and a context
of other documents of the corpus, chosen by the operator's data: the line's ``context`` (the ``id``
of other lines) or its ``--context-size`` most related documents by BM25 (bm25s over the corpus'
texts; the most related sits next to it). The engine (``blend_entries`` 'precompute') runs each
``context ‖ document`` request as vLLM's full prefill and writes the document's KV, keys moved
back to where an entry holds them, as the document's blend entry, the context's identity in the
file's header; a server then serves it to every blend request without a ``cache_salt`` that
carries the document (the others' documents: entries computed alone). Runs resume: documents
recorded in the store's ``precompute-context.jsonl`` under the same settings and context are
skipped.

Which requests hit: the tier is keyed by the chunk's tokens (isolated mode: also the sys
prompt's), so the server's requests must tokenize documents as the precompute did.
``--format segments`` tokenizes as ``GraphChunkLLM.generate(sys=, chunks=, question=)`` and as a
client sending token ids with ``graphchunk_boundaries`` built segment by segment.
``--format documents`` sends each document as a chat request's ``documents`` (the system message
``sys``, none when it is empty, then the user's question) through vLLM's ``LLM.chat`` path, so the
engine's chat template (``--chat-template`` as the server's) places and tokenizes it exactly as
for the server's documents requests and ``GraphChunkLLM.chat(documents=...)``; their isolated
chunks hit behind the same system message. ``--format chat`` is its earlier name.
``--format separator`` sends each document in the seeds' form, ``sys ## document ## ?`` (the
``--separator`` joined with a space each side, as ``" ## ".join([sys, *documents, question])``
writes it), as a text prompt split at that separator by the server's own code, so the chunk is
the separator's tokens and the document's, tokenized in context, exactly as in such a request
over any documents in any order (completions with ``graphchunk_separator`` or a deployment's
``separator``); with an empty sys also ``## document ## ?``, whose first chunk opens the text
without the space (``separator_prompts``). Its documents are text only, like segments'. Files are
specific to the engine's model weights, dtype, block size and tensor-parallel layout: start it
with the server's (a file made under another is ignored and counted in
``vllm:graphchunk_tier_rejected_total``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from graphchunk.config import MODE_SETTINGS
from graphchunk.tools import corpus_context

QUESTION = "?"
"""The one-token question each document's request ends with (its KV is never stored)."""
FORMS = ("segments", "documents", "separator")
"""How the requests the tier serves are sent (``--format``; 'chat' is documents' earlier name)."""
SEPARATOR = "##"
"""``--format separator``'s default separator (the seeds' form, ``sys ## d1 ## d2 ## question``)."""


def read_corpus(path: str | Path, sys_prompt: str, mode: str,
                text_only: bool = False) -> dict[tuple[str, str], list[dict[str, str]]]:
    """Documents grouped by (sys, mode), in file order, duplicates once; errors name the line. A
    line's document is its ``document`` object or ``{"text": text}``; ``text_only`` (``--format
    segments``, ``separator``) refuses documents with other fields."""
    groups: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    seen = set()
    for where, record, document in corpus_context.corpus_lines(path, text_only):
        key = (record.get("sys", sys_prompt), record.get("mode", mode))
        if not isinstance(key[0], str) or key[1] not in MODE_SETTINGS:
            raise ValueError(f"{where}: 'sys' must be a string and 'mode' one of {', '.join(MODE_SETTINGS)}")
        identity = (key, tuple(document.items()))
        if identity not in seen:
            seen.add(identity)
            groups[key].append(document)
    return groups


TIER_COUNTERS = ("tier_writes", "tier_bytes_written", "tier_hits", "tier_rejected", "tier_write_errors", "misses")


def precompute(llm, groups: dict[tuple[str, str], list[dict[str, str]]], form: str, progress: bool = True,
               separator: str = SEPARATOR) -> dict:
    """Runs every document once, alone, in ``form`` (``FORMS``); returns the tier counters moved
    and the time taken."""
    from vllm import SamplingParams

    before, start = llm.stats(), time.monotonic()
    for (sys_prompt, mode), docs in groups.items():
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                extra_args=None if mode == "auto" else {"graphchunk_mode": mode})
        _run(llm, [(sys_prompt, [doc]) for doc in docs], params, form, progress, separator, both_openings=True)
    return {"documents": sum(map(len, groups.values())), "seconds": time.monotonic() - start,
            **_moved(before, llm.stats())}


def contextualized(groups, contexts: dict) -> list[tuple[str, dict[str, str], list[dict[str, str]]]]:
    """(sys prompt, document, its context) of every document of ``groups``; ``contexts``: per
    document's identity, the documents before it (``corpus_context.contexts``)."""
    return [(sys_prompt, doc, contexts[tuple(doc.items())]) for (sys_prompt, _), docs in groups.items() for doc in docs]


def precompute_contextualized(llm, todo: list, form: str, journal: corpus_context.Journal,
                              progress: bool = True, separator: str = SEPARATOR) -> dict:
    """Runs each document of ``todo`` (``contextualized``) behind its context as one blend request
    of the ``blend_entries`` 'precompute' engine, in batches; a batch all of whose documents were
    written to the tier is recorded in ``journal``, whose documents are skipped. Returns the
    counters moved, documents skipped and left unwritten."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"graphchunk_mode": "blend"})
    left = [item for item in todo if not journal.done(*item)]
    before, start, unwritten = llm.stats(), time.monotonic(), 0
    bar = corpus_context.progress_bar(len(todo), len(todo) - len(left), progress)
    for batch in corpus_context.batches(left, journal.batch_size):
        written = llm.stats()["tier_writes"]
        _run(llm, [(sys_prompt, [*context, doc]) for sys_prompt, doc, context in batch], params, form, False,
             separator)
        if llm.stats()["tier_writes"] - written == len(batch):
            journal.record(batch)
        else:
            unwritten += len(batch)
        bar.update(len(batch))
    bar.close()
    return {"documents": len(todo), "seconds": time.monotonic() - start, "skipped": len(todo) - len(left),
            "unwritten": unwritten, **_moved(before, llm.stats())}


def separator_prompts(sys_prompt: str, texts: list[str], separator: str = SEPARATOR,
                      both_openings: bool = False) -> list[str]:
    """The seeds'-form text of one request over ``texts``: ``sys ## d1 ## ... ## ?``, the
    separator with a space each side. A byte-level BPE splits words at spaces before it merges, so
    each chunk, `` ##`` and its document (up to the next `` ##``), is tokenized as in any such text
    over any documents. With an empty sys and ``both_openings``, also the form that opens with the
    separator, ``## d1 ## ... ## ?`` (the seed documents'), whose first chunk starts with the
    separator's tokens without the space: its own entry."""
    text = f" {separator.strip()} ".join([sys_prompt, *texts, QUESTION])
    return [text, text[1:]] if both_openings and not sys_prompt else [text]


def unsplit(groups: dict[tuple[str, str], list[dict[str, str]]], separator: str = SEPARATOR) -> list[str]:
    """The documents of ``groups`` that the server's own rule would not cut out of their
    ``separator_prompts`` text (``segments``: a separator that is the first word of a line is
    text): one whose last line is blank (it ends in a newline), or behind a sys that ends in one.
    Such a document would run into its neighbour and get no entry of its own."""
    from graphchunk.segments import _find_all

    needle, bad = separator.strip(), []
    for (sys_prompt, _), docs in groups.items():
        for doc in docs:
            text = separator_prompts(sys_prompt, [doc["text"]], separator)[0]
            first = len(sys_prompt) + 1
            cuts = {begin for begin, _ in _find_all(text, needle)}
            if not {first, first + len(needle) + 2 + len(doc["text"])} <= cuts:
                bad.append(doc["text"])
    return bad


def _run(llm, requests: list[tuple[str, list[dict[str, str]]]], params, form: str, progress: bool,
         separator: str = SEPARATOR, both_openings: bool = False) -> None:
    """One request per (sys prompt, documents), run together: a documents chat request (vLLM's
    renderer places and tokenizes them, as for the server's), segments, or the seeds' form's text
    split at ``separator`` by the server's own code (``separator_prompts``)."""
    from graphchunk.documents import document_messages
    from graphchunk.llm import RagPrompt

    if form == "separator":
        texts = [text for sys_prompt, docs in requests
                 for text in separator_prompts(sys_prompt, [d["text"] for d in docs], separator, both_openings)]
        llm.generate(texts, params, use_tqdm=progress, separator=separator)
    elif form == "documents":  # vLLM's LLM.chat path
        for sys_prompt, docs in requests:
            llm.llm.enqueue_chat(document_messages(sys_prompt, QUESTION), params, use_tqdm=False,
                                 chat_template_kwargs={"documents": docs})
        llm.llm.wait_for_completion(use_tqdm=progress)
    else:
        llm.generate([RagPrompt(sys_prompt, [d["text"] for d in docs], QUESTION) for sys_prompt, docs in requests],
                     params, use_tqdm=progress)


def _moved(before: dict, after: dict) -> dict:
    return {name: after[name] - before[name] for name in TIER_COUNTERS}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphchunk-precompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the tier directory (graphchunk.store_path)")
    parser.add_argument("--store-key-file", default="",
                        help="the servers' graphchunk.store_key_file: files signed so that they serve them")
    parser.add_argument("--corpus", required=True,
                        help="JSONL: one {\"text\" or \"document\", \"sys\"?, \"mode\"?} per line")
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    parser.add_argument("--mode", default="auto", choices=MODE_SETTINGS,
                        help="the mode the server's requests run in (auto: its default, blend where the model can blend)")
    parser.add_argument("--sys", default="", help="sys prompt of documents whose line gives none")
    parser.add_argument("--format", default="segments", choices=(*FORMS, "chat"),
                        help="the requests' form: segments, documents (chat: the same as documents), or "
                             "separator (text split at --separator)")
    parser.add_argument("--separator", default=SEPARATOR,
                        help="--format separator: the requests' separator (graphchunk_separator or the server's)")
    parser.add_argument("--chat-template", default=None, help="the server's --chat-template, if it has one")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=None, help="the server's --block-size (vLLM's default)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--context", default="none", choices=("none", "list", "bm25"),
                        help="contextualized blend entries: each document computed behind the line's 'context' "
                             "(ids of other lines) or its --context-size most related documents by BM25")
    parser.add_argument("--context-size", type=int, default=2, help="documents before each one (--context bm25)")
    parser.add_argument("--batch", type=int, default=64, help="documents per batch (--context: resumable per batch)")
    parser.add_argument("--graphchunk", default="{}", help="other graphchunk settings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    form = "documents" if args.format == "chat" else args.format
    text_only = form != "documents"
    if not args.separator.strip():
        print("graphchunk-precompute: --separator must hold a non-whitespace character", file=sys.stderr)
        return 2
    try:
        groups = read_corpus(args.corpus, args.sys, args.mode, text_only=text_only)
        extra = json.loads(args.graphchunk)
        contexts = None
        if args.context != "none":
            contexts = corpus_context.contexts(args.corpus, groups, args.context, args.context_size, text_only)
    except (OSError, ValueError, ImportError) as exc:
        print(f"graphchunk-precompute: {exc}", file=sys.stderr)
        return 2
    if not groups:
        print(f"graphchunk-precompute: {args.corpus} holds no documents", file=sys.stderr)
        return 2
    lost = unsplit(groups, args.separator) if form == "separator" else []
    if lost:
        shown = "; ".join(repr(text[:40] + ("..." if len(text) > 40 else "")) for text in lost[:5])
        print(f"graphchunk-precompute: {len(lost)} documents would get no entry of their own in the seeds' form: a "
              f"separator that begins a line is not split at (the server's rule), and the one after each of these "
              f"does (the document ends in a newline, or its sys does): {shown}; strip the trailing newlines "
              f"(the server's requests must send the documents so too)", file=sys.stderr)
        return 2
    journal = todo = None
    if contexts is not None:
        setup = {key: getattr(args, key) for key in ("model", "dtype", "block_size", "tensor_parallel_size",
                                                     "format", "chat_template", "context", "context_size")}
        if form == "separator":
            setup["separator"] = args.separator.strip()
        journal = corpus_context.Journal(args.store, setup, args.batch)
        todo = contextualized(groups, contexts)
        if all(journal.done(*item) for item in todo):
            print(f"graphchunk-precompute: all {len(todo)} documents were written by an earlier run with these "
                  f"settings ({journal.path}); nothing to compute")
            return 0
    from graphchunk import GraphChunkLLM

    engine = {key: value for key, value in (("block_size", args.block_size), ("max_model_len", args.max_model_len),
                                            ("chat_template", args.chat_template)) if value is not None}
    settings = {**extra, "store_path": args.store}
    if args.store_key_file:
        settings["store_key_file"] = args.store_key_file
    if contexts is not None:
        settings.update(blend_entries="precompute", mode="blend")
    with GraphChunkLLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                       kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=True,
                       graphchunk=settings, **engine) as llm:
        try:
            if contexts is None:
                result = precompute(llm, groups, form, separator=args.separator)
            else:
                result = precompute_contextualized(llm, todo, form, journal, separator=args.separator)
        except ValueError as exc:  # a document the engine refuses (too long, ...): named by vLLM's error
            print(f"graphchunk-precompute: {exc}", file=sys.stderr)
            return 2
    print(f"graphchunk-precompute: {result['documents']} documents in {result['seconds']:.1f} s: "
          f"{result['tier_writes']:.0f} tier files written ({result['tier_bytes_written'] / 2**20:.1f} MiB), "
          f"{result['tier_hits']:.0f} already there, {result['tier_write_errors']:.0f} write errors"
          + (f"; {result['skipped']} done by an earlier run, {result['unwritten']} not written "
             f"(their batches are run again next time)" if contexts is not None else ""))
    return 1 if result["tier_write_errors"] or result.get("unwritten") else 0


if __name__ == "__main__":
    sys.exit(main())
