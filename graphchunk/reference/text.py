"""Real text for tests and benchmarks: paragraphs of CPython's help topics (``pydoc_data``,
shipped with every Python), so no download is needed and every run reads the same text."""
from __future__ import annotations


def help_topic_paragraphs() -> list[str]:
    """Every non-blank paragraph of the help topics in a fixed order (topics sorted by name), '#'
    removed (so that no separator occurs in them), as written: inner newlines and indentation
    kept, surrounding newlines stripped."""
    from pydoc_data.topics import topics

    return [paragraph.strip("\n") for name in sorted(topics)
            for paragraph in topics[name].replace("#", "").split("\n\n") if paragraph.strip()]


def help_paragraphs() -> list[str]:
    """The help topics' paragraphs as prose: whitespace collapsed, ASCII only, each at least 200
    characters."""
    found = []
    for paragraph in help_topic_paragraphs():
        text = " ".join(paragraph.split())
        if len(text) >= 200 and text.isascii():
            found.append(text)
    return found
