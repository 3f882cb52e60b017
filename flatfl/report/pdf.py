"""The report's PDF file: pages (matplotlib Figures) rendered in memory and written atomically, its title page's
time stamp, and its page count.

The names :mod:`flatfl.cli` and the tests take from here are kept: :func:`~.text.counts_line` and the defaults of
``--compute-missing`` (:data:`~.missing.DEFAULT_HESSIAN`, :data:`~.missing.DEFAULT_CLIENTS`). The report itself
is built by :func:`flatfl.report.build_report` (:mod:`.build`), which writes through :func:`write_pdf` here.
"""
from __future__ import annotations

import io
import os
import time

from ..errors import ConfigError
from ..utils.io import atomic_write_bytes
from .missing import DEFAULT_CLIENTS, DEFAULT_HESSIAN
from .text import counts_line

__all__ = ["write_pdf", "pdf_page_count", "made_at", "counts_line", "DEFAULT_HESSIAN", "DEFAULT_CLIENTS"]


def write_pdf(pages, path) -> int:
    """Render ``pages`` (matplotlib Figures) into one PDF in memory, then write it atomically. Returns the count."""
    from matplotlib.backends.backend_pdf import FigureCanvasPdf, PdfPages

    buf = io.BytesIO()
    count = 0
    # no creation date: the same runs give the same bytes (docs/reproductions.md, section What "same numbers" covers)
    with PdfPages(buf, metadata={"Creator": "flatfl report", "CreationDate": None}) as pdf:
        for fig in pages:
            FigureCanvasPdf(fig)
            pdf.savefig(fig)
            count += 1
    atomic_write_bytes(path, buf.getvalue())
    return count


def made_at() -> str:
    """When the report is made, for its title page: ``SOURCE_DATE_EPOCH`` (the reproducible-builds convention, in UTC)
    when set, so that the same runs give the same PDF bytes; else the local time now. A ConfigError line when the
    variable is not a non-negative integer."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return time.strftime("%Y-%m-%d %H:%M")
    if not raw.isdigit() or len(raw) > 12:
        raise ConfigError(f"SOURCE_DATE_EPOCH must be a non-negative integer (seconds since 1970), got {raw!r}")
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(int(raw)))


def pdf_page_count(data: bytes) -> int:
    """Pages of a PDF from its page-tree root(s): the /Count of every /Type /Pages node that has no /Parent.

    Enough for matplotlib's uncompressed object layout (and most writers'); not a general PDF parser."""
    import re

    total = 0
    for m in re.finditer(rb"<<(?:(?!>>).)*?/Type\s*/Pages\b(?:(?!endobj).)*?>>", data, flags=re.S):
        node = m.group(0)
        if b"/Parent" in node:
            continue
        c = re.search(rb"/Count\s+(\d+)", node)
        if c:
            total += int(c.group(1))
    return total
