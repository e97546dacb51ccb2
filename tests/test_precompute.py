"""``graphchunk-precompute``'s corpus reading and its errors (the run itself: tests/test_tier.py)."""
import json

import pytest

from graphchunk.tools.corpus_context import Journal, contexts
from graphchunk.tools.precompute import contextualized, main, make_parser, precompute, precompute_contextualized, \
    read_corpus


def write(tmp_path, lines):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def texts(*values) -> list[dict]:
    return [{"text": value} for value in values]


def test_groups_by_sys_and_mode_in_file_order_once_each(tmp_path):
    path = write(tmp_path, [{"text": "a"}, {"text": "b", "mode": "blend"}, "", {"text": "a"},
                            {"text": "c", "sys": "other"}, {"text": "d"}])
    assert read_corpus(path, "S", "isolated") == {("S", "isolated"): texts("a", "d"), ("S", "blend"): texts("b"),
                                                  ("other", "isolated"): texts("c")}


def test_documents_lines_carry_their_fields_and_segments_refuses_them(tmp_path):
    titled = {"title": "T", "text": "a"}
    path = write(tmp_path, [{"document": titled}, {"text": "a"}, {"document": {"text": "a"}}, {"document": titled}])
    assert read_corpus(path, "S", "isolated") == {("S", "isolated"): [titled, {"text": "a"}]}
    with pytest.raises(ValueError, match="docs.jsonl:1: --format segments and separator send a document's text only"):
        read_corpus(path, "S", "isolated", text_only=True)


@pytest.mark.parametrize("line, message", [
    ("{not json", "docs.jsonl:2: not JSON"),
    ({"txt": "a"}, "docs.jsonl:2: each line needs a non-empty string 'text' or a 'document' object"),
    ({"text": "a", "document": {"text": "b"}}, "not both"),
    ({"text": ""}, "docs.jsonl:2: document 1 is empty"),
    ({"text": 3}, "document 1's 'text' must be a string"),
    ({"document": {"text": "a", "meta": {"page": 1}}}, "document 1's 'meta' must be a string"),
    ({"document": ["a"]}, "document 1 must be a non-empty object of strings"),
    ({"text": "a", "mode": "fast"}, "'mode' one of auto, isolated, blend"),
    ({"text": "a", "sys": 3}, "'sys' must be a string"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        read_corpus(write(tmp_path, [{"text": "ok"}, line]), "", "isolated")


def test_cli_refuses_bad_input_before_starting_an_engine(tmp_path, capsys):
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(write(tmp_path, ["{bad"]))]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(write(tmp_path, [""]))]) == 2
    assert "holds no documents" in capsys.readouterr().err
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(tmp_path / "missing.jsonl")]) == 2


def test_mode_auto_leaves_the_mode_to_the_engine(tmp_path):
    """The default --mode is 'auto': its documents' requests name no mode, so they run in the
    engine's default mode, as a server's with the same settings do; a named mode is sent."""
    assert make_parser().parse_args(["--store", "s", "--corpus", "c"]).mode == "auto"
    groups = read_corpus(write(tmp_path, [{"text": "a"}, {"text": "b", "mode": "isolated"}]), "S", "auto")

    class Engine:
        def __init__(self):
            self.sent = []

        def stats(self):
            return dict.fromkeys(("tier_writes", "tier_bytes_written", "tier_hits", "tier_rejected",
                                  "tier_write_errors", "misses"), 0)

        def generate(self, prompts, params, use_tqdm):
            self.sent += [(p.chunks[0], params.extra_args) for p in prompts]

    engine = Engine()
    assert precompute(engine, groups, "segments", progress=False)["documents"] == 2
    assert engine.sent == [("a", None), ("b", {"graphchunk_mode": "isolated"})]


CONTEXT_CORPUS = [
    {"id": "cats", "text": "The cat sat on the mat and purred at the dog."},
    {"id": "qubits", "text": "Quantum computers use qubits and superposition.", "context": ["states", "cats"]},
    {"id": "states", "text": "Qubits in superposition let quantum computers explore many states."},
    {"text": "A dog chased the cat off the mat."},
    {"text": "Tea grows on terraced hillsides."},
]


def test_a_listed_context_is_the_lines_it_names_in_order(tmp_path):
    path = write(tmp_path, CONTEXT_CORPUS)
    found = contexts(path, read_corpus(path, "S", "auto"), "list", 2)
    by_text = {dict(k)["text"][:5]: [d["text"][:5] for d in v] for k, v in found.items()}
    assert by_text == {"The c": [], "Quant": ["Qubit", "The c"], "Qubit": [], "A dog": [], "Tea g": []}


def test_bm25_puts_the_most_related_documents_next_to_each_one(tmp_path):
    with pytest.raises(ValueError, match="docs.jsonl:2: this line names its 'context'; --context bm25"):
        path = write(tmp_path, CONTEXT_CORPUS)
        contexts(path, read_corpus(path, "S", "auto"), "bm25", 2)
    path = write(tmp_path, [{k: v for k, v in line.items() if k != "context"} for line in CONTEXT_CORPUS])
    found = contexts(path, read_corpus(path, "S", "auto"), "bm25", 2)
    by_text = {dict(k)["text"][:5]: [d["text"][:5] for d in v] for k, v in found.items()}
    assert by_text["Quant"] == ["Qubit"]  # the only document sharing its terms
    assert by_text["A dog"][-1] == "The c" and "Quant" not in by_text["A dog"]
    assert by_text["Tea g"] == []  # shares no term with any other: computed behind the sys prompt only


@pytest.mark.parametrize("lines, message", [
    ([{"id": "a", "text": "x", "context": ["b"]}], r"'context' names \['b'\], not the id of another line"),
    ([{"id": "a", "text": "x", "context": ["a"]}], "not the id of another line"),
    ([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "'id' must be a string no other line has"),
    ([{"text": "x", "context": "a"}], "'context' must be a list"),
    ([{"id": "a", "text": "x"}, {"text": "y", "context": ["a"]}, {"text": "y"}], "appears on another line with another context"),
    ([{"text": "x", "mode": "isolated"}], "every line must be blend or auto"),
    ([{"text": "x"}, {"text": "x", "sys": "other"}], "appears behind two sys prompts"),
])
def test_bad_contexts_are_named(tmp_path, lines, message):
    path = write(tmp_path, lines)
    with pytest.raises(ValueError, match=message):
        contexts(path, read_corpus(path, "S", "auto"), "list", 2)


class CapturingEngine:
    """Stands in for the 'precompute' engine: each request writes its last document's tier file,
    except ``fail`` ones."""

    def __init__(self, fail=()):
        self.sent, self.writes, self.fail = [], 0, set(fail)

    def stats(self):
        return {"tier_writes": self.writes, **dict.fromkeys(("tier_bytes_written", "tier_hits", "tier_rejected",
                                                             "tier_write_errors", "misses"), 0)}

    def generate(self, prompts, params, use_tqdm):
        assert params.extra_args == {"graphchunk_mode": "blend"}
        for prompt in prompts:
            self.sent.append(tuple(prompt.chunks))
            self.writes += prompt.chunks[-1] not in self.fail


def test_a_contextualized_run_resumes_after_the_last_batch_it_wrote(tmp_path):
    path = write(tmp_path, CONTEXT_CORPUS)
    groups = read_corpus(path, "S", "auto")
    todo = contextualized(groups, contexts(path, groups, "list", 2))
    setup = {"model": "m", "context": "list"}
    engine = CapturingEngine(fail={"Tea grows on terraced hillsides."})
    result = precompute_contextualized(engine, todo, "segments", Journal(tmp_path / "store", setup, 2), False)
    assert (result["documents"], result["skipped"], result["unwritten"]) == (5, 0, 1)
    assert engine.sent[1] == ("Qubits in superposition let quantum computers explore many states.",
                              "The cat sat on the mat and purred at the dog.",
                              "Quantum computers use qubits and superposition.")
    again = CapturingEngine()
    result = precompute_contextualized(again, todo, "segments", Journal(tmp_path / "store", setup, 2), False)
    assert (result["skipped"], result["unwritten"], again.sent) == (4, 0, [("Tea grows on terraced hillsides.",)])
    other = CapturingEngine()  # other settings (or another context) compute everything again
    precompute_contextualized(other, todo, "segments", Journal(tmp_path / "store", {**setup, "model": "n"}), False)
    assert len(other.sent) == 5


def test_cli_refuses_a_context_it_cannot_build_before_starting_an_engine(tmp_path, capsys):
    path = write(tmp_path, [{"text": "x", "context": ["nope"]}])
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(path), "--context", "list"]) == 2
    assert "not the id of another line" in capsys.readouterr().err


def seeds_docs() -> list[str]:
    """Real text (CPython help topics, as tests/test_tier.py) and the edges BPE might merge across:
    punctuation, digits and non-ASCII at either end, spaces and a line break before the end, a
    Markdown heading, and a separator inside (two chunks)."""
    from pydoc_data.topics import topics

    real = [" ".join(topics[name].split()[:60]) for name in sorted(topics)[:4]]
    return [*real, "(see 3.14) — naïve café, 東京 ✓...", "ends with spaces  ", "two lines\nthe second.",
            "intro\n## Heading\nbody 42", "first half ## second half", '"quoted" 123', "  leading spaces"]


def separator_chunks(splitter, tokenizer, text: str) -> tuple[tuple, list[tuple]]:
    """(sys tokens, each chunk's tokens) of ``text`` as the server splits a text prompt (tokenized
    whole, as vLLM's renderer does, then ``SeparatorSplitter``)."""
    seg = splitter.split(tokenizer.encode(text))
    return seg.sys_tokens, [seg.chunk_tokens(i) for i in range(seg.layout.num_chunks)]


@pytest.mark.parametrize("sys_prompt", ["Answer from the documents.", ""])
def test_separator_precompute_chunks_are_every_seeds_form_requests_chunks(tokenizer, sys_prompt):
    """``--format separator``: the (sys, chunk) tokens its requests store are those of real
    multi-document requests ``sys ## d1 ## ... ## question`` (and, with an empty sys, the seeds'
    ``## d1 ## ...``) with SmolLM2's tokenizer, for every document first, in the middle and last,
    whatever its neighbours; a document holding the separator is two chunks in both. The same
    documents as ``--format segments`` tokenizes them (alone) are never such a chunk."""
    from graphchunk.llm import RagPrompt, encode_prompt
    from graphchunk.segments import SeparatorSplitter
    from graphchunk.tools.precompute import separator_prompts

    splitter = SeparatorSplitter(tokenizer, "##", max_chunks=64, max_chunk_len=1 << 20)
    docs = seeds_docs()
    stored, counts = set(), {}
    for doc in docs:
        for text in separator_prompts(sys_prompt, [doc], "##", both_openings=True):
            sys_tokens, chunks = separator_chunks(splitter, tokenizer, text)
            stored |= {(sys_tokens, chunk) for chunk in chunks}
            counts.setdefault(doc, len(chunks))
    # one chunk per document (an empty sys: two, either opening), the split one's second half once more
    assert len(stored) == (len(docs) if sys_prompt else 2 * len(docs)) + 1
    orders = [docs[k:] + docs[:k] for k in range(len(docs))] + [docs[::-1]]  # each document first, inside, last
    for order in orders:
        text = " ## ".join([sys_prompt, *order, "Which statement is described first?"])
        for request in ([text, text[1:]] if not sys_prompt else [text]):
            sys_tokens, chunks = separator_chunks(splitter, tokenizer, request)
            assert len(chunks) == sum(counts[doc] for doc in order)
            missing = [tokenizer.decode(chunk) for chunk in chunks if (sys_tokens, chunk) not in stored]
            assert not missing, (request[:40], missing)
    if sys_prompt:  # the same user text in a chat request: the same chunks, behind the template's sys
        user = " ## ".join([sys_prompt, *orders[-1], "Which statement is described first?"])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
        _, chunks = separator_chunks(splitter, tokenizer, rendered)
        assert len(chunks) == len(docs) + 1 and set(chunks) <= {chunk for _, chunk in stored}
    for doc in docs:
        ids, (start, end) = encode_prompt(tokenizer, RagPrompt(sys_prompt, [doc], "?"))
        assert all(chunk != tuple(ids[start:end]) for _, chunk in stored)


def test_separator_format_sends_the_seeds_form_split_at_the_separator(tmp_path, capsys):
    """Each document's request is the text ``sys # # document # # ?`` split at the separator; with
    an empty sys also the form that opens with it; a blank separator is refused before an engine."""
    groups = read_corpus(write(tmp_path, [{"text": "a b"}, {"text": "c", "sys": ""}]), "S", "isolated")

    class Engine(CapturingEngine):
        def generate(self, prompts, params, use_tqdm, separator):
            self.sent += [(prompt, separator, params.extra_args) for prompt in prompts]

    engine = Engine()
    assert precompute(engine, groups, "separator", progress=False, separator=" # # ")["documents"] == 2
    mode = {"graphchunk_mode": "isolated"}
    assert engine.sent == [("S # # a b # # ?", " # # ", mode), (" # # c # # ?", " # # ", mode),
                           ("# # c # # ?", " # # ", mode)]
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(tmp_path / "docs.jsonl"), "--format", "separator",
                 "--separator", " "]) == 2
    assert "--separator must hold a non-whitespace character" in capsys.readouterr().err


def test_separator_format_refuses_documents_the_server_would_not_cut_out(tmp_path, capsys):
    """A document ending in a newline (or behind a sys that does) runs into the next segment in the
    seeds' form: the separator after it begins a line, which the server's rule does not split at.
    Refused, naming it, before an engine starts; the others' form is unaffected."""
    from graphchunk.tools.precompute import unsplit

    lines = [{"text": "a b"}, {"text": "ends a line\n"}, {"text": "c", "sys": "S\n"}, {"text": "x ## y"}]
    groups = read_corpus(write(tmp_path, lines), "S", "isolated")
    assert unsplit(groups, "##") == ["ends a line\n", "c"]
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(tmp_path / "docs.jsonl"), "--format", "separator",
                 "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err
    assert "2 documents would get no entry of their own" in err and "'ends a line\\n'" in err
    assert unsplit(read_corpus(write(tmp_path, lines[:1] + lines[3:]), "", "isolated"), "##") == []
