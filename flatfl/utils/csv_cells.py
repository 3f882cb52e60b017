"""CSV cells a spreadsheet would execute, neutralised in every CSV flatfl writes, and read back as they were.

A spreadsheet opening a CSV file runs a cell that begins with ``=``, ``+``, ``-`` or ``@`` as a formula (``=cmd|'
/C calc'!A0``, ``=HYPERLINK(...)``), and one that begins with a tab or a carriage return may be taken for one. A
run name, a method or a setting that reaches a CSV from another person's files could begin so. Following the OWASP
rule for CSV injection, :func:`csv_cell` prefixes such a cell with a single quote, which a spreadsheet shows as text
and never runs. A plain number (``-0.5``, ``+3``, ``-1e-05``, ``-inf``) is left as it is: it is no formula.

The quote is added only where :func:`read_csv_cell` takes it away again (a cell that begins with a quote followed
by a cell it would take one from is quoted once more), so reading back any cell flatfl wrote gives the original
value: ``read_csv_cell(csv_cell(x)) == str(x)`` for every value, and flatfl's own readers of its CSVs do so.
"""
from __future__ import annotations

import re

__all__ = ["FORMULA_STARTS", "csv_cell", "csv_row", "read_csv_cell"]

#: the first characters that make a spreadsheet cell a formula (OWASP's list)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)


def _formula(text: str) -> bool:
    return text.startswith(FORMULA_STARTS) and _NUMBER.fullmatch(text) is None


def read_csv_cell(text: str) -> str:
    """A cell of a CSV flatfl wrote, as it was before :func:`csv_cell`: the leading quote taken away where
    :func:`csv_cell` added one; any other text as it is."""
    if text.startswith("'") and (_formula(text[1:]) or text[1:].startswith("'")):
        return text[1:]
    return text


def csv_cell(value):
    """``value`` as a CSV cell a spreadsheet never executes: text that begins like a formula (:data:`FORMULA_STARTS`,
    but for a plain number) prefixed with a single quote; numbers and None as they are."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = str(value)
    if _formula(text) or (text.startswith("'") and read_csv_cell(text) != text):
        return "'" + text
    return text


def csv_row(row):
    """:func:`csv_cell` of every cell of a row: a dict (its values) or a sequence."""
    if isinstance(row, dict):
        return {k: csv_cell(v) for k, v in row.items()}
    return [csv_cell(v) for v in row]
