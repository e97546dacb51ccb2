"""Retrieved documents as chunks: a chat request's ``documents``, placed in the prompt and located.

A chat request's documents (vLLM's ``documents`` field, or ``chat_template_kwargs.documents``)
become one chunk each: what precedes the first document is sys, what follows the last one is the
question. ``place_documents`` returns the prompt's token ids and segment boundaries; it needs only
a function that renders messages (and documents) with the chat template, so vLLM's renderer (the
server and ``LLM.chat``) and a bare Hugging Face tokenizer (``GraphChunkLLM.encode``) share it.

Where the documents go:

* a template that renders ``documents`` places them itself;
* a template that ignores them (Llama 3, Qwen, SmolLM2): graphchunk puts them at the start of
  the last user message, each in ``document_text`` form followed by a blank line ("\\n\\n"),
  the message's own text after them.

Locating them: the template is rendered with every document field replaced by a unique marker
(and the last user message's text by another). A document spans its markers; the template text
that follows every document alike (the longest common prefix of the texts after each document:
its *trailer*, e.g. "\\n\\n" or "<|end_of_text|>\\n") and the template text that precedes every
document alike (the longest common suffix of the texts before each document, trailer removed:
its *header*, e.g. "<|start_of_role|>document ") belong to the document's chunk, so a document
renders to the same tokens wherever it appears. Both are learned from a render with one more
document, so that even one document has a neighbour. Template text between a trailer and the
next header that differs from document to document (a number: "Document 2:") goes with the
following chunk: such a document's tokens depend on its place, and reordered it is a miss.

Each segment's text is tokenized alone (``add_special_tokens=False``: the template writes its
own special tokens) and the pieces are joined, so no token straddles a boundary and a chunk's
tokens never depend on its neighbours. Every failure is a ``DocumentError`` naming the document.
"""
from __future__ import annotations

import os
from itertools import accumulate
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from graphchunk.segments import SegmentationError

Render = Callable[[list, "list[dict] | None"], str]
"""render(messages, documents or None) -> the chat template's text (generation prompt added)."""

JOINER = "\n\n"
"""Follows every document graphchunk places itself (templates that ignore documents)."""
DOCUMENT_PART = "graphchunk_document"
"""A content part's key: a text part with ``"graphchunk_document": true`` is a document."""
DOCUMENT_PARTS = "graphchunk_document_parts"
"""``chat_template_kwargs`` key: true makes every part of the last user message but the last one
a document."""


class DocumentError(SegmentationError):
    """A request's documents cannot be chunked; the message names the document."""


class Unchunkable(DocumentError):
    """Well-formed documents graphchunk cannot chunk (the template's placement, or the limits): with
    ``documents_fallback='ordinary'`` the request runs as an ordinary prompt instead."""


@dataclass(frozen=True)
class DocumentPrompt:
    token_ids: list[int]
    boundaries: list[int]
    """Start of each document's chunk and of the question."""
    text: str


def validate_documents(documents: Any, max_chunks: int) -> list[dict[str, str]]:
    """The documents as a list of string-valued dicts; DocumentError naming the first bad one. A
    document in Cohere's shape, ``{"id": ..., "data": {...}}`` (how vLLM's ``/cohere/v2/chat``
    passes them on, ``id`` ``doc_<position>`` when the client gave none), is its ``data``: the id,
    a citation handle that may depend on the document's position, is not rendered."""
    if not isinstance(documents, list):
        raise DocumentError(f"documents must be a list of objects, got {type(documents).__name__}")
    if len(documents) > max_chunks:
        raise Unchunkable(f"{len(documents)} documents, more than max_chunks={max_chunks}")
    documents = [_cohere_data(doc) for doc in documents]
    seen: dict[tuple, int] = {}
    for i, doc in enumerate(documents, 1):
        if not isinstance(doc, dict) or not doc:
            raise DocumentError(f"document {i} must be a non-empty object of strings, got {doc!r:.80}")
        for key, value in doc.items():
            if not isinstance(value, str):
                raise DocumentError(f"document {i}'s {key!r} must be a string, got {type(value).__name__}")
        if not any(value.strip() for value in doc.values()):
            raise DocumentError(f"document {i} is empty")
        identity = tuple(doc.items())
        if identity in seen:
            raise DocumentError(f"document {i} repeats document {seen[identity]}")
        seen[identity] = i
    return documents


def _cohere_data(doc: Any) -> Any:
    if isinstance(doc, dict) and "data" in doc and set(doc) <= {"id", "data"} and isinstance(doc["data"], dict):
        return doc["data"]
    return doc


def document_text(doc: dict[str, str]) -> str:
    """The form graphchunk writes a document in: its ``text``, after a ``key: value`` line for
    every other field (e.g. ``title: ...``), in the document's own order."""
    lines = [f"{key}: {value}" for key, value in doc.items() if key != "text"]
    return "\n".join(lines + ([doc["text"]] if "text" in doc else []))


def place_documents(render: Render, messages: list, documents: list[dict[str, str]], tokenizer, *,
                    max_chunks: int, max_chunk_len: int) -> DocumentPrompt:
    """The prompt of ``messages`` with ``documents`` (see the module docstring)."""
    documents = validate_documents(documents, max_chunks)
    last_user = _last_user_message(messages)
    question = messages[last_user]["content"]
    marks = _Markers()
    marked_docs = [marks.document(i, doc) for i, doc in enumerate(documents)]
    marked_question = marks.question(question)

    def template_places(docs, question_content):
        return render(_with_content(messages, last_user, question_content), docs)

    def graphchunk_places(docs, question_content):
        return render(_place(messages, last_user, docs, question_content), None)

    marked = _with_content(messages, last_user, marked_question)
    places = (template_places if _uses_documents(render, marked, template_places(marked_docs, marked_question))
              else graphchunk_places)
    return _locate(places, documents, question, marks, tokenizer, max_chunk_len)


def place_document_parts(render: Render, messages: list, tokenizer, *, every_part: bool, max_chunks: int,
                         max_chunk_len: int) -> DocumentPrompt:
    """The prompt of ``messages`` whose last user message leads with documents as content parts:
    the text parts marked ``"graphchunk_document": true`` (``DOCUMENT_PART``), or, with
    ``every_part`` (``DOCUMENT_PARTS``), every part but the last. The message renders exactly as
    it would without graphchunk (vLLM joins text parts with a newline, or the template renders
    them); each document's chunk is its part's text with the template text around every part
    alike, located as ``documents`` are."""
    last_user = _last_user_message(messages)
    parts, question = _document_parts(messages, last_user, every_part)
    documents = validate_documents([{"text": part["text"]} for part in parts], max_chunks)
    shapes = parts + parts[-1:]  # the probe's extra document is shaped like the last one

    def in_parts(docs, question_parts):
        doc_parts = [{**shape, "text": doc["text"]} for shape, doc in zip(shapes, docs)]
        return render(_with_content(messages, last_user, doc_parts + question_parts), None)

    return _locate(in_parts, documents, question, _Markers(), tokenizer, max_chunk_len)


def marks_document_parts(messages: list) -> bool:
    """Whether any message has a content part marked as a document (``DOCUMENT_PART``)."""
    return any(isinstance(part, dict) and DOCUMENT_PART in part
               for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
               for part in message["content"])


def _document_parts(messages: list, last_user: int, every_part: bool) -> tuple[list[dict], list]:
    """(the document parts, the question's parts) of the last user message."""
    if any(marks_document_parts([m]) for i, m in enumerate(messages) if i != last_user):
        raise DocumentError(f"only the last user message's content parts can be documents ({DOCUMENT_PART})")
    content = messages[last_user]["content"]
    if not isinstance(content, list):
        raise DocumentError(f"{DOCUMENT_PARTS} needs the last user message's content as a list of parts")
    marked = []
    for j, part in enumerate(content, 1):
        flag = part.get(DOCUMENT_PART, False) if isinstance(part, dict) else False
        if not isinstance(flag, bool):
            raise DocumentError(f"content part {j}'s {DOCUMENT_PART} must be true or false, got {flag!r:.40}")
        marked.append(flag)
    count = len(content) - 1 if every_part else marked.index(False) if False in marked else len(content)
    if True in marked[count:]:
        raise DocumentError(f"content part {count + 1 + marked[count:].index(True)} is marked as a document "
                            "but follows the question's part; document parts must lead the message")
    for j, part in enumerate(content[:count], 1):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise DocumentError(f"content part {j} must be a text part ({{'type': 'text', 'text': ...}}) "
                                "to be a document")
    if count == len(content):
        raise DocumentError("the last user message needs a part after its documents: the question")
    return content[:count], content[count:]


def _locate(compose, documents: list[dict[str, str]], question, marks: "_Markers", tokenizer,
            max_chunk_len: int) -> DocumentPrompt:
    """Where each document's chunk lands in ``compose(documents, question)`` (the prompt text of
    the documents and the last user message's content), tokenized segment by segment."""
    marked_docs = [marks.document(i, doc) for i, doc in enumerate(documents)]
    marked_question = marks.question(question)
    rendered = compose(marked_docs, marked_question)
    spans = marks.spans(rendered, len(documents))
    probe_doc = marks.document(len(documents), documents[-1])
    probe = compose(marked_docs + [probe_doc], marked_question)
    header, trailer = _header_trailer(probe, marks.spans(probe, len(documents) + 1))
    cuts = _cuts(rendered, spans, header, trailer)
    question_at = marks.question_start(rendered)
    if question_at is not None and question_at < cuts[-1]:
        raise Unchunkable("the chat template places the documents after the question (the last user "
                            "message); graphchunk needs them before it")
    pieces = [marks.substitute(rendered[a:b], documents, question)
              for a, b in zip([0, *cuts], [*cuts, len(rendered)])]
    if "".join(pieces) != compose(documents, question):
        raise Unchunkable("the chat template changes the documents' text as it renders them "
                            "(a filter or a slice), so graphchunk cannot locate them")
    return _tokenized(tokenizer, pieces, max_chunk_len)


def _uses_documents(render: Render, messages: list, rendered: str) -> bool:
    """Whether the template renders documents: its text changes without them (or fails)."""
    try:
        return render(messages, []) != rendered
    except Exception:  # e.g. documents[0] of an empty list
        return True


def _tokenized(tokenizer, pieces: list[str], max_chunk_len: int) -> DocumentPrompt:
    ids = [tokenizer.encode(piece, add_special_tokens=False) if piece else [] for piece in pieces]
    for i, chunk in enumerate(ids[1:-1], 1):
        if len(chunk) > max_chunk_len:
            raise Unchunkable(f"document {i} has {len(chunk)} tokens, more than max_chunk_len={max_chunk_len}")
    if not ids[-1]:
        raise DocumentError("the question (what follows the last document) is empty")
    boundaries = list(accumulate(len(piece) for piece in ids[:-1]))
    return DocumentPrompt([t for piece in ids for t in piece], boundaries, "".join(pieces))


def _last_user_message(messages: list) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], dict) and messages[i].get("role") == "user":
            return i
    raise DocumentError("documents need a user message after them (the question); the request has none")


def _with_content(messages: list, index: int, content) -> list:
    return [{**m, "content": content} if i == index else m for i, m in enumerate(messages)]


def _place(messages: list, last_user: int, documents: list[dict[str, str]], content) -> list:
    """graphchunk's placement: the documents lead the last user message (its content: ``content``)."""
    lead = "".join(document_text(doc) + JOINER for doc in documents)
    if isinstance(content, str):
        return _with_content(messages, last_user, lead + content)
    return _with_content(messages, last_user, [{"type": "text", "text": lead}, *content])


class _Markers:
    """Unique ASCII markers for every document field and the question's text parts (ASCII so
    that filters such as ``tojson`` keep them)."""

    def __init__(self):
        self.nonce = os.urandom(6).hex()
        self.values: dict[str, tuple] = {}

    def _mark(self, what: tuple) -> str:
        mark = f"GC{self.nonce}{'x'.join(map(str, what))}Z"
        self.values[mark] = what
        return mark

    def document(self, i: int, doc: dict[str, str]) -> dict[str, str]:
        return {key: self._mark(("d", i, j)) for j, key in enumerate(doc)}

    def question(self, content):
        if isinstance(content, str):
            return self._mark(("q", 0))
        if not isinstance(content, list):
            raise DocumentError("the last user message's content must be a string or a list of parts")
        return [{**part, "text": self._mark(("q", j))} if isinstance(part, dict) and part.get("type") == "text"
                else part for j, part in enumerate(content)]

    def spans(self, text: str, num_documents: int) -> list[tuple[int, int]]:
        """[first marker start, last marker end) of each document, in rendered order."""
        spans = []
        for i in range(num_documents):
            marks = [m for m, what in self.values.items() if what[:2] == ("d", i)]
            if any(text.count(m) > 1 for m in marks):
                raise Unchunkable(f"the chat template renders document {i + 1} more than once")
            found = [(text.index(m), text.index(m) + len(m)) for m in marks if m in text]
            if not found:
                raise Unchunkable(f"document {i + 1} could not be located in the rendered prompt "
                                    "(the chat template leaves it out or rewrites it)")
            spans.append((min(a for a, _ in found), max(b for _, b in found)))
        ordered = sorted(spans)
        if any(b > a for (_, b), (a, _) in zip(ordered, ordered[1:])):
            raise Unchunkable("the chat template interleaves the documents' fields")
        if ordered != spans:
            raise Unchunkable("the chat template reorders the documents")
        return spans

    def question_start(self, text: str) -> int | None:
        found = [text.find(m) for m, what in self.values.items() if what[0] == "q" and m in text]
        return min(found) if found else None

    def substitute(self, text: str, documents: list[dict[str, str]], question) -> str:
        for mark, what in self.values.items():
            if mark in text:
                if what[0] == "d":
                    value = list(documents[what[1]].values())[what[2]]
                else:
                    value = question if isinstance(question, str) else question[what[1]]["text"]
                text = text.replace(mark, value)
        return text


def _header_trailer(text: str, spans: list[tuple[int, int]]) -> tuple[str, str]:
    """The template text before and after every document alike (see the module docstring)."""
    after = [text[b:a] for (_, b), (a, _) in zip(spans, spans[1:])] + [text[spans[-1][1]:]]
    trailer = os.path.commonprefix(after)
    before = [text[:spans[0][0]]] + [gap[len(trailer):] for gap in after[:-1]]
    header = os.path.commonprefix([s[::-1] for s in before])[::-1]
    return header, trailer


def _cuts(text: str, spans: list[tuple[int, int]], header: str, trailer: str) -> list[int]:
    """Character offsets where each document's chunk starts and where the question starts."""
    for i, (start, end) in enumerate(spans):
        if text[start - len(header):start] != header or text[end:end + len(trailer)] != trailer:
            raise Unchunkable(f"document {i + 1} is rendered unlike the others; graphchunk cannot find "
                                "where its chunk begins and ends")
    cuts = [spans[0][0] - len(header)] + [end + len(trailer) for _, end in spans]
    if any(b > a - len(header) for b, (a, _) in zip(cuts[1:], spans[1:])):
        raise Unchunkable("the chat template renders documents too close together to tell their "
                            "chunks apart")
    return cuts


def document_messages(sys: str, question: str) -> list[dict[str, str]]:
    """The messages of a RAG chat turn: the system prompt (none when empty), then the question as
    the user's."""
    return [{"role": "system", "content": sys}] * bool(sys) + [{"role": "user", "content": question}]


def hf_render(tokenizer, **template_kwargs) -> Render:
    """A ``Render`` over a Hugging Face tokenizer's chat template (generation prompt added)."""
    def render(messages: Sequence[dict], documents):
        extra = {"documents": documents} if documents is not None else {}
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                             **extra, **template_kwargs)
    return render
