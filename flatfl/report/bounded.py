"""Reading the files a report is made of, bounded: a CSV field or a JSON nesting that no flatfl file holds is one
ConfigError line naming the file, never a crash of the reader.

* CSV: Python's csv module refuses fields over 131,072 characters by default, yet flatfl writes longer ones itself
  (a table row's ``runs``: the names of every run it averages). :func:`csv_rows` reads with a limit of
  :data:`MAX_FIELD_CHARS` (far above what flatfl writes, and below the file sizes readers accept) and restores the
  process's limit afterwards.
* JSON: :func:`loads` refuses a nesting deeper than :data:`MAX_JSON_DEPTH` (flatfl's files nest a few levels), both
  where the parser itself would run out of stack and where it would parse but a later reader would recurse.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError
from ..utils.csv_cells import read_csv_cell

__all__ = ["MAX_FIELD_CHARS", "MAX_JSON_DEPTH", "field_limit", "read_text", "csv_rows", "finite_number", "loads",
           "check_depth"]

#: the longest CSV field read (a table row naming 100,000 runs of 100 characters each fits 10 times over)
MAX_FIELD_CHARS = 16 * 1024 * 1024
#: the deepest JSON nesting read (flatfl's summary.json, config.json and results nest at most a handful of levels)
MAX_JSON_DEPTH = 64


@contextlib.contextmanager
def field_limit(limit: int | None = None) -> Iterator[None]:
    """csv's field size limit set to ``limit`` (default :data:`MAX_FIELD_CHARS`) inside the block, the previous one
    restored after it."""
    before = csv.field_size_limit(MAX_FIELD_CHARS if limit is None else limit)
    try:
        yield
    finally:
        csv.field_size_limit(before)


def read_text(path: Path, max_bytes: int, what: str, encoding: str = "utf-8") -> str:
    """The text of the file at ``path``, read only when it holds at most ``max_bytes`` (``what``: what such a file
    is, for the message); too large, unreadable or not UTF-8 text is one ConfigError line naming the file."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigError(f"{path}: {size:,} bytes, more than {what} holds ({max_bytes:,})")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); not {what}") from None


def csv_rows(text: str, path) -> tuple[list[str], list[tuple[int, dict]]]:
    """The header and the rows (with their line numbers, counting from 2 for the first row) of CSV ``text`` read
    from ``path``, each cell as it was before flatfl neutralised it for spreadsheets
    (:func:`flatfl.utils.csv_cells.read_csv_cell`); a field over :data:`MAX_FIELD_CHARS` characters, or text csv
    cannot read, or a column named twice, is one ConfigError line naming the file."""
    rows = []
    with field_limit():
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            fields = [read_csv_cell(f) for f in reader.fieldnames or []]
            twice = sorted({f for f in fields if fields.count(f) > 1})
            if twice:  # csv would keep the last column of the name: one column read as another
                raise ConfigError(f"{path}: column {', '.join(twice[:3])} named twice in the header")
            reader.fieldnames = fields
            for row in reader:
                rows.append((reader.line_num, {k: read_csv_cell(v) if isinstance(v, str) else v
                                               for k, v in row.items()}))
        except csv.Error as e:
            line = reader.line_num + 1  # the line being read (not yet counted)
            if "field larger than field limit" in str(e):
                raise ConfigError(f"{path} line {line}: a field over {csv.field_size_limit():,} characters, more than "
                                  "flatfl writes; the file is damaged or not flatfl's") from None
            raise ConfigError(f"{path} line {line}: not readable as CSV ({' '.join(str(e).split())[:80]})") from None
    return fields, rows


def finite_number(text: str, where: str) -> float | None:
    """A CSV field as a finite number, None when empty; anything else is one ConfigError line, ``where`` (the file,
    line and column) first."""
    if text.strip() == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where} is not a number: {text[:40]!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where} is not finite: {text[:40]!r}")
    return value


def check_depth(value, path, limit: int = MAX_JSON_DEPTH) -> None:
    """ConfigError when ``value`` (parsed JSON) nests lists and objects deeper than ``limit`` (walked without
    recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                raise ConfigError(f"{path}: JSON nested more than {limit} levels deep, more than flatfl writes; "
                                  "the file is damaged or not flatfl's")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def loads(text: str, path: Path | str, limit: int = MAX_JSON_DEPTH):
    """``json.loads(text)`` with its nesting bounded (:func:`check_depth`); not JSON is one ConfigError line."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested more than {limit} levels deep, more than flatfl writes; the file "
                          "is damaged or not flatfl's") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    check_depth(value, path, limit)
    return value
