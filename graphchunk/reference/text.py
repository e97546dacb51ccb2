"""Real text for tests and benchmarks: paragraphs of CPython's help topics (``pydoc_data``,
shipped with every Python), so no download is needed and every run reads the same text."""
from __future__ import annotations


def help_paragraphs() -> list[str]:
    """Paragraphs of the help topics in a fixed order: whitespace collapsed, '#' removed (so that
    no separator occurs in them), ASCII only, each at least 200 characters."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        for paragraph in topics[name].replace("#", "").split("\n\n"):
            text = " ".join(paragraph.split())
            if len(text) >= 200 and text.isascii():
                found.append(text)
    return found
