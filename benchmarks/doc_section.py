"""Each benchmark owns one section of docs/benchmarks.md, between its own begin and end markers."""

from __future__ import annotations

from pathlib import Path


def write_section(doc: Path, begin: str, end: str, section: str, title: str = "# Benchmarks") -> None:
    """Replace the text from `begin` to `end` with `section` (which carries both markers), or append
    it when the page has no such section yet (a new page starts with `title`); the rest of the page
    is left as it is."""
    text = doc.read_text() if doc.exists() else f"{title}\n"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)
