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

Locating them: the template is rendered with every document field between two unique markers
(and the last user message's text replaced by another). A document spans its markers. The
template text that follows every document alike (the longest common prefix of the texts after each document,
up to its last line end: the *trailer*, e.g. "\\n\\n" or "<|end_of_text|>\\n") ends the
document's chunk; everything between one document's trailer and the next document (its
*header*: "<|start_of_role|>document ", a "title: " of graphchunk's form) starts the next chunk.
The first document's header is learned from a render with one more document ahead of them,
shaped like the first: what precedes a document that follows another. So a document renders to
the same tokens wherever it appears, unless the template writes something that depends on its
place (a number: "Document 2:"): then the first document's chunk starts where its header and the
probe's agree, and a reordered document is a miss.

The prompt is the template's own rendering of the documents and the question: everything up to
the question, the marker render without its markers, must be exactly what it renders, and the
question is whatever the template makes of it (a ``trim`` included). A field is what the template
writes of it: escaped by ``tojson`` (Granite 4) or ``e``, the same text wherever the document
goes; a filter that reads the whole value (``trim``, ``truncate``, ``upper``) fails that check or
loses a marker, and the request is ``Unchunkable``.

Each segment's text is tokenized alone (``add_special_tokens=False``: the template writes its
own special tokens) and the pieces are joined, so no token straddles a boundary and a chunk's
tokens never depend on its neighbours. The joined tokens must spell the rendered text exactly: a
tokenizer that prefixes a text tokenized alone (SentencePiece's dummy prefix, Llama 2 and
Mistral: "▁" would add a space before every document) tokenizes each segment after the first
behind a newline whose tokens are dropped (``_piece_tokens``); where neither spells the text the
request is ``Unchunkable``. Every failure is a ``DocumentError`` naming the document.
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
    """Well-formed documents graphchunk cannot chunk (the template's placement, the tokenizer, or the
    limits): with ``documents_fallback='ordinary'`` the request runs as an ordinary prompt instead."""


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
    if not documents:
        raise DocumentError("documents must hold at least one document")
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
    if len(documents) > max_chunks:
        raise Unchunkable(f"{len(documents)} documents, more than max_chunks={max_chunks}")
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


def unchunked_text(render: Render, messages: list, documents: list[dict[str, str]]) -> str:
    """The prompt text of a documents request run as an ordinary prompt (``documents_fallback``):
    placed as ``place_documents`` places them (by the template, else leading the last user
    message), never without its documents."""
    rendered = render(messages, documents)
    if _uses_documents(render, messages, rendered):
        return rendered
    return render(inlined(messages, documents), None)


def inlined(messages: list, documents: list[dict[str, str]]) -> list:
    """``messages`` with ``documents`` written into the last user message as graphchunk places them:
    the ordinary chat request of the same text (for a template that ignores documents)."""
    last_user = _last_user_message(messages)
    return _place(messages, last_user, documents, messages[last_user]["content"])


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
    shapes = parts[:1] + parts  # the probe's extra document leads, shaped like the first

    def in_parts(docs, question_parts):
        doc_parts = [{**shape, "text": doc["text"]} for shape, doc in zip(shapes, docs)]
        return render(_with_content(messages, last_user, doc_parts + question_parts), None)

    return _locate(in_parts, documents, question, _Markers(), tokenizer, max_chunk_len)


def asks_for_documents(chat_template_kwargs: dict, messages) -> bool:
    """Whether a chat request sends documents: a non-empty ``documents`` (vLLM merges the top-level
    field into ``chat_template_kwargs``), ``DOCUMENT_PARTS`` other than false, or a part marked."""
    return (bool(chat_template_kwargs.get("documents")) or chat_template_kwargs.get(DOCUMENT_PARTS, False) is not False
            or (isinstance(messages, list) and marks_document_parts(messages)))


def marks_document_parts(messages: list) -> bool:
    """Whether any message has a content part marked as a document (``DOCUMENT_PART`` other than false)."""
    return any(isinstance(part, dict) and part.get(DOCUMENT_PART, False) is not False
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
    if count == 0:
        raise DocumentError("the last user message has no document parts before its question")
    return content[:count], content[count:]


def _locate(compose, documents: list[dict[str, str]], question, marks: "_Markers", tokenizer,
            max_chunk_len: int) -> DocumentPrompt:
    """Where each document's chunk lands in ``compose(documents, question)`` (the prompt text of
    the documents and the last user message's content), tokenized segment by segment."""
    marked_docs = [marks.document(i, doc) for i, doc in enumerate(documents)]
    marked_question = marks.question(question)
    rendered = compose(marked_docs, marked_question)
    spans = marks.spans(rendered, range(len(documents)))
    probe = compose([marks.document(len(documents), documents[0]), *marked_docs], marked_question)
    header, trailer = _header_trailer(probe, marks.spans(probe, [len(documents), *range(len(documents))]),
                                      rendered[:spans[0][0]])
    cuts = _cuts(rendered, spans, header, trailer)
    question_at = marks.question_start(rendered)
    if question_at is not None and question_at < cuts[-1]:
        raise Unchunkable("the chat template places the documents after the question (the last user "
                            "message); graphchunk needs them before it")
    pieces = [marks.unmarked(rendered[a:b]) for a, b in zip([0, *cuts], cuts)]
    prompt, head = compose(documents, question), "".join(pieces)
    if not prompt.startswith(head):
        raise Unchunkable("the chat template changes the documents' text as it renders them (a filter such "
                          "as trim, also where it trims the message graphchunk leads with the documents: "
                          "whitespace at a document's ends; or a slice), so graphchunk cannot locate them")
    return _tokenized(tokenizer, [*pieces, prompt[len(head):]], max_chunk_len)  # the question as rendered


def _uses_documents(render: Render, messages: list, rendered: str) -> bool:
    """Whether the template renders documents: its text changes without them (or fails)."""
    try:
        return render(messages, []) != rendered
    except Exception:  # e.g. documents[0] of an empty list
        return True


def _tokenized(tokenizer, pieces: list[str], max_chunk_len: int) -> DocumentPrompt:
    ids = _piece_tokens(tokenizer, pieces)
    for i, chunk in enumerate(ids[1:-1], 1):
        if len(chunk) > max_chunk_len:
            raise Unchunkable(f"document {i} has {len(chunk)} tokens, more than max_chunk_len={max_chunk_len}")
    if not ids[-1]:
        raise DocumentError("the question (what follows the last document) is empty")
    boundaries = list(accumulate(len(piece) for piece in ids[:-1]))
    return DocumentPrompt([t for piece in ids for t in piece], boundaries, "".join(pieces))


ANCHOR = "\n"
"""Written before a piece tokenized as inside a text (its tokens dropped again), for tokenizers that
prefix a text tokenized alone (SentencePiece's dummy prefix ``▁``: Llama 2, Mistral)."""


def _piece_tokens(tokenizer, pieces: list[str]) -> list[list[int]]:
    """Each piece's tokens, tokenized apart from its neighbours, such that together they spell the
    whole text exactly (decoded, as the whole text's own tokens decode): each piece alone, or,
    where that changes the text (a prefix on every piece), each piece after the first behind
    ``ANCHOR``, the anchor's tokens dropped. Unchunkable when neither spells the text."""
    text = "".join(pieces)
    target = _decoded(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    ids = [tokenizer.encode(piece, add_special_tokens=False) if piece else [] for piece in pieces]
    if _decoded(tokenizer, [t for piece in ids for t in piece]) == target:
        return ids
    anchor = tokenizer.encode(ANCHOR, add_special_tokens=False)
    anchored = [tokenizer.encode(ANCHOR + piece, add_special_tokens=False) if piece else anchor
                for piece in pieces[1:]]
    if all(piece[:len(anchor)] == anchor for piece in anchored):
        ids = ids[:1] + [piece[len(anchor):] for piece in anchored]  # the first piece starts the text
        if _decoded(tokenizer, [t for piece in ids for t in piece]) == target:
            return ids
    raise Unchunkable("the tokenizer cannot tokenize the documents apart from their neighbours without "
                      "changing the prompt's text (it rewrites a text tokenized alone)")


def _decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


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
    """Unique ASCII markers around every document field and for the question's text parts (ASCII
    letters and digits, so that escaping filters such as ``tojson`` keep them)."""

    def __init__(self):
        self.nonce = os.urandom(6).hex()
        self.values: dict[str, tuple] = {}

    def _mark(self, what: tuple) -> str:
        mark = f"GC{self.nonce}{'x'.join(map(str, what))}Z"
        self.values[mark] = what
        return mark

    def document(self, i: int, doc: dict[str, str]) -> dict[str, str]:
        """The document with each value between two markers of its own (an empty one stays empty,
        so that a template's ``{% if d.title %}`` reads it as it will)."""
        return {key: value and self._mark(("d", i, j, "a")) + value + self._mark(("d", i, j, "b"))
                for j, (key, value) in enumerate(doc.items())}

    def question(self, content):
        if isinstance(content, str):
            return self._mark(("q", 0))
        if not isinstance(content, list):
            raise DocumentError("the last user message's content must be a string or a list of parts")
        return [{**part, "text": self._mark(("q", j))} if isinstance(part, dict) and part.get("type") == "text"
                else part for j, part in enumerate(content)]

    def spans(self, text: str, order: Sequence[int]) -> list[tuple[int, int]]:
        """[first marker start, last marker end) of each document of ``order``, the order they must
        render in."""
        spans = []
        for i in order:
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

    def unmarked(self, text: str) -> str:
        """``text`` without the documents' markers."""
        for mark, what in self.values.items():
            if what[0] == "d":
                text = text.replace(mark, "")
        return text


def _header_trailer(probe: str, spans: list[tuple[int, int]], before_first: str) -> tuple[str, str]:
    """(the first document's header, the trailer) from the ``probe`` render, whose first document
    is the probe (see the module docstring); ``before_first``: the prompt's text before its first
    document."""
    after = [probe[b:a] for (_, b), (a, _) in zip(spans, spans[1:])] + [probe[spans[-1][1]:]]
    trailer = os.path.commonprefix(after)
    if "\n" in trailer:  # the rest of the line starts what follows (the next header, the question)
        trailer = trailer[:trailer.rindex("\n") + 1]
    header = after[0][len(trailer):]
    if not before_first.endswith(header):  # the header depends on the place: as much as is shared
        header = os.path.commonprefix([header[::-1], before_first[::-1]])[::-1]
    return header, trailer


def _cuts(text: str, spans: list[tuple[int, int]], header: str, trailer: str) -> list[int]:
    """Character offsets where each document's chunk starts and where the question starts: the
    first document's header, then each trailer's end."""
    for i, (_, end) in enumerate(spans):
        if text[end:end + len(trailer)] != trailer:
            raise Unchunkable(f"document {i + 1} is rendered unlike the others; graphchunk cannot find "
                              "where its chunk ends")
    cuts = [spans[0][0] - len(header)] + [end + len(trailer) for _, end in spans]
    if any(b > a for b, (a, _) in zip(cuts[1:], spans[1:])):
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
