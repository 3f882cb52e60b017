"""Report figures, each a standalone :class:`matplotlib.figure.Figure` (no pyplot state, safe headless).

* :func:`text_page`: a page of headed paragraphs (title page, summaries, what is missing).
* :func:`table_page`: a table drawn with ``ax.table``, with a subtitle and notes.
* :func:`spectrum_pair_page`: MAN Fig. 4 for one "X vs X+regularizer" pair: (a) the top-k eigenvalues of both
  models overlaid, (b) their eigenvalue spectral densities (SLQ, Gaussian-smoothed, log axis) overlaid.
* :func:`accuracy_page`: test accuracy against rounds, one panel per partition, one line per run.
* :func:`surface_page`: loss-surface contours of up to six runs (``surface/surface.npz``).
"""
from __future__ import annotations

import textwrap

import numpy as np
from matplotlib.figure import Figure

__all__ = ["text_page", "table_page", "spectrum_pair_page", "accuracy_page", "surface_page", "PAGE_SIZE"]

PAGE_SIZE = (11.69, 8.27)  # A4 landscape, inches
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


def text_page(title: str, sections: list[tuple[str, list[str]]], footer: str = "") -> Figure:
    """A page of text: ``sections`` are (heading, lines); long lines are wrapped."""
    fig = Figure(figsize=PAGE_SIZE)
    fig.text(0.05, 0.95, title, fontsize=16, weight="bold", va="top")
    y = 0.88
    for heading, lines in sections:
        if y < 0.08:
            break
        if heading:
            fig.text(0.05, y, heading, fontsize=11.5, weight="bold", va="top")
            y -= 0.035
        for line in lines:
            for part in textwrap.wrap(line, 150, subsequent_indent="    ") or [""]:
                if y < 0.06:
                    fig.text(0.06, y, "... (continued in the CSV files)", fontsize=8.5, va="top", style="italic")
                    y -= 1
                    break
                fig.text(0.06, y, part, fontsize=8.5, va="top", family="monospace")
                y -= 0.024
            if y < 0.06:
                break
        y -= 0.015
    if footer:
        fig.text(0.05, 0.02, footer, fontsize=7.5, color="0.4")
    return fig


def _fmt(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    if isinstance(v, (int, np.integer)):
        return str(v)
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.{max(1, digits - len(str(int(a))))}f}"
    return f"{v:.{digits}g}"


def table_page(title: str, header: list[str], rows: list[list], *, subtitle: list[str] | None = None,
               notes: list[str] | None = None, highlight: list[list[str | None]] | None = None,
               col_widths: list[float] | None = None) -> Figure:
    """A table page. ``rows`` hold numbers or strings; ``highlight[i][j]`` an optional cell colour."""
    fig = Figure(figsize=PAGE_SIZE)
    fig.text(0.04, 0.96, title, fontsize=14, weight="bold", va="top")
    y = 0.915
    for line in subtitle or []:
        fig.text(0.04, y, line, fontsize=9, va="top")
        y -= 0.028
    note_lines = []
    for n in notes or []:
        note_lines += textwrap.wrap(n, 170, subsequent_indent="   ")
    bottom = 0.04 + 0.022 * len(note_lines)
    ax = fig.add_axes((0.03, bottom + 0.01, 0.94, max(0.1, y - bottom - 0.02)))
    ax.axis("off")
    cells = [[_fmt(v) if not isinstance(v, str) else v for v in row] for row in rows]
    if not cells:
        cells = [["(no runs)"] + [""] * (len(header) - 1)]
    table = ax.table(cellText=cells, colLabels=header, loc="upper center", cellLoc="center",
                     colWidths=col_widths)
    table.auto_set_font_size(False)
    size = 8.5 if len(header) <= 9 else 7.5 if len(header) <= 12 else 6.5
    table.set_fontsize(size)
    n_rows = len(cells) + 1
    table.scale(1.0, min(1.6, max(0.9, 22.0 / n_rows)))
    tall_header = any("\n" in h for h in header)
    for (i, j), cell in table.get_celld().items():
        cell.set_linewidth(0.4)
        if i == 0:
            cell.set_facecolor("#e8e8e8")
            cell.set_text_props(weight="bold")
            if tall_header:
                cell.set_height(cell.get_height() * 2.0)
        elif highlight is not None and i - 1 < len(highlight) and j < len(highlight[i - 1]) and highlight[i - 1][j]:
            cell.set_facecolor(highlight[i - 1][j])
    for k, line in enumerate(note_lines):
        fig.text(0.04, bottom - 0.022 * k - 0.005, line, fontsize=7.5, va="top", color="0.25")
    return fig


def _label(rec) -> str:
    return f"{rec.method} (seed {rec.seed})"


def _spectrum_source(rec) -> dict:
    """The analysis with the most eigenvalues or a density: spectrum/hessian.json when computed, else hessian/."""
    return rec.spectrum or rec.hessian or {}


def spectrum_pair_page(ref, cmp_, title: str) -> Figure:
    """MAN Fig. 4 for one pair of runs: top-k eigenvalues and spectral densities of both models overlaid."""
    from ..analysis.density import smoothed_density

    fig = Figure(figsize=PAGE_SIZE)
    fig.suptitle(title, fontsize=13, weight="bold")
    ax1 = fig.add_subplot(1, 2, 1)
    ax2 = fig.add_subplot(1, 2, 2)
    any_density = False
    for rec, color in ((ref, COLORS[0]), (cmp_, COLORS[1])):
        h = _spectrum_source(rec)
        values = h.get("top_eigenvalues") or []
        if len(values) >= 2:
            ax1.plot(np.arange(1, len(values) + 1), values, color=color, linewidth=1.3, label=_label(rec))
        dens = h.get("density")
        if dens and dens.get("nodes"):
            grid, curve = smoothed_density(dens["nodes"], dens["weights"])
            ax2.semilogy(grid, curve + 1e-7, color=color, linewidth=1.0, label=_label(rec))
            any_density = True
    ax1.set_xlabel("index")
    ax1.set_ylabel("eigenvalue")
    ks = sorted({len(_spectrum_source(r).get("top_eigenvalues") or []) for r in (ref, cmp_)})
    ax1.set_title(f"(a) top {'/'.join(map(str, ks))} Hessian eigenvalues", fontsize=10)
    ax1.grid(alpha=0.3)
    if ax1.lines:
        ax1.legend(fontsize=8)
    else:
        ax1.text(0.5, 0.5, "fewer than 2 eigenvalues computed", ha="center", transform=ax1.transAxes)
    ax2.set_xlabel("eigenvalue")
    ax2.set_ylabel("density (log scale)")
    ax2.set_title("(b) eigenvalue spectral density (SLQ)", fontsize=10)
    if any_density:
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no spectral density computed", ha="center", transform=ax2.transAxes)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def accuracy_page(title: str, groups: dict[str, list], column: str, subtitle: str = "") -> Figure:
    """Accuracy (``column`` of metrics.csv, in %) against rounds; one panel per group (partition)."""
    fig = Figure(figsize=PAGE_SIZE)
    fig.suptitle(title, fontsize=13, weight="bold")
    if subtitle:
        fig.text(0.5, 0.915, subtitle, ha="center", fontsize=9)
    n = max(1, len(groups))
    for k, (group, records) in enumerate(sorted(groups.items())):
        ax = fig.add_subplot(1, n, k + 1)
        bases = list(dict.fromkeys(r.method.split("+")[0] for r in records))  # X and X+reg share a colour
        for rec in sorted(records, key=lambda r: (bases.index(r.method.split("+")[0]), r.method, r.seed)):
            xs = [row["round"] for row in rec.curve if row.get(column) is not None]
            ys = [100 * row[column] for row in rec.curve if row.get(column) is not None]
            if not xs:
                continue
            color = COLORS[bases.index(rec.method.split("+")[0]) % len(COLORS)]
            style = "--" if "+" in rec.method else "-"  # dashed: with the regularizer
            ax.plot(xs, ys, style, color=color, linewidth=1.1, label=_label(rec))
        ax.set_title(group, fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def surface_page(title: str, records: list) -> Figure:
    """Filled loss contours of up to six runs that have ``surface/surface.npz`` (unfilled points left blank)."""
    fig = Figure(figsize=PAGE_SIZE)
    fig.suptitle(title, fontsize=13, weight="bold")
    shown = records[:6]
    cols = min(3, len(shown)) or 1
    rows = (len(shown) + cols - 1) // cols or 1
    for k, rec in enumerate(shown):
        ax = fig.add_subplot(rows, cols, k + 1)
        with np.load(rec.surface_path, allow_pickle=False) as z:
            xs, ys, loss = z["x"], z["y"], np.where(z["done"], z["loss"], np.nan)
        finite = loss[np.isfinite(loss)]
        if finite.size >= 4 and np.ptp(finite) > 0:
            levels = np.linspace(finite.min(), np.quantile(finite, 0.98), 20)
            cs = ax.contourf(xs, ys, np.clip(loss, None, levels[-1]), levels=levels, cmap="viridis")
            fig.colorbar(cs, ax=ax, fraction=0.046)
        ax.plot([0], [0], "r+", markersize=8)
        ax.set_title(f"{rec.method}, {rec.partition}", fontsize=9)
        ax.set_aspect("equal")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig
