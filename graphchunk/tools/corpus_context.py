"""``graphchunk-precompute``'s corpus: its lines, each document's context, and the resumable journal.

A corpus line is ``{"text": ...}`` or ``{"document": {...}}``, with optional ``sys``, ``mode``,
``id`` (unique, a string) and ``context`` (the ``id`` of other lines). ``contexts`` chooses what
each document's contextualized blend entry is computed behind (FusionRAG's offline method): the
line's ``context`` (``--context list``: the operator's co-retrieval data) or its most related
documents by BM25 (``--context bm25``: bm25s, a well-kept lexical retriever; FusionRAG uses an
embedding model, which this project cannot fetch), ordered so that the most related sits next to
the document. The ``Journal`` (``precompute-context.jsonl`` in the store) records the documents
written under one set of engine settings, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator, Sequence

JOURNAL = "precompute-context.jsonl"


def corpus_lines(path: str | Path, text_only: bool = False) -> Iterator[tuple[str, dict, dict[str, str]]]:
    """(where, record, document) per non-empty line; errors name the line. A line's document is
    its ``document`` object or ``{"text": text}``; ``text_only`` (``--format segments``,
    ``separator``) refuses documents with other fields."""
    from graphchunk.documents import DocumentError, validate_documents

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
                raise ValueError(f"{where}: --format segments and separator send a document's text only; this one has "
                                 f"other fields (use --format documents)")
            yield where, record, document


def contexts(path: str | Path, groups: dict, method: str, size: int, text_only: bool = False) -> dict[tuple, list]:
    """Per document of ``groups`` (``read_corpus``'s), keyed by ``tuple(document.items())``: the
    documents computed before it. Refuses isolated lines (an isolated chunk's KV is exact and
    already keyed by its sys prompt) and a document on two lines with different contexts or sys
    prompts (a blend entry is keyed by its document alone)."""
    if method not in ("list", "bm25"):
        raise ValueError(f"--context must be list or bm25, got {method!r}")
    if any(mode == "isolated" for _, mode in groups):
        raise ValueError("--context contextualizes blend entries: every line must be blend or auto, not isolated")
    identities = [tuple(d.items()) for docs in groups.values() for d in docs]
    if len(set(identities)) < len(identities):
        raise ValueError("--context: a document appears behind two sys prompts; its blend entry is keyed by the "
                         "document alone, so it has one context")
    lines = list(corpus_lines(path, text_only))
    if method == "list":
        return _listed(lines)
    for where, record, _ in lines:
        if "context" in record:
            raise ValueError(f"{where}: this line names its 'context'; --context bm25 would choose another "
                             "(use --context list)")
    if size < 1:
        raise ValueError(f"--context-size must be >= 1, got {size}")
    return _related(lines, size)


def _listed(lines) -> dict[tuple, list]:
    ids: dict[str, dict] = {}
    for where, record, document in lines:
        if "id" in record:
            if not isinstance(record["id"], str) or record["id"] in ids:
                raise ValueError(f"{where}: 'id' must be a string no other line has, got {record['id']!r}")
            ids[record["id"]] = document
    found: dict[tuple, list] = {}
    for where, record, document in lines:
        names = record.get("context", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: 'context' must be a list of other lines' ids")
        missing = [n for n in names if n not in ids or ids[n] == document]
        if missing:
            raise ValueError(f"{where}: 'context' names {missing}, not the id of another line")
        context = [ids[n] for n in names]
        if found.setdefault(tuple(document.items()), context) != context:
            raise ValueError(f"{where}: this document appears on another line with another context")
    return found


def _related(lines, size: int) -> dict[tuple, list]:
    """Each document's ``size`` most related others by BM25 over the texts (title included; none
    that shares no term with it), least related first."""
    try:
        import bm25s
    except ImportError:
        raise ImportError("--context bm25 needs bm25s (pip install bm25s; graphchunk's install has it)") from None
    documents = list({tuple(d.items()): d for _, _, d in lines}.values())
    texts = [" ".join(d.values()) for d in documents]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    k = min(size + 1, len(documents))
    ranked, scores = retriever.retrieve(bm25s.tokenize(texts, stopwords="en", show_progress=False), k=k,
                                        show_progress=False, sorted=True)
    found = {}
    for i, document in enumerate(documents):
        others = [int(j) for j, score in zip(ranked[i], scores[i]) if int(j) != i and score > 0][:size]
        found[tuple(document.items())] = [documents[j] for j in reversed(others)]
    return found


class Journal:
    """The documents a contextualized precompute has written, under one set of settings, in the store."""

    def __init__(self, store: str | Path, setup: dict, batch_size: int = 64):
        self.path = Path(store) / JOURNAL
        self.setup = _digest(setup)
        self.batch_size = batch_size
        self._done: set[str] = set()
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by an interrupted write: its batch is run again
                if isinstance(record, dict) and record.get("setup") == self.setup:
                    self._done.add(record.get("entry"))

    def done(self, sys_prompt: str, document: dict, context: Sequence[dict]) -> bool:
        return _digest([sys_prompt, document, list(context)]) in self._done

    def record(self, batch) -> None:
        lines = []
        for item in batch:
            entry = _digest([item[0], item[1], list(item[2])])
            self._done.add(entry)
            lines.append(json.dumps({"setup": self.setup, "entry": entry}) + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(lines)


def batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), max(1, size)):
        yield items[start:start + max(1, size)]


def progress_bar(total: int, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="doc", desc="graphchunk-precompute", disable=not enabled)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
