"""The one look of every figure flatfl draws, and the drawing of each plot kind that both the analysis commands
(``flatfl hessian``, ``hessian-clients``, ``surface``) and the report use. Matplotlib and numpy only (no torch, no
pyplot state: every figure is a standalone :class:`~matplotlib.figure.Figure`, safe headless).

* The style: :func:`new_figure`, :func:`context_title` ('digits-cnn, round 50, 512 train samples, Lanczos'),
  :func:`label_axes` (font sizes, grid), :func:`finish` (the figure title wrapped to the page, then a layout that
  keeps every text inside the figure), :func:`saved` (PNG / PDF bytes, a PDF without creation date).
* :func:`density_curves` / :func:`draw_density`: the SLQ spectral density as MAN Fig. 4b, every start of every run
  averaged, Gaussian-smoothed with a width ``sigma`` stated on the panel, on a log axis from ``FLOOR_FRACTION`` of
  the peak (nothing drawn below it), the negative eigenvalues shaded and their quadrature weight printed.
* :func:`draw_top_eigenvalues`: the top-k eigenvalues (mean over runs, the band their range) on a linear, log or
  (with negative values) symmetric-log axis, optionally with a log-scale inset so the tail under the top few shows.
"""
from __future__ import annotations

import io
import textwrap

import numpy as np

__all__ = ["new_figure", "saved", "context_title", "label_axes", "finish", "wrap_titles", "format_number", "density_curves",
           "draw_density", "draw_top_eigenvalues", "axis_floor", "COLORS", "MARKERS", "FLOOR_FRACTION", "SIGMA_FRACTION",
           "TITLE_SIZE", "PANEL_SIZE", "LABEL_SIZE", "TICK_SIZE", "NOTE_SIZE", "LEGEND_SIZE"]

DPI = 150
TITLE_SIZE = 10.5  # the figure's title (what model, round, data, method)
PANEL_SIZE = 9.5  # an axes' title
LABEL_SIZE = 9  # axis labels
TICK_SIZE = 8
LEGEND_SIZE = 8
NOTE_SIZE = 7.5  # notes printed inside an axes (smoothing width, weight below zero)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<")

FLOOR_FRACTION = 1e-4  # the density's log axis starts at this fraction of its peak
SIGMA_FRACTION = 0.01  # the density's Gaussian width: this fraction of the eigenvalue range


# ---------------------------------------------------------------------------------------------- the look
def new_figure(size=(6.0, 4.2)):
    """An empty figure of ``size`` inches with its own Agg canvas (renderer extents can be measured), laid out by
    matplotlib's constrained layout (titles, labels, colour bars and legends kept inside the figure)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def saved(fig, fmt: str) -> bytes:
    """``fig`` as ``fmt`` bytes; a PDF without its creation date, so the same result gives the same file."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, metadata={"CreationDate": None} if fmt == "pdf" else None)
    return buf.getvalue()


def format_number(v, digits: int = 4) -> str:
    """A number for a table or a figure: ``digits`` significant digits, '-' for a missing or non-finite value."""
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(v)
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.{max(1, digits - len(str(int(a))))}f}"
    return f"{v:.{digits}g}"


def context_title(model=None, round=None, samples=None, split=None, method=None) -> str:
    """'digits-cnn, round 50, 512 train samples, Lanczos': what a figure shows, each part only when known."""
    parts = [str(model)] if model else []
    if round is not None:
        parts.append(f"round {round}")
    if samples:
        parts.append(f"{samples} {split + ' ' if split else ''}samples")
    if method:
        parts.append(str(method))
    return ", ".join(parts)


def label_axes(ax, xlabel: str, ylabel: str, title: str | None = None, grid: bool = True) -> None:
    """Axis labels (with units where there are any), tick and title sizes and a light grid, the same everywhere."""
    ax.set_xlabel(xlabel, fontsize=LABEL_SIZE)
    ax.set_ylabel(ylabel, fontsize=LABEL_SIZE)
    ax.tick_params(labelsize=TICK_SIZE)
    if title is not None:
        ax.set_title(title, fontsize=PANEL_SIZE)
    if grid:
        ax.grid(alpha=0.3)


def wrap_to(fig, text: str, fontsize: float, fraction: float = 0.96) -> str:
    """``text`` broken into lines that fit ``fraction`` of the figure's width (measured with the renderer)."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    probe = Text(0, 0, "", fontsize=fontsize, figure=fig)
    limit = fraction * fig.bbox.width
    lines = []
    for paragraph in text.split("\n"):
        words, line = paragraph.split(" "), ""
        for w in words:
            trial = f"{line} {w}" if line else w
            probe.set_text(trial)
            if line and probe.get_window_extent(renderer).width > limit:
                lines.append(line)
                line = w
            else:
                line = trial
        lines.append(line)
    return "\n".join(lines)


def wrap_titles(fig) -> None:
    """Break every axes title (colour bars' aside) into lines no wider than its axes, measured with the renderer."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        t = ax.title
        if t.get_text() and ax.get_label() != "<colorbar>":
            width = max(ax.get_position().width * fig.bbox.width, 1.0)
            chars = max(20, int(len(t.get_text()) * width / max(t.get_window_extent(renderer).width, 1.0)))
            t.set_text("\n".join(textwrap.wrap(t.get_text(), chars)))


def finish(fig, title: str | None = None) -> None:
    """The figure's title (wrapped to its width), every axes title wrapped to its axes, then a layout that keeps every
    text inside the figure (the constrained layout of :func:`new_figure`)."""
    wrap_titles(fig)
    if title:
        fig.suptitle(wrap_to(fig, title, TITLE_SIZE), fontsize=TITLE_SIZE)
    if fig.get_layout_engine() is None:
        fig.set_layout_engine("constrained")
    fig.canvas.draw()


# ---------------------------------------------------------------------------------------------- spectral density
def density_curves(groups: dict[str, list[dict]], sigma_fraction: float = SIGMA_FRACTION, points: int = 2000):
    """Gaussian-smoothed spectral densities of each group (all SLQ starts of all its runs averaged: each a dict with
    ``nodes`` and ``weights``, one list per start) on one common grid; sigma = ``sigma_fraction`` of the pooled
    eigenvalue range. Returns (grid, {name: density}, sigma); each density integrates to 1."""
    pooled = {}
    for name, dens in groups.items():
        nodes = [np.asarray(t, float) for d in dens for t in d["nodes"]]
        weights = [np.asarray(w, float) for d in dens for w in d["weights"]]
        if nodes:
            pooled[name] = (nodes, weights)
    if not pooled:
        return None, {}, None
    lo = min(t.min() for nodes, _ in pooled.values() for t in nodes)
    hi = max(t.max() for nodes, _ in pooled.values() for t in nodes)
    sigma = sigma_fraction * max(hi - lo, 1e-12)
    grid = np.linspace(lo - 3 * sigma, hi + 3 * sigma, points)
    curves = {}
    for name, (nodes, weights) in pooled.items():
        dens = np.zeros(points)
        for t, w in zip(nodes, weights):
            dens += np.exp(-((grid[:, None] - t[None, :]) ** 2) / (2 * sigma * sigma)) @ w
        dens /= len(nodes) * sigma * np.sqrt(2 * np.pi)
        curves[name] = dens
    return grid, curves, sigma


def negative_weight(dens: list[dict], below: float = 0.0) -> tuple[float, float]:
    """(mean quadrature weight on nodes < ``below``, smallest node) over every start of ``dens``: the SLQ estimate of
    the fraction of eigenvalues below ``below``, and how far below zero the spectrum reaches."""
    weights = [float(np.sum(np.asarray(w, float)[np.asarray(t, float) < below])) for d in dens
               for t, w in zip(d["nodes"], d["weights"])]
    smallest = min(float(np.min(t)) for d in dens for t in d["nodes"])
    return (float(np.mean(weights)) if weights else 0.0), smallest


def axis_floor(peak: float, sigma: float, dims, floor_fraction: float = FLOOR_FRACTION) -> tuple[float, float | None]:
    """(the fraction of the peak the log axis starts at, the height of one eigenvalue). A density of d eigenvalues
    gives a single isolated eigenvalue the height 1 / (d sigma sqrt(2 pi)); the axis starts at ``floor_fraction`` of
    the peak, or lower (a power of ten) where a tenth of that height is lower, so an outlying eigenvalue shows. The
    height is None where the dimension is not recorded."""
    dims = [int(d) for d in dims if isinstance(d, (int, np.integer)) and d > 0]
    if not dims:
        return floor_fraction, None
    single = 1.0 / (max(dims) * sigma * np.sqrt(2 * np.pi))
    fraction = min(floor_fraction, 10.0 ** np.floor(np.log10(0.1 * single / peak)))
    return float(fraction), float(single)


def draw_density(ax, groups: dict[str, list[dict]], labels: dict[str, str] | None = None,
                 styles: dict[str, dict] | None = None, panel: str = "", marks=None, marks_label: str = "",
                 curvature: str = "Hessian"):
    """Draw the densities of ``groups`` (name -> SLQ results, see :func:`density_curves`; a result's ``dim`` is the
    number of eigenvalues) on ``ax``: a log axis from a stated fraction of the peak (:func:`axis_floor`; nothing
    drawn below it) with the height of one eigenvalue marked, the Gaussian width in the panel title, the region
    below zero shaded and each group's weight below -sigma noted; ``marks`` (eigenvalues computed exactly, e.g. the
    top k) are ticked along the bottom, ``marks_label`` naming them; ``curvature`` names the matrix on the axis
    ('Hessian', 'GGN', 'empirical Fisher'). Returns (grid, curves, sigma, fraction)
    (``curves`` empty: no density, and the panel says so)."""
    grid, curves, sigma = density_curves(groups)
    if not curves:
        label_axes(ax, f"{curvature} eigenvalue λ", "density (log scale)")
        ax.text(0.5, 0.5, "no spectral density computed", ha="center", transform=ax.transAxes)
        ax.set_title(f"{panel}spectral density (SLQ)", fontsize=PANEL_SIZE)
        return grid, curves, sigma, None
    peak = max(c.max() for c in curves.values())
    fraction, single = axis_floor(peak, sigma, [d.get("dim") for dens in groups.values() for d in dens])
    floor = fraction * peak
    notes = []
    for k, (name, curve) in enumerate(curves.items()):
        style = (styles or {}).get(name) or {"color": COLORS[k % len(COLORS)], "linestyle": "-"}
        starts = sum(len(d["nodes"]) for d in groups[name])
        shown = np.where(curve >= floor, curve, np.nan)  # below the axis: not drawn (no floor line)
        label = (labels or {}).get(name, name)
        ax.semilogy(grid, shown, color=style["color"], linestyle=style.get("linestyle", "-"), linewidth=1.2,
                    label=f"{label}{', ' if label else ''}{starts} SLQ start{'s' if starts != 1 else ''}")
        share, smallest = negative_weight(groups[name], -sigma)
        notes.append(f"{label + ': ' if len(curves) > 1 else ''}weight on λ < −σ: {share:.2%}, "
                     f"smallest node {format_number(smallest, 3)}")
    if single is not None:
        dims = sorted({int(d["dim"]) for dens in groups.values() for d in dens})
        ax.axhline(single, color="0.35", linewidth=0.8, linestyle=":",
                   label=f"height of one eigenvalue of {', '.join(f'{d:,}' for d in dims)}")
    if marks is not None and len(marks):
        ax.vlines(np.asarray(marks, float), 0, 0.035, transform=ax.get_xaxis_transform(), color="k", linewidth=0.6,
                  label=marks_label or "computed eigenvalues")
    ax.set_ylim(floor, 3 * peak)
    ax.set_xlim(grid[0], grid[-1])
    if grid[0] < 0:
        ax.axvspan(grid[0], 0, color="0.88", zorder=0, linewidth=0, label="λ < 0")
    ax.text(0.98, 0.97, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=NOTE_SIZE,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.7", "alpha": 0.9})
    ax.legend(fontsize=LEGEND_SIZE, loc="center right")
    label_axes(ax, f"{curvature} eigenvalue λ (of the mean training loss)",
               f"density (log scale, from {fraction:.0e} × peak)")
    total = sum(len(d["nodes"]) for dens in groups.values() for d in dens)
    ax.set_title(f"{panel}spectral density (SLQ, {'1 start' if total == 1 else 'starts averaged'}), Gaussian σ = {format_number(sigma, 3)} "
                 f"({SIGMA_FRACTION:.0%} of the range)", fontsize=PANEL_SIZE)
    return grid, curves, sigma, fraction


# ---------------------------------------------------------------------------------------------- top-k eigenvalues
def eigen_scale(ax, values: np.ndarray) -> str:
    """A log axis for positive eigenvalues; with zero or negative ones a symmetric log axis, linear from the
    smallest positive magnitude down through zero (the negative values stay below the zero line). Returns the
    scale's name."""
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() > 0:
        ax.set_yscale("log")
        return "log"
    big = float(np.max(np.abs(finite))) if finite.size else 1.0
    small = np.abs(finite[finite != 0])
    linthresh = max(float(small.min()) if small.size else big, 1e-6 * big, 1e-300)
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.axhline(0, color="0.45", linewidth=0.7)
    return "symlog"


def draw_top_eigenvalues(ax, series: dict[str, list], *, scale: str = "linear", styles: dict[str, dict] | None = None,
                         inset: bool = False, panel: str = "", curvature: str = "Hessian") -> None:
    """The top-k eigenvalues of each of ``series`` (name -> one list per run, largest first): the mean over runs,
    their range as a band; ``scale`` 'linear' or 'log' (symmetric log when a value is <= 0, the negative ones below
    the zero line); ``inset`` adds a log-scale copy in the upper right so the tail under the top few shows;
    ``curvature`` names the matrix on the axis."""
    from matplotlib.ticker import MaxNLocator

    drawn = []
    for k, (name, runs) in enumerate(series.items()):
        runs = [list(r) for r in runs if len(r) >= 2]
        if runs:
            n = min(len(r) for r in runs)
            drawn.append((k, name, np.array([r[:n] for r in runs], dtype=float)))

    def plot(target, log: bool, labelled: bool) -> None:
        for k, name, arr in drawn:
            style = (styles or {}).get(name) or {"color": COLORS[k % len(COLORS)], "marker": MARKERS[k % len(MARKERS)],
                                                 "linestyle": "-"}
            n = arr.shape[1]
            idx = np.arange(1, n + 1)
            label = name if len(arr) == 1 else f"{name} (mean of {len(arr)} runs, band: their range)"
            target.plot(idx, arr.mean(0), color=style["color"], linestyle=style.get("linestyle", "-"),
                        marker=style.get("marker", "o"), markevery=max(1, n // 12), markersize=3.5, linewidth=1.3,
                        markerfacecolor=style.get("markerfacecolor", style["color"]), label=label if labelled else None)
            if len(arr) > 1:
                target.fill_between(idx, arr.min(0), arr.max(0), color=style["color"], alpha=0.15, linewidth=0)
        if log and drawn:
            eigen_scale(target, np.concatenate([a.ravel() for _, _, a in drawn]))
        target.xaxis.set_major_locator(MaxNLocator(integer=True))

    plot(ax, scale == "log", True)
    if inset and drawn:
        small = ax.inset_axes((0.42, 0.4, 0.55, 0.52))
        small.tick_params(labelsize=TICK_SIZE - 1)
        small.grid(alpha=0.3)
        plot(small, True, False)
        small.set_title("symmetric log scale" if small.get_yscale() == "symlog" else "log scale", fontsize=NOTE_SIZE,
                        pad=2)
    kind = {"linear": "", "log": ", log scale"}[scale]
    if ax.get_yscale() == "symlog":
        kind = ", symmetric log scale (linear near 0)"
    label_axes(ax, "eigenvalue index (largest first)", f"{curvature} eigenvalue λ")
    if not drawn:
        ax.text(0.5, 0.5, "fewer than 2 eigenvalues computed", ha="center", transform=ax.transAxes)
    elif len(series) > 1:
        ax.legend(fontsize=LEGEND_SIZE, loc="lower left" if inset or scale == "log" else "upper right")
    ks = sorted({a.shape[1] for _, _, a in drawn})
    ax.set_title(f"{panel}top {'/'.join(map(str, ks)) or '-'} eigenvalues{kind}", fontsize=PANEL_SIZE)
