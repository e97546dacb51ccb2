"""Splitting a prompt's token ids into sys / chunks / question.

Two ways to give the split (DESIGN.md §2):

* explicit boundaries (``split_at``): no separator reaches the model;
* a separator string in the text (``SeparatorSplitter``): the separator tokens stay in the
  sequence and belong to the segment that follows them.

Degenerate cases, each a tested, documented behaviour:

========================  ====================================================================
no separator              ``None``: an ordinary prompt, run exactly as vanilla vLLM
separator first           empty sys (S = 0); the chunks start at position 0: the prompt's first
                          word is the separator (``"## doc ## q"``, ``" ## doc ## q"``) and at
                          least one more separator counts; a leading Markdown heading with no
                          further separator (``"## Title\ntext"``) is an ordinary prompt; a sys
                          of whitespace only is empty, its tokens open the first chunk; special
                          tokens the tokenizer puts first (BOS) are the sys, the prompt's first
                          word the one after them
empty chunk               explicit boundaries: dropped (it has no tokens, nothing changes);
                          separator text (consecutive separators, or only whitespace between
                          two): its tokens join the following segment
separator last            ``SegmentationError``: the question is empty
more chunks than allowed  ``SegmentationError`` naming the count and ``max_chunks``
chunk longer than allowed ``SegmentationError`` naming the chunk and ``max_chunk_len``
========================  ====================================================================

What counts as a separator: the separator string (its own leading and trailing whitespace
ignored: ``" ## "`` and ``"##"`` are one separator) standing as a word of its own inside a line:
a space or tab right before it, whitespace or the end of the text right after it, and not the
first word of a line (except the prompt's first line, so that ``" ## doc ## question"`` has an
empty sys); the prompt's very first word counts too when at least one more separator counts
(``"## doc ## question"``: an empty sys, as the seed documents write it). Markdown headings (``## Title``, indented or not), ``###``/``####``, ``a##b``, ``##``
alone on a line and indented ``## comments`` in code never count, so a Markdown document is not
split at its headings. (C's token pasting, ``a ## b``, and an inline ``x = 1  ## note`` do count:
send code as documents or with explicit boundaries.)

BPE merges separators with their neighbours differently in context, so detection runs on text:
each token's decoded piece gives character offsets, the separator is found in the joined text,
and every token overlapping an occurrence starts (or belongs to) the following segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from graphchunk.layout import Layout


class SegmentationError(ValueError):
    """The prompt cannot be segmented; the message names the problem and the segment."""


@dataclass(frozen=True)
class SegmentedPrompt:
    token_ids: tuple[int, ...]
    layout: Layout

    @cached_property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) of sys, each chunk, and the question, in logical token indices."""
        lay = self.layout
        starts = [0, *lay.chunk_starts(), lay.context_len]
        ends = [lay.sys_len, *(s + n for s, n in zip(lay.chunk_starts(), lay.chunk_lens)), lay.num_tokens]
        return list(zip(starts, ends))

    def __getstate__(self) -> dict:
        """Pickled (to the workers, in the connector's metadata) without what was derived and
        kept on it (``bounds``, ``token_array``, the planner's content keys): they are made again."""
        return {"token_ids": self.token_ids, "layout": self.layout}

    @cached_property
    def token_array(self) -> np.ndarray:
        """``token_ids`` as int64, made once: content keys hash slices of it (``cache/keys.py``)."""
        return np.fromiter(self.token_ids, np.int64, len(self.token_ids))

    def segment_array(self, i: int) -> np.ndarray:
        """Segment ``i``'s tokens (0: sys, 1 + j: chunk j) as a slice of ``token_array``."""
        start, end = self.bounds[i]
        return self.token_array[start:end]

    @property
    def sys_tokens(self) -> tuple[int, ...]:
        return self.token_ids[: self.layout.sys_len]

    def chunk_tokens(self, i: int) -> tuple[int, ...]:
        start, end = self.bounds[1 + i]
        return self.token_ids[start:end]

    @property
    def question_tokens(self) -> tuple[int, ...]:
        return self.token_ids[self.layout.context_len :]


def make_segmented(token_ids: Sequence[int], starts: Sequence[int], max_chunks: int,
                   max_chunk_len: int) -> SegmentedPrompt:
    """Builds the prompt from segment start indices [c_1, ..., c_k, q] and checks the limits."""
    n = len(token_ids)
    edges = [0, *starts, n]
    lens = [b - a for a, b in zip(edges, edges[1:])]
    chunk_lens = tuple(lens[1:-1])
    if lens[-1] == 0:
        raise SegmentationError("the question (last segment) is empty")
    if len(chunk_lens) > max_chunks:
        raise SegmentationError(f"prompt has {len(chunk_lens)} chunks, more than max_chunks={max_chunks}")
    for i, length in enumerate(chunk_lens):
        if length > max_chunk_len:
            raise SegmentationError(
                f"chunk {i + 1} of {len(chunk_lens)} has {length} tokens, more than max_chunk_len={max_chunk_len}")
    ids = tuple(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)  # an array or tensor: as ints
    return SegmentedPrompt(ids, Layout(lens[0], chunk_lens, lens[-1]))


def split_at(token_ids: Sequence[int], boundaries: Sequence[int], *, max_chunks: int,
             max_chunk_len: int) -> SegmentedPrompt:
    """Explicit boundaries: the start indices of c_1..c_k and of the question, i.e.
    ``[S, S+L_1, ..., S+sum(L_i)]``, non-decreasing, within [0, len(token_ids)]. Equal neighbours
    give an empty chunk, which is dropped (it holds no tokens). No chunks at all (one boundary)
    is an ordinary causal prompt: its layout computes exactly what vanilla attention does.
    """
    n = len(token_ids)
    if not boundaries:
        raise SegmentationError("explicit boundaries must name at least the question's start")
    bad = [b for b in boundaries if not isinstance(b, (int, np.integer)) or isinstance(b, bool)]
    if bad:
        raise SegmentationError(f"boundaries must be integers, got {bad[0]!r}")
    if any(b < 0 or b > n for b in boundaries):
        raise SegmentationError(f"boundaries {list(boundaries)} must lie within [0, {n}] (prompt length)")
    if any(a > b for a, b in zip(boundaries, boundaries[1:])):
        raise SegmentationError(f"boundaries {list(boundaries)} must be non-decreasing")
    # Repeated boundaries are empty chunks; 0 among them means an empty sys.
    return make_segmented(token_ids, sorted(set(int(b) for b in boundaries)), max_chunks, max_chunk_len)


class SeparatorSplitter:
    """Finds a separator string in token ids, robust to how the tokenizer merged it."""

    def __init__(self, tokenizer, separator: str, *, max_chunks: int, max_chunk_len: int):
        if not separator.strip():
            raise ValueError("separator must hold a non-whitespace character")
        self.separator = separator.strip()
        self.max_chunks = max_chunks
        self.max_chunk_len = max_chunk_len
        self._pieces = token_pieces(tokenizer)
        self._special = frozenset(tokenizer.all_special_ids)

    def split(self, token_ids: Sequence[int], separator: str | None = None) -> SegmentedPrompt | None:
        """The segmented prompt at ``separator`` (default: this splitter's), or None when it does
        not occur (an ordinary prompt)."""
        separator = self.separator if separator is None else separator.strip()
        # Special tokens the tokenizer puts first (BOS) are not text: the prompt's first word is
        # the one after them. They stay the sys where a separator opens the text.
        lead = next((i for i, t in enumerate(token_ids) if t not in self._special), len(token_ids))
        pieces = [""] * lead + [self._pieces[t] for t in token_ids[lead:]]
        text = "".join(pieces)
        occurrences = _find_all(text, separator)
        if not occurrences:
            return None
        ends = np.cumsum([len(p) for p in pieces])
        token_starts = ends - np.array([len(p) for p in pieces])
        # The first token overlapping a separator opens the next segment.
        firsts = np.searchsorted(ends, [begin for begin, _ in occurrences], side="right")
        starts = sorted(set(int(f) for f in firsts))
        content = _content_mask(text, occurrences)

        def has_content(a: int, b: int) -> bool:
            return b > a and bool(content[token_starts[a]:ends[b - 1]].any())

        if not lead and not has_content(0, starts[0]):  # a sys of whitespace only (``"\n## doc"``): empty, its tokens open c_1
            starts[0] = 0
        edges = starts + [len(pieces)]
        if not has_content(edges[-2], edges[-1]):
            raise SegmentationError("the question (last segment) is empty: the prompt ends with the separator")
        # A chunk without content (consecutive separators) gives its tokens to the next segment.
        kept, open_at = [], None
        for a, b in zip(starts, edges[1:]):
            a = a if open_at is None else open_at
            open_at = None if b == len(pieces) or has_content(a, b) else a
            if open_at is None:
                kept.append(a)
        return make_segmented(token_ids, kept, self.max_chunks, self.max_chunk_len)


def _find_all(text: str, needle: str) -> list[tuple[int, int]]:
    """Where ``needle`` stands as a word of its own inside a line (the module docstring's rule),
    and as the prompt's first word when another occurrence counts."""
    found, at = [], text.find(needle)
    while at >= 0:
        end = at + len(needle)
        line = text.rfind("\n", 0, at)
        first_word = line >= 0 and not text[line + 1:at].strip()
        if at > 0 and text[at - 1] in " \t" and (end == len(text) or text[end].isspace()) and not first_word:
            found.append((at, end))
        at = text.find(needle, at + 1)
    lead = len(text) - len(text.lstrip())
    end = lead + len(needle)
    if found and found[0][0] > lead and text.startswith(needle, lead) and end < len(text) and text[end].isspace():
        found.insert(0, (lead, end))
    return found


def _content_mask(text: str, occurrences) -> np.ndarray:
    """True for characters that are neither separator nor whitespace."""
    mask = np.fromiter((not c.isspace() for c in text), dtype=bool, count=len(text))
    for begin, end in occurrences:
        mask[begin:end] = False
    return mask


def token_pieces(tokenizer) -> list[str]:
    """Decoded text of every vocabulary id, with leading spaces kept.

    Decoding ``[anchor, t]`` and cutting the anchor keeps the leading space that SentencePiece
    strips from a lone token; byte-level BPE pieces of a split UTF-8 character decode to U+FFFD,
    which never matches an ASCII separator.
    """
    anchor = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a")[0])
    prefix = tokenizer.decode([anchor])
    decoded = tokenizer.batch_decode([[anchor, t] for t in range(len(tokenizer))])
    return [d[len(prefix):] for d in decoded]
