"""Report figures, each a standalone :class:`matplotlib.figure.Figure` (no pyplot state, safe headless).

* :func:`text_page`: a page of headed paragraphs (title page, summaries, what is missing).
* :func:`table_page`: a table drawn with ``ax.table``, with a subtitle and notes.
* :func:`spectrum_pair_page`: MAN Fig. 4 for one "X vs X+regularizer" pair: (a) the top-k eigenvalues of both
  models overlaid, (b) their eigenvalue spectral densities (SLQ, Gaussian-smoothed, log axis) overlaid.
* :func:`accuracy_page`: test accuracy against rounds, one panel per partition, one line per run.
* :func:`surface_page`: loss-surface contours of up to eight runs on one colour scale (``surface.npz``).
"""
from __future__ import annotations

import textwrap

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..analysis.operators.names import CURVATURE_TITLES
from ..utils.plots import COLORS, MARKERS, draw_density, draw_top_eigenvalues, format_number, wrap_titles
from .display import shown, shown_lines

__all__ = ["text_page", "table_page", "spectrum_pair_page", "accuracy_page", "surface_page", "PAGE_SIZE"]

PAGE_SIZE = (11.69, 8.27)  # A4 landscape, inches


def _canvas(fig: Figure) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return fig


def text_page(title: str, sections: list[tuple[str, list[str]]], footer: str = "") -> Figure:
    """A page of text: ``sections`` are (heading, lines); long lines are wrapped to the page."""
    fig = _canvas(Figure(figsize=PAGE_SIZE))
    title = shown(title, 2 * 95)
    for k, part in enumerate(textwrap.wrap(title, 95)[:2]):
        fig.text(0.05, 0.95 - 0.04 * k, part, fontsize=16, weight="bold", va="top")
    y = 0.88 - (0.04 if len(title) > 95 else 0)
    for heading, lines in sections:
        if y < 0.08:
            break
        if heading:
            fig.text(0.05, y, shown(heading), fontsize=11.5, weight="bold", va="top")
            y -= 0.035
        for line in lines:
            for part in textwrap.wrap(shown(line, 40 * 150), 150, subsequent_indent="    ") or [""]:
                if y < 0.06:
                    fig.text(0.06, y, "... (continued in report.md and the CSV files)", fontsize=8.5, va="top",
                             style="italic")
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


def _wrapped(lines: list[str], width: int) -> list[str]:
    out = []
    for n in lines:
        out += textwrap.wrap(shown(n, 25 * width), width, subsequent_indent="   ") or [""]  # a page holds fewer
    return out


def table_page(title: str, header: list[str], rows: list[list], *, subtitle: list[str] | None = None,
               notes: list[str] | None = None, highlight: list[list[str | None]] | None = None,
               col_widths: list[float] | None = None, findings: list[str] | None = None) -> Figure:
    """A table page. ``rows`` hold numbers or strings ('\\n' breaks a cell's line); ``highlight[i][j]`` an optional
    cell colour; ``findings`` and ``notes`` are printed under the table. The font size and row heights are chosen
    so that every cell's text stays inside its cell (measured with the renderer)."""
    fig = _canvas(Figure(figsize=PAGE_SIZE))
    fig.text(0.03, 0.965, shown(title), fontsize=13, weight="bold", va="top")
    y = 0.925
    for line in _wrapped(subtitle or [], 175):
        fig.text(0.03, y, line, fontsize=8.5, va="top")
        y -= 0.024
    below = []
    if findings:
        below += [("Findings", True)] + [(x, False) for x in _wrapped([f"• {f}" for f in findings], 190)]
    if notes:
        below += [("Notes", True)] + [(x, False) for x in _wrapped(notes, 190)]
    line_h = 0.019
    below = below[:max(0, int(0.45 / line_h))]
    bottom = 0.03 + line_h * len(below)
    ax = fig.add_axes((0.03, bottom + 0.01, 0.94, max(0.12, y - bottom - 0.02)))
    ax.axis("off")
    header = shown_lines(header)
    cells = [[format_number(v) if not isinstance(v, str) else shown(v) for v in row] for row in rows]
    if not cells:
        cells = [["(no runs)"] + [""] * (len(header) - 1)]
    renderer = fig.canvas.get_renderer()
    if col_widths is None:  # proportional to the widest line of each column
        from matplotlib.text import Text

        probe = Text(0, 0, "", fontsize=8, figure=fig)
        widths = []
        for j in range(len(header)):
            w = 0.0
            for i, text in enumerate([header[j]] + [r[j] for r in cells]):
                probe.set_weight("bold" if i == 0 else "normal")  # the header is drawn bold
                for part in str(text).split("\n"):
                    probe.set_text(part)
                    w = max(w, probe.get_window_extent(renderer).width)
            widths.append(w + 12)
        total = sum(widths)
        col_widths = [w / total for w in widths]
    table = ax.table(cellText=cells, colLabels=header, loc="upper center", cellLoc="center", colWidths=col_widths)
    table.auto_set_font_size(False)
    lines = [max(str(c).count("\n") + 1 for c in row) for row in [header] + cells]
    ax_h = ax.bbox.height
    celld = table.get_celld()
    for (i, j), cell in celld.items():
        if i == 0:
            cell.set_text_props(weight="bold")  # before fitting: bold text is wider
    for size in (9.0, 8.5, 8.0, 7.5, 7.0, 6.5, 6.0, 5.5, 5.0, 4.5):
        line_px = size * 1.25 * fig.dpi / 72
        pad_px = size * 0.7 * fig.dpi / 72
        heights = [(n * line_px + pad_px) / ax_h for n in lines]
        if sum(heights) > 1.0 and size > 4.5:
            continue
        table.set_fontsize(size)
        for (i, j), cell in celld.items():
            cell.set_height(heights[i])
        # a cell is as wide as its column's share of the axes (colWidths, fixed): its text is measured without
        # drawing the page
        fits = all(cell.get_text().get_window_extent(renderer).width + 3 <= cell.get_width() * ax.bbox.width
                   for cell in celld.values() if cell.get_text().get_text())
        if fits:
            break
    for (i, j), cell in celld.items():
        cell.set_linewidth(0.4)
        if i == 0:
            cell.set_facecolor("#e8e8e8")
        elif highlight is not None and i - 1 < len(highlight) and j < len(highlight[i - 1]) and highlight[i - 1][j]:
            cell.set_facecolor(highlight[i - 1][j])
    # the findings and notes start right under the table (no empty band between them)
    table_bottom = ax.get_position().y1 - sum(cell.get_height() for (i, j), cell in celld.items() if j == 0) \
        * ax.get_position().height
    top = max(bottom, min(table_bottom - 0.025, bottom + 0.5))
    for k, (line, head) in enumerate(below):
        fig.text(0.03, top - line_h * k - 0.002, line, fontsize=8 if head else 7.5, va="top",
                 weight="bold" if head else "normal", color="0.1" if head else "0.25")
    return fig


def spectrum_source(rec) -> dict:
    """The analysis for the Fig. 4 pages: of the table's Hessian and the spectrum folder's, the one with a density
    and the most eigenvalues (the spectrum folder on a tie)."""
    have = [h for h in (rec.spectrum, rec.hessian) if h]
    if not have:
        return {}
    return max(have, key=lambda h: (bool((h.get("density") or {}).get("nodes")), len(h.get("top_eigenvalues") or [])))


# one (colour, marker) per method, dashed lines for "+regularizer"

def _style(k: int, method: str) -> dict:
    return {"color": COLORS[k % len(COLORS)], "marker": MARKERS[k % len(MARKERS)],
            "linestyle": "--" if "+" in method else "-"}


PAIRED_SUFFIXES = ("+MAN", "+ASD")  # regularizers added to a method: drawn in the method's colour, dashed
LINESTYLES = ("-", "--", "-.", ":")


def line_styles(methods: list[str]) -> dict[str, dict]:
    """A style per method that tells every line apart by colour, marker and dash. A method's "+MAN" (or "+ASD")
    variant takes the method's colour and marker, dashed with a hollow marker, the method itself solid; without
    such pairs every method has its own colour, marker and dash pattern from the cycles."""
    def base_of(m):
        return next((m[: -len(sfx)] for sfx in PAIRED_SUFFIXES if m.endswith(sfx) and m[: -len(sfx)] in methods),
                    None)

    paired = any(base_of(m) for m in methods)
    out: dict[str, dict] = {}
    for m in methods:
        if base_of(m) is None:
            k = len(out)
            out[m] = {"color": COLORS[k % len(COLORS)], "marker": MARKERS[k % len(MARKERS)],
                      "linestyle": "-" if paired else LINESTYLES[k % len(LINESTYLES)],
                      "markerfacecolor": COLORS[k % len(COLORS)]}
    for m in methods:
        if base_of(m) is not None:
            out[m] = dict(out[base_of(m)], linestyle="--", markerfacecolor="white")
    return out


def spectrum_pair_page(ref, cmp_, title: str) -> Figure:
    """MAN Fig. 4 for one "X vs X+regularizer" pair, each side one run or a list of seeds: (a) the top-k eigenvalues
    (mean over seeds, the band their range), (b) the spectral densities, every SLQ start of every seed averaged,
    Gaussian-smoothed with a stated width, on a log axis that starts at 1e-4 of the peak."""
    ref = ref if isinstance(ref, (list, tuple)) else [ref]
    cmp_ = cmp_ if isinstance(cmp_, (list, tuple)) else [cmp_]
    fig = _canvas(Figure(figsize=PAGE_SIZE))
    fig.suptitle(title, fontsize=12, weight="bold", y=0.975)
    ax1 = fig.add_subplot(1, 2, 1)
    ax2 = fig.add_subplot(1, 2, 2)
    series, styles, dens_groups, labels = {}, {}, {}, {}
    for k, recs in enumerate((ref, cmp_)):
        method = recs[0].method
        tops = [list(spectrum_source(r).get("top_eigenvalues") or []) for r in recs]
        shown = sum(1 for r in recs if len(spectrum_source(r).get("top_eigenvalues") or []) >= 2
                    or (spectrum_source(r).get("density") or {}).get("nodes"))  # seeds that have a spectrum
        labels[method] = f"{method} ({shown} seed{'s' if shown != 1 else ''})"
        named = labels[method] if len([t for t in tops if len(t) >= 2]) <= 1 else method
        series[named] = tops
        styles[named] = styles[method] = _style(k, method)
        dens = [d for d in (spectrum_source(r).get("density") for r in recs) if d and d.get("nodes")]
        if dens:
            dens_groups[method] = dens
    # the matrix the spectra are of (hessian.json's curvature; files written before it was recorded: the Hessian)
    kinds = {spectrum_source(r).get("curvature") or "hessian" for r in [*ref, *cmp_] if spectrum_source(r)}
    curvature = CURVATURE_TITLES.get(next(iter(kinds)), "Hessian") if len(kinds) == 1 else "curvature"
    draw_top_eigenvalues(ax1, series, styles=styles, inset=True, panel="(a) ", curvature=curvature)
    ax1.set_title(ax1.get_title() + " (MAN Fig. 4a; the paper: top 200)", fontsize=ax1.title.get_fontsize())
    draw_density(ax2, dens_groups, labels=labels, styles=styles, panel="(b) ", curvature=curvature)
    wrap_titles(fig)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def accuracy_page(title: str, groups: dict[str, list], column: str, subtitle: str = "",
                  ylabel: str = "test accuracy (%)", order: list[str] | tuple = ()) -> Figure:
    """Accuracy (``column`` of metrics.csv, in %) against rounds; one panel per group (partition), one line per
    method (the mean over its seeds, the band their range when at most four methods share a panel), each method its
    own colour, marker and dash (:func:`line_styles`); methods in ``order`` first, in that order."""
    fig = _canvas(Figure(figsize=PAGE_SIZE))
    fig.suptitle(title, fontsize=12, weight="bold", y=0.975)
    several = any(len([r for r in recs if r.method == m]) > 1 for recs in groups.values()
                  for m in {r.method for r in recs})
    if several:
        many = len({r.method for recs in groups.values() for r in recs}) > 4
        subtitle = (subtitle + "; " if subtitle else "") + ("lines: mean over seeds" + (
            " (their spread is in the tables)" if many else ", bands: their range"))
    if subtitle:
        for k, part in enumerate(textwrap.wrap(shown(subtitle, 2 * 170), 170)[:2]):
            fig.text(0.5, 0.935 - 0.022 * k, part, ha="center", fontsize=8.5)
    n = max(1, len(groups))
    methods = list(dict.fromkeys(r.method for recs in groups.values() for r in recs))
    seen = list(methods)
    methods.sort(key=lambda m: (list(order).index(m) if m in order else len(order), seen.index(m)))
    styles = line_styles(methods)
    bands = len(methods) <= 4  # more overlapping bands hide the lines: then the spread is in the tables only
    handles = {}
    for k, (group, records) in enumerate(sorted(groups.items())):
        ax = fig.add_subplot(1, n, k + 1)
        for mi, method in enumerate(methods):
            curves = []
            for rec in (r for r in records if r.method == method):
                pts = {row["round"]: 100 * row[column] for row in rec.curve if row.get(column) is not None}
                if pts:
                    curves.append(pts)
            if not curves:
                continue
            xs = sorted(set.intersection(*(set(c) for c in curves)))
            arr = np.array([[c[x] for x in xs] for c in curves])
            st = styles[method]
            (line,) = ax.plot(xs, arr.mean(0), color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                              markerfacecolor=st["markerfacecolor"], markevery=max(1, len(xs) // 8), markersize=5,
                              linewidth=1.3, label=f"{method} (n={len(curves)})")
            if len(curves) > 1 and bands:
                ax.fill_between(xs, arr.min(0), arr.max(0), color=st["color"], alpha=0.12, linewidth=0)
            handles[method] = line
        ax.set_title(group, fontsize=10)
        rounds = sorted({row["round"] for r in records for row in r.curve if row.get(column) is not None})
        if 0 < len(rounds) <= 12:  # few evaluations: a tick at each, and room around a single one
            ax.set_xticks(rounds)
            ax.set_xlim(rounds[0] - 0.5, rounds[-1] + 0.5)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), [h.get_label() for h in handles.values()], loc="lower center",
                   ncol=min(4, len(handles)), fontsize=8, frameon=False)
    rows = (len(handles) + 3) // 4
    fig.tight_layout(rect=(0, 0.03 + 0.03 * rows, 1, 0.91))
    return fig


def surface_page(title: str, records: list) -> Figure:
    """Filled loss contours of up to eight runs that have ``surface/surface.npz`` on one shared colour scale (unfilled
    points left blank), with the directions named on the axes."""
    from pathlib import Path

    from ..analysis.commands.result_files import ResultFileError, read_surface_file

    fig = _canvas(Figure(figsize=PAGE_SIZE))
    fig.suptitle(title, fontsize=12, weight="bold", y=0.975)
    shown = records[:8]
    cols = min(4, len(shown)) or 1
    rows = (len(shown) + cols - 1) // cols or 1
    data = []
    for rec in shown:
        with np.load(rec.surface_path, allow_pickle=False) as z:
            data.append((z["x"], z["y"], np.where(z["done"], z["loss"], np.nan)))
    finite = np.concatenate([d[2][np.isfinite(d[2])].ravel() for d in data]) if data else np.array([])
    levels = None
    if finite.size >= 4 and np.ptp(finite) > 0:
        levels = np.linspace(finite.min(), np.quantile(finite, 0.98), 20)
    axes, cs = [], None
    for k, (rec, (xs, ys, loss)) in enumerate(zip(shown, data)):
        ax = fig.add_subplot(rows, cols, k + 1)
        axes.append(ax)
        if levels is not None:
            cs = ax.contourf(xs, ys, np.clip(loss, None, levels[-1]), levels=levels, cmap="viridis")
        ax.plot([0], [0], "r+", markersize=8)
        try:  # a damaged surface.json only loses the axis names
            info = (read_surface_file(Path(rec.surface_path).with_name("surface.json")) or {}).get("settings") or {}
        except ResultFileError:
            info = {}
        kind = {"hessian": "Hessian eigenvector"}.get(info.get("directions"), "random direction")
        ax.set_xlabel(f"step along {kind} 1", fontsize=8)
        ax.set_ylabel(f"step along {kind} 2", fontsize=8)
        ax.tick_params(labelsize=7)
        where = f", {rec.partition}" if len({r.partition for r in shown}) > 1 else ""
        ax.set_title(f"{rec.method}{where}, seed {rec.seed}", fontsize=9)
        ax.set_aspect("equal")
    fig.tight_layout(rect=(0, 0, 0.9, 0.94))
    if cs is not None:
        cax = fig.add_axes((0.92, 0.12, 0.015, 0.75))
        cb = fig.colorbar(cs, cax=cax)
        cb.set_label("training loss (shared scale, clipped at the 98th percentile)", fontsize=8)
        cb.ax.tick_params(labelsize=7)
    return fig
