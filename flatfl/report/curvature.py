"""The curvature-against-rounds page of a report: runs trained with ``flatfl train --track-hessian K``.

:func:`curvature_page` draws, for a few methods (a method and its "+MAN" variant on one axis), the top Hessian
eigenvalue, the trace and the loss on the fixed evaluation sample against the round (metrics.csv's ``hessian_*``
columns); one column of panels per partition, one line per method: the mean over its seeds, the band their range.
The styles are :func:`flatfl.report.figures.line_styles` (a method solid, its "+MAN" variant dashed, same colour).
"""
from __future__ import annotations

import textwrap

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .figures import PAGE_SIZE, line_styles

__all__ = ["SERIES", "has_curvature", "curvature_page"]

# (metrics.csv column, axis label)
SERIES = (("hessian_top", "top Hessian eigenvalue"), ("hessian_trace", "Hessian trace"),
          ("hessian_loss", "training loss (evaluation sample)"))


def has_curvature(records) -> bool:
    """Whether any run has a curvature series (a round with a top eigenvalue or a trace)."""
    return any(row.get(col) is not None for rec in records for row in rec.curve for col, _ in SERIES[:2])


def _series(rec, column: str) -> dict:
    return {int(row["round"]): row[column] for row in rec.curve
            if row.get(column) is not None and row.get("round") is not None}


def curvature_page(title: str, records, methods: list[str], subtitle: str = "") -> Figure:
    """The page (see the module docstring); ``methods`` in legend order, runs of other methods left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=PAGE_SIZE)
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=12, weight="bold", y=0.975)
    records = [r for r in records if r.method in methods]
    methods = [m for m in methods if any(r.method == m for r in records)]
    rows = [(col, label) for col, label in SERIES if any(_series(r, col) for r in records)]
    parts = sorted({r.partition for r in records})
    styles = line_styles(methods)
    several = any(sum(r.method == m and r.partition == p for r in records) > 1 for m in methods for p in parts)
    subtitle = "; ".join(s for s in (subtitle, "lines: mean over seeds, bands: their range" if several else "") if s)
    for k, line in enumerate(textwrap.wrap(subtitle, 170)[:2]):
        fig.text(0.5, 0.935 - 0.022 * k, line, ha="center", fontsize=8.5)
    handles = {}
    for i, (column, label) in enumerate(rows):
        for j, part in enumerate(parts):
            ax = fig.add_subplot(len(rows), len(parts), i * len(parts) + j + 1)
            for method in methods:
                curves = [c for c in (_series(r, column) for r in records
                                      if r.method == method and r.partition == part) if c]
                if not curves:
                    continue
                xs = sorted(set.intersection(*(set(c) for c in curves)))
                if not xs:
                    continue
                arr = np.array([[c[x] for x in xs] for c in curves])
                st = styles[method]
                (h,) = ax.plot(xs, arr.mean(0), color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                               markerfacecolor=st["markerfacecolor"], markersize=5, linewidth=1.3,
                               label=f"{method} (n={len(curves)})")
                if len(curves) > 1:
                    ax.fill_between(xs, arr.min(0), arr.max(0), color=st["color"], alpha=0.15, linewidth=0)
                handles[method] = h
            if i == 0:
                ax.set_title(part, fontsize=10)
            if j == 0:
                ax.set_ylabel(label, fontsize=9)
            if i == len(rows) - 1:
                ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), [h.get_label() for h in handles.values()], loc="lower center",
                   ncol=min(4, len(handles)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.91))
    return fig
