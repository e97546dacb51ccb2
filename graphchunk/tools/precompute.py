"""``graphchunk-precompute``: fills a persistent chunk tier from a corpus, so a deployment starts warm.

    graphchunk-precompute --store /srv/graphchunk --corpus docs.jsonl [--model PATH] [--mode isolated]
        [--sys "Answer from the documents."] [--format segments|documents] [--chat-template T]
        [--dtype bfloat16] [--block-size 128]

The corpus is JSONL, one document per line: ``{"text": "...", "sys": "...", "mode": "isolated"}``,
or ``{"document": {"title": "...", "text": "..."}, ...}`` for a documents request's document with
more fields (``sys`` and ``mode`` optional, defaulting to ``--sys`` and ``--mode``; mode 'auto',
the default, is the engine's default mode, as for a server with the default ``graphchunk.mode``). Each document
is run once as a one-chunk request through a ``GraphChunkLLM`` engine whose ``store_path`` is the
tier, with one generated token; the chunk's KV (and the sys prompt's) is written through to the
tier, and a server started on the same directory serves it as tier hits from its first request.

Which requests hit: the tier is keyed by the chunk's tokens (isolated mode: also the sys
prompt's), so the server's requests must tokenize documents as the precompute did.
``--format segments`` tokenizes as ``GraphChunkLLM.generate(sys=, chunks=, question=)`` and as a
client sending token ids with ``graphchunk_boundaries`` built segment by segment.
``--format documents`` sends each document as a chat request's ``documents`` (the system message
``sys``, none when it is empty, then the user's question) through vLLM's ``LLM.chat`` path, so the
engine's chat template (``--chat-template`` as the server's) places and tokenizes it exactly as
for the server's documents requests and ``GraphChunkLLM.chat(documents=...)``; their isolated
chunks hit behind the same system message. ``--format chat`` is its earlier name. Files are
specific to the engine's model weights, dtype, block size and tensor-parallel layout: start it
with the server's (a file made under another is ignored and counted in
``graphchunk_tier_rejected_total``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from graphchunk.config import MODE_SETTINGS

QUESTION = "?"
"""The one-token question each document's request ends with (its KV is never stored)."""


def read_corpus(path: str | Path, sys_prompt: str, mode: str,
                text_only: bool = False) -> dict[tuple[str, str], list[dict[str, str]]]:
    """Documents grouped by (sys, mode), in file order, duplicates once; errors name the line. A
    line's document is its ``document`` object or ``{"text": text}``; ``text_only`` (``--format
    segments``) refuses documents with other fields."""
    from graphchunk.documents import DocumentError, validate_documents

    groups: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    seen = set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not JSON: {exc}") from None
            if not isinstance(record, dict) or ("text" in record) == ("document" in record):
                raise ValueError(f"{where}: each line needs a non-empty string 'text' or a 'document' object, not both")
            document = record["document"] if "document" in record else {"text": record["text"]}
            try:
                validate_documents([document], max_chunks=1)
            except DocumentError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if text_only and list(document) != ["text"]:
                raise ValueError(f"{where}: --format segments sends a document's text only; this one has "
                                 f"other fields (use --format documents)")
            key = (record.get("sys", sys_prompt), record.get("mode", mode))
            if not isinstance(key[0], str) or key[1] not in MODE_SETTINGS:
                raise ValueError(f"{where}: 'sys' must be a string and 'mode' one of {', '.join(MODE_SETTINGS)}")
            identity = (key, tuple(document.items()))
            if identity not in seen:
                seen.add(identity)
                groups[key].append(document)
    return groups


def precompute(llm, groups: dict[tuple[str, str], list[dict[str, str]]], documents: bool,
               progress: bool = True) -> dict:
    """Runs every document once, as a documents chat request (``documents``: vLLM's renderer
    places and tokenizes it, as for the server's) or as segments; returns the tier counters
    moved and the time taken."""
    from vllm import SamplingParams

    from graphchunk.documents import document_messages
    from graphchunk.llm import RagPrompt

    before, start = llm.stats(), time.monotonic()
    for (sys_prompt, mode), docs in groups.items():
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                extra_args=None if mode == "auto" else {"graphchunk_mode": mode})
        if documents:  # vLLM's LLM.chat path, one request per document, run together below
            for doc in docs:
                llm.llm.enqueue_chat(document_messages(sys_prompt, QUESTION), params, use_tqdm=False,
                                     chat_template_kwargs={"documents": [doc]})
        else:
            llm.generate([RagPrompt(sys_prompt, [doc["text"]], QUESTION) for doc in docs], params, use_tqdm=progress)
    if documents:
        llm.llm.wait_for_completion(use_tqdm=progress)
    after = llm.stats()
    moved = {name: after[name] - before[name] for name in ("tier_writes", "tier_bytes_written", "tier_hits",
                                                            "tier_rejected", "tier_write_errors", "misses")}
    return {"documents": sum(map(len, groups.values())), "seconds": time.monotonic() - start, **moved}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphchunk-precompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the tier directory (graphchunk.store_path)")
    parser.add_argument("--corpus", required=True,
                        help="JSONL: one {\"text\" or \"document\", \"sys\"?, \"mode\"?} per line")
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    parser.add_argument("--mode", default="auto", choices=MODE_SETTINGS,
                        help="the mode the server's requests run in (auto: its default, blend where the model can blend)")
    parser.add_argument("--sys", default="", help="sys prompt of documents whose line gives none")
    parser.add_argument("--format", default="segments", choices=("segments", "documents", "chat"),
                        help="the requests' form: segments, or documents (chat: the same as documents)")
    parser.add_argument("--chat-template", default=None, help="the server's --chat-template, if it has one")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=None, help="the server's --block-size (vLLM's default)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--graphchunk", default="{}", help="other graphchunk settings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        groups = read_corpus(args.corpus, args.sys, args.mode, text_only=args.format == "segments")
        extra = json.loads(args.graphchunk)
    except (OSError, ValueError) as exc:
        print(f"graphchunk-precompute: {exc}", file=sys.stderr)
        return 2
    if not groups:
        print(f"graphchunk-precompute: {args.corpus} holds no documents", file=sys.stderr)
        return 2
    from graphchunk import GraphChunkLLM

    engine = {key: value for key, value in (("block_size", args.block_size), ("max_model_len", args.max_model_len),
                                            ("chat_template", args.chat_template)) if value is not None}
    with GraphChunkLLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                       kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=True,
                       graphchunk={**extra, "store_path": args.store}, **engine) as llm:
        try:
            result = precompute(llm, groups, documents=args.format != "segments")
        except ValueError as exc:  # a document the engine refuses (too long, ...): named by vLLM's error
            print(f"graphchunk-precompute: {exc}", file=sys.stderr)
            return 2
    print(f"graphchunk-precompute: {result['documents']} documents in {result['seconds']:.1f} s: "
          f"{result['tier_writes']:.0f} tier files written ({result['tier_bytes_written'] / 2**20:.1f} MiB), "
          f"{result['tier_hits']:.0f} already there, {result['tier_write_errors']:.0f} write errors")
    return 1 if result["tier_write_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
