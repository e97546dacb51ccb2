"""Documents as chunks (``graphchunk.documents``): where they land in the rendered prompt, that
each renders to the same tokens wherever it appears, bad documents refused naming the document;
and through the engine (``GraphChunkLLM.chat(documents=...)``, vLLM's renderer hook) against the
HF oracle in both modes. The OpenAI server's documents requests are in ``test_server``."""
from __future__ import annotations

import pytest

from exactness import (LIMITS, assert_matches_oracle, assert_matches_reference, blend_reference, sampling,
                        string_parts_render)
from graphchunk.documents import (DOCUMENT_PART, DocumentError, document_messages, hf_render, place_document_parts,
                                  place_documents)
from graphchunk.llm import RagPrompt, encode_prompt
from graphchunk.segments import split_at

GRANITE = """{%- for m in messages if m['role'] == 'system' %}<|start_of_role|>system<|end_of_role|>\
{{ m['content'] }}<|end_of_text|>
{% endfor %}{%- for d in documents %}<|start_of_role|>document {"document_id": "{{ d['doc_id'] }}"}\
<|end_of_role|>
{{ d['text'] }}<|end_of_text|>
{% endfor %}{%- for m in messages if m['role'] != 'system' %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>\
{{ m['content'] }}<|end_of_text|>
{% endfor %}<|start_of_role|>assistant<|end_of_role|>"""
"""Granite 3.3's shape: a turn per document, keyed by the caller's id, between system and user."""
NUMBERED = """{{ messages[0]['content'] }}
Documents:
{% for d in documents %}Document {{ loop.index }}:
{{ d['text'] }}
{% endfor %}Question: {{ messages[-1]['content'] }}
Answer:"""
AFTER_QUESTION = """{% for m in messages %}{{ m['content'] }}
{% endfor %}{% for d in documents %}{{ d['text'] }}
{% endfor %}"""
UPPER = """{% for d in documents %}{{ d['text'] | upper }}
{% endfor %}{% for m in messages %}{{ m['content'] }}
{% endfor %}"""
TRIMS_DOCUMENTS = """{% for d in documents %}{{ d['text'] | trim }}
{% endfor %}{% for m in messages %}{{ m['content'] }}
{% endfor %}"""
JSON = """{{ messages[0]['content'] }}
{% for d in documents %}{{ d | tojson }}
{% endfor %}{{ messages[-1]['content'] }}"""
"""Granite 4's shape: each document as JSON (its newlines and quotes escaped)."""
FIRST_ONLY = """{{ documents[0]['text'] }}
{% for m in messages %}{{ m['content'] }}
{% endfor %}"""

MARKDOWN = "# Setup\n\nInstall it.\n\n## Options\n\nSet `x`.\n\n### Notes\n\nDone."
DOCS = [{"doc_id": "a1", "text": "Paris is the capital of France."},
        {"doc_id": "b2", "text": "Rome is the capital of Italy."},
        {"doc_id": "c3", "text": MARKDOWN}]
MESSAGES = document_messages("Answer from the documents.", "Which city is in Italy?")


def place(tokenizer, documents, template=None, messages=MESSAGES, **limits):
    render = hf_render(tokenizer, **({"chat_template": template} if template else {}))
    return place_documents(render, messages, documents, tokenizer, **{**LIMITS, **limits})


def documents_leading(tokenizer, documents, template=None) -> str:
    """The prompt of the documented placement, written out: each document's text and a blank line,
    leading the user's question (``MESSAGES``), rendered by the template."""
    user = "".join(d["text"] + "\n\n" for d in documents) + MESSAGES[1]["content"]
    render = hf_render(tokenizer, **({"chat_template": template} if template else {}))
    return render([MESSAGES[0], {"role": "user", "content": user}], None)


def chunks(placed) -> list[tuple[int, ...]]:
    edges = [*placed.boundaries, len(placed.token_ids)]
    return [tuple(placed.token_ids[a:b]) for a, b in zip(edges, edges[1:-1])]


@pytest.mark.parametrize("template", [None, GRANITE], ids=["ignores-documents", "renders-documents"])
def test_a_document_renders_to_the_same_tokens_wherever_it_appears(tokenizer, template):
    placed = place(tokenizer, DOCS, template)
    assert len(placed.boundaries) == len(DOCS) + 1
    for order in ([2, 0, 1], [1], [2, 1]):
        again = place(tokenizer, [DOCS[i] for i in order], template)
        assert chunks(again) == [chunks(placed)[i] for i in order]
    text = placed.text
    assert text.index("Paris") < text.index("Rome") < text.index("## Options") < text.index("Which city")
    # The Markdown document is one chunk, headings and all.
    assert "## Options" in tokenizer.decode(chunks(placed)[2]) and "### Notes" in tokenizer.decode(chunks(placed)[2])


def test_graphchunk_places_documents_the_documented_way(tokenizer):
    """Templates that ignore documents: they lead the last user message, each in document_text form
    and followed by a blank line; the same as a RagPrompt(chat=True) of the texts."""
    placed = place(tokenizer, [{"text": d["text"]} for d in DOCS])
    assert placed.text == documents_leading(tokenizer, DOCS)
    prompt = RagPrompt(MESSAGES[0]["content"], [d["text"] for d in DOCS], MESSAGES[1]["content"], chat=True)
    assert encode_prompt(tokenizer, prompt) == (placed.token_ids, placed.boundaries)
    titled = place(tokenizer, [{"title": "Capitals", "text": "Paris."}])
    assert "title: Capitals\nParis.\n\n" in titled.text


def test_a_header_belongs_to_its_document(tokenizer):
    """A document's chunk is its whole turn: header, text, trailer up to its line end."""
    placed = place(tokenizer, DOCS[:2], GRANITE)
    first = tokenizer.decode(chunks(placed)[0])
    assert first == '<|start_of_role|>document {"document_id": "a1"}<|end_of_role|>\nParis is the capital of France.<|end_of_text|>\n'
    assert tokenizer.decode(placed.token_ids[placed.boundaries[-1]:]).startswith("<|start_of_role|>user")


COND = """{{ messages[0]['content'] }}
{% for d in documents %}[doc]{% if d.title %} Title: {{ d.title }}
{% endif %}{{ d['text'] }}
{% endfor %}Q: {{ messages[-1]['content'] }}"""
"""A template that writes a field only where a document has it."""
XML = """{{ messages[0]['content'] }}
{% for d in documents %}<doc>{{ d['text'] }}</doc>
{% endfor %}<question>{{ messages[-1]['content'] }}</question>"""
"""What follows the last document shares its first character with a document's header."""


@pytest.mark.parametrize("template, documents, first", [
    (None, [{"title": "France", "text": "Paris."}, {"text": "Rome."}], "title: France\nParis.\n\n"),
    (None, [{"title": "France", "text": "Paris."}, {"source": "atlas", "text": "Rome."}], "title: France\nParis.\n\n"),
    (COND, [{"title": "France", "text": "Paris."}, {"text": "Rome."}], "[doc] Title: France\nParis.\n"),
    (COND, [{"title": "", "text": "Paris."}, {"title": "Italy", "text": "Rome."}], "[doc]Paris.\n"),
    (XML, [{"text": "Paris."}, {"text": "Rome."}], "<doc>Paris.</doc>\n"),
], ids=["graphchunk-title", "graphchunk-other-fields", "conditional-field", "conditional-empty-field",
       "shared-first-character"])
def test_a_documents_header_is_its_own_even_when_first(tokenizer, template, documents, first):
    """The first document's header (its own fields' labels too) is in its chunk, never in sys, and
    a chunk ends at its trailer's line end: the same chunks in either order and alone."""
    placed, swapped = place(tokenizer, documents, template), place(tokenizer, documents[::-1], template)
    assert tokenizer.decode(chunks(placed)[0]) == first
    assert chunks(swapped) == chunks(placed)[::-1]
    # alone (as graphchunk-precompute --format documents computes it), the same chunk again
    assert [chunks(place(tokenizer, [doc], template))[0] for doc in documents] == chunks(placed)
    sys_text = tokenizer.decode(placed.token_ids[:placed.boundaries[0]])
    assert sys_text.endswith("\n") and "France" not in sys_text


def test_a_numbered_template_costs_identity(tokenizer):
    """'Document 2:' belongs to the second chunk, so a document's tokens depend on its place."""
    placed, swapped = place(tokenizer, DOCS[:2], NUMBERED), place(tokenizer, DOCS[1::-1], NUMBERED)
    assert chunks(placed)[1] != chunks(swapped)[0]
    assert tokenizer.decode(chunks(placed)[1]).startswith("Document 2:")


@pytest.mark.parametrize("template", [None, GRANITE], ids=["ignores-documents", "renders-documents"])
def test_a_cohere_shaped_document_is_its_data(tokenizer, template):
    """vLLM's /cohere/v2/chat hands documents on as {"id": "doc_<position>" or the client's, "data": {...}}."""
    data = [{"title": "France", "text": DOCS[0]["text"]}, {"text": DOCS[1]["text"]}]
    cohere = [{"id": "doc_0", "data": data[0]}, {"id": "rome", "data": data[1]}]
    assert place(tokenizer, cohere, template) == place(tokenizer, data, template)
    assert place(tokenizer, [{"data": data[1]}, {"id": "doc_1", "data": data[0]}], template) == place(
        tokenizer, data[::-1], template)
    with pytest.raises(DocumentError, match="document 1's 'page' must be a string, got int"):
        place(tokenizer, [{"id": "doc_0", "data": {"text": "a", "page": 3}}], template)


@pytest.mark.parametrize("documents, limits, message", [
    ([{"text": ""}], {}, "document 1 is empty"),
    ([{"text": "a"}, {"text": 5}], {}, "document 2's 'text' must be a string, got int"),
    ([{"text": "a"}, {"text": "b", "meta": {"x": "y"}}], {}, "document 2's 'meta' must be a string, got dict"),
    ([{"text": "a"}, "b"], {}, "document 2 must be a non-empty object of strings"),
    ([{"text": "a"}, {}], {}, "document 2 must be a non-empty object of strings"),
    ([{"text": "a"}, {"text": "b"}, {"text": "a"}], {}, "document 3 repeats document 1"),
    ([{"text": str(i)} for i in range(9)], {"max_chunks": 8}, "9 documents, more than max_chunks=8"),
    ([{"text": "a"}, {"text": "word " * 80}], {"max_chunk_len": 64}, "document 2 has 8[0-9] tokens, more than"),
    ({"text": "a"}, {}, "documents must be a list"),
    ([], {}, "at least one document"),
    ([{"text": "a"}, {"text": "a"}, {"text": "b"}], {"max_chunks": 2}, "document 2 repeats document 1"),
])
def test_bad_documents_are_refused_naming_the_document(tokenizer, documents, limits, message):
    with pytest.raises(DocumentError, match=message):
        place(tokenizer, documents, **limits)


@pytest.mark.parametrize("template, messages, message", [
    (AFTER_QUESTION, MESSAGES, "places the documents after the question"),
    (UPPER, MESSAGES, "document 1 could not be located"),
    (FIRST_ONLY, MESSAGES, "document 2 could not be located"),
    (None, MESSAGES[:1], "need a user message"),
])
def test_templates_graphchunk_cannot_follow_are_refused(tokenizer, template, messages, message):
    with pytest.raises(DocumentError, match=message):
        place(tokenizer, [{"text": "Paris."}, {"text": "Rome."}], template, messages)


LLAMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>\n{{ m['content'] }}\n"
          "<</SYS>>\n\n{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}")
"""Llama 2's chat shape (system inside the first turn); it ignores documents."""


def sentencepiece_tokenizer(*normalizers):
    """A ``LlamaTokenizerFast`` with Llama 2's tokenizer.json pipeline (SentencePiece BPE over
    ``▁`` for spaces, a dummy prefix ``▁`` on every text, byte fallback, its decoder), its vocabulary
    trained here on CPython's help topics; ``normalizers`` replace the prefix and ``▁`` ones."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, normalizers as norm, trainers
    from transformers import LlamaTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = norm.Sequence(list(normalizers) or [norm.Prepend("▁"), norm.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator([text.replace(" ", "▁") for text in list(topics.values())[:60]],
                            trainers.BpeTrainer(vocab_size=1500, special_tokens=special, show_progress=False))
    return LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                              legacy=False, chat_template=LLAMA2)


def test_a_prefixing_tokenizer_spells_the_rendered_prompt_exactly():
    """SentencePiece's dummy prefix makes every text tokenized alone start with a space: each
    document after the first is tokenized as inside a text instead, so the prompt's tokens spell
    exactly what the template renders (no space before a document or the question), and each
    document still renders to the same tokens wherever it appears."""
    sp = sentencepiece_tokenizer()
    alone = [sp.encode(text, add_special_tokens=False) for text in ("Paris.", "Rome.")]
    assert sp.decode(alone[0] + alone[1]) == "Paris. Rome."  # each text alone: "▁Paris.", "▁Rome."
    documents = [{"text": d["text"]} for d in DOCS]
    placed = place(sp, documents)
    whole = sp.encode(placed.text, add_special_tokens=False)
    assert sp.decode(placed.token_ids) == sp.decode(whole)
    assert "[INST] Paris" in sp.decode(placed.token_ids) and "\n\nRome" in sp.decode(placed.token_ids)
    assert [tok for tok in sp.convert_ids_to_tokens(placed.token_ids) if tok == "▁"] == [
        tok for tok in sp.convert_ids_to_tokens(whole) if tok == "▁"]
    again = place(sp, [documents[i] for i in (2, 0, 1)])
    assert chunks(again) == [chunks(placed)[i] for i in (2, 0, 1)]


def test_a_tokenizer_that_rewrites_a_text_alone_is_refused():
    """A tokenizer whose pieces cannot spell the whole text (here: it strips every text's ends, so
    the blank line after each document would vanish) is refused, never run on another text."""
    from tokenizers import normalizers

    strips = sentencepiece_tokenizer(normalizers.Strip(), normalizers.Replace(" ", "▁"))
    docs = [{"text": "Paris."}, {"text": "Rome."}]
    with pytest.raises(DocumentError, match="cannot tokenize the documents apart"):
        place(strips, docs)
    # documents_fallback='ordinary': the prompt graphchunk placed, documents and all, unchunked.
    from graphchunk.engine.document_hooks import UNCHUNKED
    from graphchunk.engine.frontend import DOCUMENTS_KEY

    _, prompt = _hook_render(strips, None, docs, documents_fallback="ordinary")
    assert prompt == {"prompt": documents_leading(strips, docs), DOCUMENTS_KEY: UNCHUNKED}


def test_a_field_is_what_the_template_writes_of_it(tokenizer):
    """A filter that escapes (tojson) gives a document's escaped text, the same anywhere; one that
    reads the whole value (trim on a text with spaces around it) cannot be located: refused."""
    docs = [{"title": "France", "text": 'Paris is "the" capital.\n\n## Facts\n\nC:\\x'}, *DOCS[1:]]
    placed = place(tokenizer, docs, JSON)
    assert placed.text == hf_render(tokenizer, chat_template=JSON)(MESSAGES, docs)
    assert tokenizer.decode(chunks(placed)[0]) == '{"title": "France", "text": "Paris is \\"the\\" capital.\\n\\n## Facts\\n\\nC:\\\\x"}\n'
    assert chunks(place(tokenizer, docs[::-1], JSON)) == chunks(placed)[::-1]
    assert chunks(place(tokenizer, docs[:1], JSON)) == chunks(placed)[:1]
    assert place(tokenizer, [{"text": "Paris."}], TRIMS_DOCUMENTS).text.startswith("Paris.\n")
    with pytest.raises(DocumentError, match="changes the documents' text"):
        place(tokenizer, [{"text": " Paris. "}], TRIMS_DOCUMENTS)


def parts_messages(texts, question="Which city is in Italy?", marked=True) -> list[dict]:
    parts = [{"type": "text", "text": text, **({DOCUMENT_PART: True} if marked else {})} for text in texts]
    return [MESSAGES[0], {"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def place_parts(tokenizer, messages, every_part=False, **limits):
    return place_document_parts(string_parts_render(tokenizer), messages, tokenizer, every_part=every_part,
                                **{**LIMITS, **limits})


def test_content_parts_are_documents_in_the_message_as_it_renders(tokenizer):
    """Marked parts (or every part but the last, per request): the prompt is the message as vLLM
    renders it (parts joined by a newline), each part's chunk its text and the newline after it, the
    same tokens in any order; a Markdown part is one chunk."""
    texts = [d["text"] for d in DOCS]
    placed = place_parts(tokenizer, parts_messages(texts))
    assert placed.text == string_parts_render(tokenizer)(parts_messages(texts), None)
    assert [tokenizer.decode(c) for c in chunks(placed)] == [text + "\n" for text in texts]
    assert place_parts(tokenizer, parts_messages(texts, marked=False), every_part=True) == placed
    moved = place_parts(tokenizer, parts_messages(texts[::-1]))
    assert chunks(moved) == chunks(placed)[::-1]
    assert moved.token_ids[moved.boundaries[-1]:] == placed.token_ids[placed.boundaries[-1]:]


def _parts(*parts) -> list[dict]:
    return [MESSAGES[0], {"role": "user", "content": list(parts)}]


DOC, QUESTION = {"type": "text", "text": "Rome.", DOCUMENT_PART: True}, {"type": "text", "text": "Which?"}


@pytest.mark.parametrize("messages, every_part, message", [
    (_parts(DOC, QUESTION, {**DOC, "text": "Paris."}), False, "content part 3 is marked as a document but follows"),
    (_parts({**DOC, DOCUMENT_PART: "yes"}, QUESTION), False, "content part 1's graphchunk_document must be true"),
    (_parts({"type": "image_url", "image_url": {"url": "x"}, DOCUMENT_PART: True}, QUESTION), False,
     "content part 1 must be a text part"),
    (_parts(DOC, {**DOC, "text": "Paris."}), False, "needs a part after its documents: the question"),
    (_parts(DOC, {**DOC, "text": " "}, QUESTION), False, "document 2 is empty"),
    (_parts(DOC, DOC, QUESTION), False, "document 2 repeats document 1"),
    ([{"role": "user", "content": [DOC, QUESTION]}, {"role": "user", "content": "Which?"}], False,
     "only the last user message's content parts can be documents"),
    ([MESSAGES[0], {"role": "user", "content": "Rome. Which?"}], True, "needs the last user message's content as a list"),
    (_parts(*[{**DOC, "text": str(i)} for i in range(9)], QUESTION), False, "9 documents, more than max_chunks=8"),
    ([MESSAGES[0], {"role": "user", "content": [QUESTION]}], True, "no document parts before its question"),
    (_parts({**DOC, DOCUMENT_PART: False}, QUESTION), False, "no document parts before its question"),
])
def test_bad_document_parts_are_refused_naming_the_part(tokenizer, messages, every_part, message):
    with pytest.raises(DocumentError, match=message):
        place_parts(tokenizer, messages, every_part, max_chunks=8)


def test_the_renderer_hook_returns_the_sent_prompt_and_its_conversation(tokenizer):
    """document_hooks._render over vLLM's ChatParams and a render_messages of HF's template: the
    tokens prompt carries the boundaries, and the conversation is the one of the prompt sent (with
    the documents placed), never one of the marker renders."""
    from graphchunk.engine.frontend import DOCUMENTS_KEY

    docs = [{"text": d["text"]} for d in DOCS]
    conversation, prompt = _hook_render(tokenizer, None, docs)
    placed = place(tokenizer, docs)
    assert prompt["prompt_token_ids"] == placed.token_ids and prompt["prompt"] == placed.text
    assert list(prompt[DOCUMENTS_KEY].boundaries) == placed.boundaries
    assert conversation[-1]["content"] == "".join(d["text"] + "\n\n" for d in docs) + MESSAGES[1]["content"]


TRIMS = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
         "{{ m['content'] | trim }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")
"""Llama 3's shape: it trims every message."""


def _hook_render(tokenizer, template, documents, messages=MESSAGES, **settings):
    """document_hooks._render over vLLM's ChatParams and HF's template, under ``settings``."""
    from vllm.renderers.params import ChatParams

    from graphchunk.config import GraphChunkConfig
    from graphchunk.engine import document_hooks

    class Renderer:
        def get_tokenizer(self):
            return tokenizer

    def render_messages(renderer, messages, params):
        docs = params.chat_template_kwargs.get("documents")
        return messages, {"prompt": hf_render(tokenizer, **({"chat_template": template} if template else {}))(
            messages, docs)}

    params = ChatParams(chat_template_kwargs={"documents": documents})
    return document_hooks._render(Renderer(), render_messages, messages, params, GraphChunkConfig(**settings))


def test_documents_fallback_runs_unchunkable_documents_as_the_prompt_they_would_be(tokenizer):
    """documents_fallback='ordinary': a template that puts documents after the question gives its
    own rendering, too many documents graphchunk's placement, both UNCHUNKED; malformed documents
    and the default ('refuse') still raise."""
    from graphchunk.documents import Unchunkable
    from graphchunk.engine.document_hooks import UNCHUNKED
    from graphchunk.engine.frontend import DOCUMENTS_KEY

    docs = [{"text": d["text"]} for d in DOCS]
    _, prompt = _hook_render(tokenizer, AFTER_QUESTION, docs, documents_fallback="ordinary")
    assert prompt == {"prompt": hf_render(tokenizer, chat_template=AFTER_QUESTION)(MESSAGES, docs),
                      DOCUMENTS_KEY: UNCHUNKED}
    conversation, prompt = _hook_render(tokenizer, None, docs, documents_fallback="ordinary", max_chunks=2)
    assert prompt == {"prompt": place(tokenizer, docs).text, DOCUMENTS_KEY: UNCHUNKED}
    assert conversation[-1]["content"].startswith(docs[0]["text"])
    with pytest.raises(Unchunkable, match="3 documents, more than max_chunks=2"):
        _hook_render(tokenizer, None, docs, max_chunks=2)
    with pytest.raises(DocumentError, match="document 2 repeats document 1"):
        _hook_render(tokenizer, AFTER_QUESTION, [docs[0], docs[0]], documents_fallback="ordinary")
    # Llama 3's shape trims a message: a first document starting with a space cannot be located,
    # and the ordinary prompt keeps the documents graphchunk placed (the template would drop them).
    spaced = [{"text": " " + docs[0]["text"]}, *docs[1:]]
    with pytest.raises(Unchunkable, match="changes the documents' text"):
        _hook_render(tokenizer, TRIMS, spaced)
    _, prompt = _hook_render(tokenizer, TRIMS, spaced, documents_fallback="ordinary")
    assert prompt == {"prompt": documents_leading(tokenizer, spaced, TRIMS), DOCUMENTS_KEY: UNCHUNKED}


def test_a_template_may_change_the_question(tokenizer):
    """Llama 3's shape trims the user message: a question ending in a newline is the question as
    the template renders it (trimmed), the documents' chunks as ever."""
    docs = [{"text": d["text"]} for d in DOCS]
    trims = MESSAGES[:1] + [{"role": "user", "content": MESSAGES[1]["content"] + "\n"}]
    placed = place(tokenizer, docs, TRIMS, trims)
    assert placed.text == documents_leading(tokenizer, docs, TRIMS)
    assert chunks(placed) == chunks(place(tokenizer, docs, TRIMS))


def test_only_true_marks_make_a_documents_request():
    """graphchunk_document_parts false, or parts marked false, are an ordinary chat request."""
    from vllm.renderers.params import ChatParams

    from graphchunk.config import GraphChunkConfig
    from graphchunk.engine import document_hooks

    class Renderer:
        _graphchunk_document_settings = GraphChunkConfig()

    def settings(messages, **kwargs):
        return document_hooks._documents_settings(Renderer(), messages, ChatParams(chat_template_kwargs=kwargs))

    assert settings(MESSAGES, graphchunk_document_parts=False) is None
    assert settings(_parts({**DOC, DOCUMENT_PART: False}, QUESTION)) is None
    assert settings(MESSAGES, documents=[]) is None
    assert settings(_parts(DOC, QUESTION)) is settings(MESSAGES, graphchunk_document_parts=True) is not None


def test_documents_for_another_renderer_are_refused():
    """A graphchunk engine whose chats vLLM renders without an HF template (here Cohere's melody,
    --tokenizer-mode cohere): documents requests, in the field or as parts, are refused by name."""
    from vllm.renderers.cohere import CohereRenderer
    from vllm.renderers.params import ChatParams

    from graphchunk.config import GraphChunkConfig
    from graphchunk.engine import document_hooks
    from graphchunk.engine.plugin import register

    register()
    renderer = object.__new__(CohereRenderer)  # only its type and graphchunk's settings are read
    setattr(renderer, document_hooks._SETTINGS, GraphChunkConfig())
    for messages, params in ((MESSAGES, ChatParams(chat_template_kwargs={"documents": [{"text": "a"}]})),
                             (parts_messages(["a"]), ChatParams())):
        with pytest.raises(ValueError, match="rendered by CohereRenderer .*--tokenizer-mode hf"):
            renderer.render_chat([messages], params)


# --- through the engine ------------------------------------------------------------------------

@pytest.mark.slow
def test_chat_documents_match_the_oracle_in_both_modes(gc_llm, oracle, tokenizer, oracle_references):
    """GraphChunkLLM.chat(documents=...): the prompt is RagPrompt(chat=True)'s, one lookup per
    document, all hits reordered, answers equal to the oracle's; blend behind another system prompt."""
    docs = [{"text": f"(documents test) {d['text']}"} for d in DOCS]
    sys_prompt = "You answer from the documents; the documents test."
    messages = document_messages(sys_prompt, "Which city is the capital of Italy?")
    for order in ([0, 1, 2], [2, 0, 1]):
        before = gc_llm.stats()
        (out,) = gc_llm.chat(messages, sampling(), documents=[docs[i] for i in order])
        moved = {k: gc_llm.stats()[k] - before[k] for k in ("lookups", "hits", "misses")}
        prompt = RagPrompt(sys_prompt, [docs[i]["text"] for i in order], messages[1]["content"], chat=True)
        ids, boundaries = encode_prompt(tokenizer, prompt)
        assert list(out.prompt_token_ids) == ids
        assert_matches_oracle(out, split_at(ids, boundaries, **LIMITS), oracle)
        assert moved["lookups"] == 3 and moved[("misses" if order == [0, 1, 2] else "hits")] == 3, moved
    other = document_messages("Be brief.", "Which city is the capital of Italy?")
    (out,) = gc_llm.chat(other, sampling(), documents=docs[::-1], mode="blend", recompute="none")
    ids, boundaries = encode_prompt(tokenizer, RagPrompt("Be brief.", [d["text"] for d in docs[::-1]],
                                                         other[1]["content"], chat=True))
    assert list(out.prompt_token_ids) == ids
    assert_matches_reference(out, blend_reference(oracle, split_at(ids, boundaries, **LIMITS), "naive"), "blend")


@pytest.mark.slow
def test_a_template_that_renders_documents_through_the_engine(gc_llm, oracle, tokenizer, oracle_references):
    """vLLM's renderer with a template that renders documents (Granite 3.3's shape, given per
    call): the prompt is place_documents', each header in its document's chunk; all hits
    reordered; answers equal to the oracle's."""
    docs = [{"doc_id": f"t{i}", "text": f"(template test) {d['text']}"} for i, d in enumerate(DOCS)]
    for order, counted in (([0, 1, 2], "misses"), ([1, 2, 0], "hits")):
        documents = [docs[i] for i in order]
        before = gc_llm.stats()
        (out,) = gc_llm.chat(MESSAGES, sampling(), documents=documents, chat_template=GRANITE)
        moved = {k: gc_llm.stats()[k] - before[k] for k in ("lookups", "hits", "misses")}
        placed = place(tokenizer, documents, GRANITE)
        assert list(out.prompt_token_ids) == placed.token_ids
        assert tokenizer.decode(out.prompt_token_ids[placed.boundaries[0]:]).startswith(
            f'<|start_of_role|>document {{"document_id": "{documents[0]["doc_id"]}"}}')
        assert_matches_oracle(out, split_at(placed.token_ids, placed.boundaries, **LIMITS), oracle)
        assert moved["lookups"] == 3 and moved[counted] == 3, moved


@pytest.mark.slow
def test_content_part_documents_match_the_oracle(gc_llm, oracle, tokenizer, oracle_references):
    """Documents as content parts through vLLM's renderer (LLM.chat): the prompt is the message as
    vLLM renders it, one lookup per part, all hits reordered (per part, then per request), answers
    equal to the oracle's."""
    texts = [f"(content parts test) {d['text']}" for d in DOCS]
    for order, every_part, counted in (([0, 1, 2], False, "misses"), ([1, 2, 0], True, "hits")):
        messages = parts_messages([texts[i] for i in order], marked=not every_part)
        before = gc_llm.stats()
        (out,) = gc_llm.chat(messages, sampling(),
                             chat_template_kwargs={"graphchunk_document_parts": True} if every_part else None)
        moved = {k: gc_llm.stats()[k] - before[k] for k in ("lookups", "hits", "misses")}
        placed = place_parts(tokenizer, messages, every_part)
        assert list(out.prompt_token_ids) == placed.token_ids
        assert_matches_oracle(out, split_at(placed.token_ids, placed.boundaries, **LIMITS), oracle)
        assert moved["lookups"] == 3 and moved[counted] == 3, moved


@pytest.mark.slow
def test_bad_documents_raise_without_harming_the_engine(gc_llm):
    with pytest.raises(ValueError, match="document 2 repeats document 1"):
        gc_llm.chat(MESSAGES, sampling(), documents=[{"text": "x"}, {"text": "x"}])
    with pytest.raises(ValueError, match="cannot also send graphchunk_boundaries"):
        params = sampling()
        params.extra_args = {"graphchunk_boundaries": [1, 2]}
        gc_llm.chat(MESSAGES, params, documents=[{"text": "x"}])
    (out,) = gc_llm.chat(MESSAGES, sampling(), documents=[{"text": "Rome is in Italy."}])
    assert out.outputs[0].token_ids
