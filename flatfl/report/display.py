"""Text as a report's pages show it: a line cut to what a page can hold.

A page shows a few hundred characters of one line at most, and the PDF's text layout (matplotlib's glyph layout,
``textwrap`` on a line without spaces) takes time that grows faster than the text's length. A value of a runs.csv or
a run folder can be any length, so every text drawn on a page goes through :func:`shown` first: a longer line keeps
its start and says how long it was; the CSV files and report.md keep it in full.
"""
from __future__ import annotations

__all__ = ["LINE_CHARS", "shown", "shown_lines"]

#: the most characters of one line a page shows (a table cell, a line of a text page, a label)
LINE_CHARS = 400


def shown(text, limit: int = LINE_CHARS) -> str:
    """``text`` (any value, as ``str``) with each of its lines cut to ``limit`` characters: a longer line keeps its
    first characters and ends with ``... (N characters)``. Time linear in the text's length."""
    text = str(text)
    if len(text) <= limit:
        return text
    return "\n".join(_line(part, limit) for part in text.split("\n"))


def _line(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    tail = f"... ({len(line):,} characters)"
    return line[:max(1, limit - len(tail))] + tail


def shown_lines(lines, limit: int = LINE_CHARS) -> list[str]:
    """Each of ``lines`` through :func:`shown`."""
    return [shown(line, limit) for line in lines]
