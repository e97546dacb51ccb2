"""Segmentation on the real SmolLM2 tokenizer: separators in real text, explicit boundaries,
and every degenerate case of the module docstring."""
import re
from pydoc_data.topics import topics

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphchunk.segments import SegmentationError, SeparatorSplitter, split_at

LIMITS = dict(max_chunks=8, max_chunk_len=512)
# Real text without '#', so the only separators are the ones a test puts in.
PARAGRAPHS = [p.strip() for t in sorted(topics) for p in re.split(r"\n\s*\n", topics[t].replace("#", ""))
              if 40 <= len(p) <= 400]


@pytest.fixture(scope="module")
def splitters(tokenizer):
    return {sep: SeparatorSplitter(tokenizer, sep, **LIMITS) for sep in ("##", " # # ")}


def segment_texts(tokenizer, seg):
    return [tokenizer.decode(seg.token_ids[a:b]) for a, b in seg.bounds]


def test_clean_split_keeps_separator_with_following_segment(tokenizer, splitters):
    ids = tokenizer.encode("You are helpful. ## Paris is in France. ## Rome is in Italy. ## Where is Rome?")
    seg = splitters["##"].split(ids)
    assert seg.layout.num_chunks == 2
    assert segment_texts(tokenizer, seg) == [
        "You are helpful.", " ## Paris is in France.", " ## Rome is in Italy.", " ## Where is Rome?"]


def test_spaced_separator_merges_its_space_into_the_next_word(tokenizer, splitters):
    ids = tokenizer.encode("Be brief. # # Cats purr. # # Dogs bark. # # Who purrs?")
    seg = splitters[" # # "].split(ids)
    assert seg.layout.num_chunks == 2
    texts = segment_texts(tokenizer, seg)
    assert texts[0] == "Be brief." and texts[1].startswith(" # #") and "Cats purr." in texts[1]
    assert texts[3].endswith("Who purrs?")


SEP_CONTEXTS = {  # the forms that count: a space or tab before, whitespace after
    "##": ["{a} ## {b}", "{a} ##\n{b}", "{a} ##\n\n{b}", "{a}\t## {b}", "{a}\t##\t{b}"],
    " # # ": ["{a} # # {b}", "{a}. # # {b}", "{a} # #\n{b}"],
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_separator_detection_in_real_text(tokenizer, splitters, data):
    sep = data.draw(st.sampled_from(sorted(SEP_CONTEXTS)))
    template = data.draw(st.sampled_from(SEP_CONTEXTS[sep]))
    k = data.draw(st.integers(1, 5))
    parts = data.draw(st.lists(st.sampled_from(PARAGRAPHS), min_size=k + 2, max_size=k + 2))
    text = parts[0]
    for part in parts[1:]:
        text = template.format(a=text, b=part)
    seg = splitters[sep].split(tokenizer.encode(text))
    assert seg is not None and seg.layout.num_chunks == k
    texts = segment_texts(tokenizer, seg)
    assert "".join(texts) == tokenizer.decode(tokenizer.encode(text))
    for part, got in zip(parts, texts):
        # BPE may move a boundary character into the separator's token, never more.
        assert part.strip()[1:-1] in got


def test_no_separator_is_an_ordinary_prompt(tokenizer, splitters):
    assert splitters["##"].split(tokenizer.encode("Just a question about C# and F#?")) is None


MARKDOWN = """# Install

Run the installer.

## Options

### Advanced

Set `x=1`.
#### Notes
##
Done.##no ##also a##b ####
"""
CODE = """#define CAT(a, b) a##b
## a Python comment block
x = 1
   ## indented heading-like comment
print("##")
"""


@pytest.mark.parametrize("document", [MARKDOWN, CODE])
def test_markdown_headings_and_code_never_count_as_separators(tokenizer, splitters, document):
    assert splitters["##"].split(tokenizer.encode(document)) is None
    text = f"Be brief. ## {document.rstrip()} ## What do the notes say?"  # its own #s stay inside
    seg = splitters["##"].split(tokenizer.encode(text))
    assert seg.layout.num_chunks == 1
    assert document.strip() in tokenizer.decode(seg.chunk_tokens(0))


@pytest.mark.parametrize("lead", ["", " ", "\n", "  \n "])
def test_separator_first_gives_an_empty_sys(tokenizer, splitters, lead):
    seg = splitters["##"].split(tokenizer.encode(f"{lead}## Paris is in France. ## Rome is in Italy. ## Where?"))
    assert seg.layout.sys_len == 0 and seg.layout.num_chunks == 2
    assert seg.layout.positions()[0] == 0
    texts = segment_texts(tokenizer, seg)
    assert texts[1].strip() == "## Paris is in France." and texts[2].strip() == "## Rome is in Italy."


@pytest.mark.parametrize("lead", ["", "\n"])
def test_a_bos_token_before_a_leading_separator_is_the_sys(tokenizer, splitters, lead):
    """A tokenizer that puts BOS first (Llama, Mistral, Gemma): the prompt's first word is the one
    after it, and BOS (with any whitespace before the separator) is the sys every chunk sees."""
    bos = tokenizer.all_special_ids[0]
    ids = [bos] + tokenizer.encode(f"{lead}## Paris is in France. ## Rome is in Italy. ## Where?")
    seg = splitters["##"].split(ids)
    assert seg.layout.num_chunks == 2 and seg.sys_tokens[0] == bos
    assert seg.layout.sys_len == 1 + len(tokenizer.encode(lead))
    texts = segment_texts(tokenizer, seg)
    assert texts[1].strip() == "## Paris is in France." and texts[2].strip() == "## Rome is in Italy."
    assert splitters["##"].split([bos] + tokenizer.encode("## Title\nParis is in France.")) is None


@pytest.mark.parametrize("text", ["## Paris is in France.", "## Title\nParis is in France.\n\n## Rome\nItaly.",
                                  "##Paris ## Where?"])
def test_a_leading_heading_alone_stays_ordinary_or_plain_text(tokenizer, splitters, text):
    seg = splitters["##"].split(tokenizer.encode(text))
    if "Where" not in text:
        assert seg is None  # a Markdown document: its headings never count
    else:
        assert seg.layout.num_chunks == 0 and seg.layout.sys_len > 0  # "##Paris" is a word of text: sys


def test_separator_last_is_an_error(tokenizer, splitters):
    with pytest.raises(SegmentationError, match="question .* is empty"):
        splitters["##"].split(tokenizer.encode("Sys. ## Paris is in France. ##"))
    with pytest.raises(SegmentationError, match="question .* is empty"):
        splitters["##"].split(tokenizer.encode("Sys. ## Paris is in France. ##  \n"))


@pytest.mark.parametrize("middle", [" ## ## ", " ## \n ## "])
def test_consecutive_separators_join_the_following_segment(tokenizer, splitters, middle):
    text = f"Sys. ## Paris is in France.{middle}Rome is in Italy. ## Where?"
    seg = splitters["##"].split(tokenizer.encode(text))
    assert seg.layout.num_chunks == 2
    texts = segment_texts(tokenizer, seg)
    assert texts[1].strip() == "## Paris is in France."
    assert texts[2].count("#") == 4 and texts[2].endswith("Rome is in Italy.")


def test_empty_chunk_right_after_sys_joins_the_next_chunk(tokenizer, splitters):
    seg = splitters["##"].split(tokenizer.encode("Sys. ## ## Paris. ## Where?"))
    texts = segment_texts(tokenizer, seg)
    assert seg.layout.num_chunks == 1 and texts[0] == "Sys." and texts[1].strip() == "## ## Paris."


def test_more_chunks_than_allowed_is_an_error(tokenizer, splitters):
    text = "Sys" + "".join(f" ## doc {i}." for i in range(9)) + " ## Q?"
    with pytest.raises(SegmentationError, match="9 chunks, more than max_chunks=8"):
        splitters["##"].split(tokenizer.encode(text))


def test_chunk_longer_than_allowed_is_an_error(tokenizer, splitters):
    text = "Sys ## short. ## " + "word " * 600 + "## Q?"
    with pytest.raises(SegmentationError, match=r"chunk 2 of 2 has \d+ tokens, more than max_chunk_len=512"):
        splitters["##"].split(tokenizer.encode(text))


def test_explicit_boundaries():
    ids = list(range(100, 110))
    seg = split_at(ids, [2, 5, 5, 8], **LIMITS)  # 5 twice: an empty chunk, dropped
    assert seg.layout.sys_len == 2 and seg.layout.chunk_lens == (3, 3) and seg.layout.question_len == 2
    assert seg.chunk_tokens(1) == (105, 106, 107) and seg.question_tokens == (108, 109)
    assert split_at(ids, [0, 4, 7], **LIMITS).layout.sys_len == 0
    assert split_at(ids, [3], **LIMITS).layout.num_chunks == 0


@pytest.mark.parametrize("boundaries, message", [
    ([], "at least the question"),
    ([2, 10], "question .* is empty"),
    ([5, 3], "non-decreasing"),
    ([2, 11], r"within \[0, 10\]"),
    ([-1, 4], r"within \[0, 10\]"),
    ([2, "4"], "must be integers"),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], "8 chunks|9 chunks"),
])
def test_explicit_boundary_errors(boundaries, message):
    with pytest.raises(SegmentationError, match=message):
        split_at(list(range(10)), boundaries, max_chunks=7, max_chunk_len=512)


def test_explicit_chunk_too_long():
    with pytest.raises(SegmentationError, match="chunk 1 of 1 has 6 tokens, more than max_chunk_len=5"):
        split_at(list(range(10)), [1, 7], max_chunks=4, max_chunk_len=5)
