"""The curvature-against-rounds page of a report: runs trained with ``flatfl train --track-hessian K``.

:func:`curvature_page` draws, for a few methods (a method and its "+MAN" variant on one axis), the top Hessian
eigenvalue, the trace, each measured quantity a run tracked (``--track-measure``: config.json's tracking ``measure``,
metrics.csv's ``hessian_<name>``) and the loss on the fixed evaluation sample against the round (metrics.csv's
``hessian_*`` columns); one column of panels per partition, one line per method: the mean over its seeds, the band
their range. The styles are :func:`flatfl.report.figure_pages.line_styles` (a method solid, its "+MAN" variant
dashed, same colour).

The trace and a measured quantity are estimates with a standard error (metrics.csv's ``hessian_trace_se``,
``hessian_<name>_se``): every point carries its interval (+-2 standard errors; with several seeds the
root-mean-square of theirs over the square root of their number, the standard error of the mean), drawn as error
bars (none where a quantity states no standard error), and a trace point whose standard error misses the run's
target (``hessian_trace_target``, ``se > target * |trace|``: ``hessian_status`` ``unresolved``) is circled (a
large open ring around it), so a reader sees which values are not known to the target.
"""
from __future__ import annotations

import textwrap

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .display import shown
from .figure_pages import PAGE_SIZE, line_styles

#: the interval drawn around a tracked trace: this many standard errors either side
TRACE_INTERVAL_SE = 2.0

__all__ = ["SERIES", "has_curvature", "curvature_page", "quantity_series"]

# (metrics.csv column, axis label)
SERIES = (("hessian_top", "top Hessian eigenvalue"), ("hessian_trace", "Hessian trace"),
          ("hessian_loss", "training loss (evaluation sample)"))


#: the columns of every tracking (a quantity's are read only from the runs that tracked it)
FIXED_COLUMNS = {col for col, _ in SERIES}

def _tracked_names(rec) -> list[str]:
    """The measured quantities a run tracked (config.json's tracking ``measure``, names separated by commas), those a
    tracking can write only: a name whose column is tracking's own, or another quantity's standard error, is not one."""
    from ..analysis.commands.tracking import own_column, quantity_columns
    from ..analysis.estimators.quantities import QUANTITY_NAME, recorded_names

    measure = (getattr(rec, "tracking", None) or {}).get("measure")  # read from other people's files: names only
    names = [n for n in recorded_names(measure) if QUANTITY_NAME.fullmatch(n)] if isinstance(measure, str) else []
    return [n for n in dict.fromkeys(names) if not any(own_column(c) for c in quantity_columns(n))
            and not (n.endswith("_se") and n[:-3] in names)]


def quantity_series(records) -> list[tuple[str, str]]:
    """(metrics.csv column, axis label) of each measured quantity the runs tracked (:func:`_tracked_names`), in the
    order first met; a registered quantity labelled by its title, another (a plug-in not installed here) by its
    name."""
    from ..analysis.estimators.quantities import quantity
    from ..errors import ConfigError

    out = []
    for name in dict.fromkeys(n for rec in records for n in _tracked_names(rec)):
        try:
            title = quantity(name).title
        except ConfigError:
            title = name
        out.append((f"hessian_{name}", f"{title} of the Hessian"))
    return out


def has_curvature(records) -> bool:
    """Whether any run has a curvature series (a round with a top eigenvalue, a trace or a measured quantity)."""
    columns = [col for col, _ in SERIES[:2] + tuple(quantity_series(records))]
    return any(row.get(col) is not None for rec in records for row in rec.curve for col in columns)


def _series(rec, column: str) -> dict:
    """round -> a run's value of ``column``; a quantity's column only where the run tracked that quantity (another
    run's column of that name is something else: a plug-in of another meaning)."""
    if column not in FIXED_COLUMNS and column[len("hessian_"):] not in _tracked_names(rec):
        return {}
    return {int(row["round"]): row[column] for row in rec.curve
            if row.get(column) is not None and row.get("round") is not None}


def _target(rec, row) -> float | None:
    """The relative standard error a tracked trace was asked to reach (the row's, else the run's settings)."""
    target = row.get("hessian_trace_target")
    if target is None:
        target = (getattr(rec, "tracking", None) or {}).get("trace_rtol")
    return float(target) if isinstance(target, (int, float)) and not isinstance(target, bool) else None


def _stated_errors(records, column: str) -> bool:
    """Whether any run states a finite standard error for a point of ``column``."""
    return any(np.isfinite(se) for rec in records for se, _ in _errors(rec, column).values())


def _errors(rec, column: str) -> dict:
    """round -> (standard error, resolved) of a run's tracked trace or quantity (``column``; its standard error in
    ``column + "_se"``; nan where none is stated or the cell is no standard error: negative, infinite). Resolved:
    the standard error meets the run's target (the trace's, which a quantity shares); a quantity that states none is
    resolved unless its round was marked unresolved."""
    out = {}
    rows = {int(r["round"]): r for r in rec.curve if r.get("round") is not None}  # the last of a round, as _series
    for rnd, value in _series(rec, column).items():
        row = rows[rnd]
        se, target = row.get(f"{column}_se"), _target(rec, row)
        se = float(se) if se is not None and np.isfinite(se) and se >= 0 else float("nan")
        if np.isfinite(se) or column == "hessian_trace":
            resolved = target is None or (np.isfinite(se) and se <= target * abs(value))
        else:  # no standard error of its own: the round's mark, unless the trace's own miss explains it
            trace, trace_se = row.get("hessian_trace"), row.get("hessian_trace_se")
            trace_missed = trace is not None and target is not None and not (
                trace_se is not None and np.isfinite(trace_se) and trace_se <= target * abs(trace))
            resolved = row.get("hessian_status") != "unresolved" or trace_missed
        out[rnd] = (se, bool(resolved))
    return out


def _one_per_seed(records) -> tuple[list, list]:
    """A second run of a seed (of one method, partition and training settings: report.experiments.run_identity)
    counts once, as in the tables: the run with the most curvature points is kept, then the first by name; runs
    with no seed are each their own. Returns (kept, [(left out, kept instead)])."""
    from ..utils.provenance import json_digest
    from .experiments import run_identity

    def points(r) -> int:
        columns = [col for col, _ in SERIES[:2] + tuple(quantity_series([r]))]  # read once a run, not once a row
        return sum(row.get(col) is not None for row in r.curve for col in columns)

    kept: dict = {}
    dropped = []
    for r in sorted(records, key=lambda r: (-points(r), str(getattr(r, "name", "")))):
        seed, identity = getattr(r, "seed", None), run_identity(r)
        key = (r.method, r.partition, seed, None if identity is None else json_digest(identity)) \
            if seed is not None else id(r)
        if key in kept:
            dropped.append((r, kept[key]))
        kept.setdefault(key, r)
    chosen = {id(r) for r in kept.values()}
    return [r for r in records if id(r) in chosen], dropped


def curvature_page(title: str, records, methods: list[str], subtitle: str = "") -> Figure:
    """The page (see the module docstring); ``methods`` in legend order, runs of other methods left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=PAGE_SIZE)
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=12, weight="bold", y=0.975)
    # the page draws the Hessian: runs that tracked another curvature (config.json's tracking) are left out
    records, twice = _one_per_seed([r for r in records if r.method in methods
                                    and (getattr(r, "tracking", None) or {}).get("curvature", "hessian") == "hessian"])
    methods = [m for m in methods if any(r.method == m for r in records)]
    quantities = quantity_series(records)
    rows = [(col, label) for col, label in SERIES[:2] + tuple(quantities) + SERIES[2:]  # the loss last
            if any(_series(r, col) for r in records)]
    estimated = {"hessian_trace", *(col for col, _ in quantities)}  # drawn with error bars
    parts = sorted({r.partition for r in records})
    styles = line_styles(methods)
    several = any(sum(r.method == m and r.partition == p for r in records) > 1 for m in methods for p in parts)
    traced = any(col == "hessian_trace" for col, _ in rows)
    measured = any(col in estimated and _stated_errors(records, col) for col, _ in rows if col != "hessian_trace")
    barred = " and ".join(what for what, drawn in (("trace", traced), ("measured quantities", measured)) if drawn)
    notes = ("lines: mean over seeds, bands: their range" if several else "",
             "a seed's second run drawn once: " + ", ".join(f"{getattr(r, 'name', '?')} (as "
                                                             f"{getattr(k, 'name', '?')})" for r, k in twice)
             if twice else "",
             f"{barred}: bars +-{TRACE_INTERVAL_SE:g} standard errors" +
             (", circled points: standard error above the run's target (unresolved)" if traced else "")
             if barred else "")
    subtitle = "; ".join(s for s in (subtitle, *notes) if s)
    for k, line in enumerate(textwrap.wrap(shown(subtitle, 2 * 170), 170)[:2]):
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
                if column in estimated:
                    _draw_errors(ax, xs, arr.mean(0), [_errors(r, column) for r in records
                                                      if r.method == method and r.partition == part
                                                      and _series(r, column)], st)
                if len(curves) > 1:
                    ax.fill_between(xs, arr.min(0), arr.max(0), color=st["color"], alpha=0.15, linewidth=0)
                handles[method] = h
            if i == 0:
                ax.set_title(part, fontsize=10)
            if j == 0:
                ax.set_ylabel("\n".join(textwrap.wrap(label, 24)), fontsize=9)  # four rows of panels: short lines
            if i == len(rows) - 1:
                ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), [h.get_label() for h in handles.values()], loc="lower center",
                   ncol=min(4, len(handles)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.91))
    return fig


def _draw_errors(ax, xs, means, errors: list[dict], st: dict) -> None:
    """Error bars (+-TRACE_INTERVAL_SE standard errors of the mean over the seeds) at every drawn point of an
    estimate (none where a seed states no standard error), and a ring around the points where a seed's estimate
    missed its target."""
    se = np.array([[e.get(x, (float("nan"), False))[0] for x in xs] for e in errors])
    resolved = np.array([[e.get(x, (float("nan"), False))[1] for x in xs] for e in errors])
    # the root-mean-square over the seeds over sqrt(seeds), scaled so that squares of large errors do not overflow;
    # nan where a seed has no standard error
    top = np.where(np.isfinite(se), se, 0.0).max(axis=0, initial=0.0)
    scale = np.where(top > 0, top, 1.0)
    mean_se = scale * np.sqrt(np.mean((se / scale) ** 2, axis=0) / se.shape[0])
    mean_se = np.where(np.isfinite(mean_se), mean_se, np.nan)
    if not np.isfinite(mean_se).any() and resolved.all():
        return  # a quantity that states no standard error: no bars
    ax.errorbar(xs, means, yerr=TRACE_INTERVAL_SE * np.where(np.isfinite(mean_se), mean_se, 0.0), fmt="none",
                ecolor=st["color"], elinewidth=1.0, capsize=3, alpha=0.8, label="_trace interval")
    open_ = ~resolved.all(axis=0)
    if open_.any():
        ax.plot(np.asarray(xs)[open_], np.asarray(means)[open_], linestyle="none", marker="o", markersize=12,
                markerfacecolor="none", markeredgecolor=st["color"], markeredgewidth=1.2, label="_unresolved",
                zorder=5)
