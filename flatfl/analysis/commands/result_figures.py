"""The analysis commands' figures, rendered in memory as PNG / PDF bytes (the commands write them atomically).

* :func:`hessian_figures`: the top-k eigenvalue curve (as MAN Fig. 4a) and the spectral density on a log axis
  (MAN Fig. 4b) of ``flatfl hessian``.
* :func:`clients_heatmap`: the per-pair H_N and H_D matrices of ``flatfl hessian-clients``.
* :func:`surface_figures`: the loss contour (as MAN Fig. 1) and the 3-D surface (as FedAlign Fig. 1) of
  ``flatfl surface``."""
from __future__ import annotations

import math

import numpy as np

from ..estimators.registry import estimator_title
from .hessian_settings import CURVATURE_TITLES, damping_text, eigenvalues_text, measured_text
from ...utils.plots import (COLORS, LEGEND_SIZE, NOTE_SIZE, TITLE_SIZE, context_title, draw_density,
                           draw_top_eigenvalues, finish, format_number, label_axes, new_figure, saved)

__all__ = ["hessian_figures", "density_figure", "clients_heatmap", "surface_figures", "figure_bytes", "quantity",
           "ORDER_NAMES"]

#: how each choice of eigenvalues (``which``) orders them, as an index axis says it
ORDER_NAMES = {"largest": "largest first", "smallest": "smallest first", "magnitude": "largest |λ| first"}


def quantity(curvature: str | None, damping=None) -> str:
    """What an eigenvalue axis shows: 'GGN eigenvalue λ', 'Hessian + 0.0005 I eigenvalue λ' (``curvature`` a name
    of :data:`~flatfl.analysis.commands.hessian_settings.CURVATURES`, ``damping`` its ``--damping``); 'eigenvalue λ'
    when the curvature is not known (an explicit matrix)."""
    if not curvature:
        return "eigenvalue λ"
    return f"{CURVATURE_TITLES.get(curvature, str(curvature))}{damping_text(damping)} eigenvalue λ"


def _relabel(label, text: str) -> None:
    """Replace an axis label's or title's text, keeping its font (the shared drawing code names the Hessian)."""
    label.set_text(text)


def figure_bytes(draw, fmt: str, size=(5.0, 3.6), projection=None, title: str | None = None) -> bytes:
    """One axes drawn by ``draw(fig, ax)``, laid out by :func:`flatfl.utils.plots.finish`, saved as ``fmt``."""
    fig = new_figure(size)
    ax = fig.add_subplot(1, 1, 1, projection=projection)
    draw(fig, ax)
    finish(fig, title)
    return saved(fig, fmt)


# ---------------------------------------------------------------------------------------------- flatfl hessian
def hessian_figures(report: dict, title: str) -> dict[str, bytes]:
    """eigenvalues.png/.pdf (when the report has 2 or more ``top_eigenvalues``) and density.png/.pdf (when it has
    a ``density``) from a ``flatfl hessian`` report (the hessian.json dict); ``title`` names the model and round.

    eigenvalues: (a) the eigenvalues asked for (``eigen.which``: the top k, the smallest, the largest in magnitude)
    on a log axis (symmetric log when one is <= 0) so the tail under the first few shows, (b) each eigenvalue's
    residual ||Hv - λv|| and error estimate min(r, r^2 / gap) (never below the products' rounding) against the
    eigenvalue itself (the same units), the eigenvalues the solver did not converge marked. density: every SLQ start
    averaged, Gaussian width stated, log axis from 1e-4 of the peak, weight below zero noted (:func:`draw_density`).
    Every axis and title names the curvature (``curvature``, else ``settings.curvature``), the products and the
    precision (``measured``)."""
    files: dict[str, bytes] = {}
    settings = report.get("settings") or {}
    curvature = report.get("curvature") or settings.get("curvature")
    measured = report.get("measured") or measured_text(curvature, report.get("products"), report.get("precision"))
    values = [float(v) for v in report.get("top_eigenvalues") or []]
    context = dict(model=title, samples=report.get("num_samples"), split=settings.get("split"))
    eigen = report.get("eigen") or {}
    which = eigen.get("which") or settings.get("which") or "largest"
    if len(values) >= 2:
        method = estimator_title("eigenvalues", eigen.get("method"))
        residuals = report.get("residuals") or []
        estimates = report.get("error_estimates")
        converged = report.get("converged") or [True] * len(values)
        for fmt in ("png", "pdf"):
            fig = new_figure((10.0, 4.2))
            ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
            draw_top_eigenvalues(ax1, {"eigenvalue": [values]}, scale="log", panel="(a) ")
            _relabel(ax1.yaxis.label, quantity(curvature, settings.get("damping")))
            _relabel(ax1.xaxis.label, f"eigenvalue index ({ORDER_NAMES[which]})")
            _relabel(ax1.title, ax1.get_title().replace("top", eigenvalues_text(which, 2).rsplit(" ", 1)[0], 1))
            ax1.text(0.97, 0.97, spectrum_note(values, report.get("trace")), transform=ax1.transAxes, ha="right",
                     va="top", fontsize=NOTE_SIZE, bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.7"})
            draw_eigen_errors(ax2, values, residuals, estimates, converged, eigen.get("tol"),
                              eigen.get("residual_kind"), which)
            finish(fig, context_title(**context, method=f"{method}, {len(values)} {eigenvalues_text(which, 2)}"
                                                         f"{'; ' + measured if measured else ''}"))
            files[f"eigenvalues.{fmt}"] = saved(fig, fmt)
    dens = report.get("density")
    if dens and dens.get("nodes"):
        for fmt in ("png", "pdf"):
            files[f"density.{fmt}"] = density_figure(dens, fmt, marks=values, curvature=curvature, which=which,
                                                     measured=measured, damping=settings.get("damping"), **context)
    return files


def density_figure(dens: dict, fmt: str, marks=(), *, curvature: str | None = None, which: str = "largest",
                   measured: str = "", damping=None, **context) -> bytes:
    """The spectral density of one SLQ result (``nodes``, ``weights``, one list per start; ``steps``, ``dim``) as
    ``fmt`` bytes: every start averaged, Gaussian width stated, log axis from 1e-4 of the peak (:func:`draw_density`),
    ``marks`` (the eigenvalues ``which`` asked for) ticked; the axis names the ``curvature`` and its ``damping``
    (:func:`quantity`),
    the title ``measured`` (curvature, products, precision) and ``context`` (model, samples, split...)."""
    starts, steps = len(dens["nodes"]), dens.get("steps")
    method = f"SLQ, {starts} start{'s' if starts != 1 else ''}" + (f" × {steps} Lanczos steps" if steps else "")
    fig = new_figure((7.0, 4.6))
    ax = fig.add_subplot(1, 1, 1)
    first, rest = eigenvalues_text(which, len(marks)).split(" ", 1)  # 'top 20 eigenvalues', 'smallest 3 ...'
    marked = f"{first} {len(marks)} {rest}" if len(marks) else ""
    draw_density(ax, {"": [dens]}, labels={"": ""}, marks=list(marks), marks_label=marked)
    _relabel(ax.xaxis.label, quantity(curvature, damping))
    finish(fig, context_title(**context, method=f"{method}{'; ' + measured if measured else ''}"))
    return saved(fig, fmt)


def spectrum_note(values, trace=None) -> str:
    """'λ1 = 19.01, λ200 = 0.0327 (ratio 581)' and, when estimated, 'trace 83.02 ± 0.52 (hutchpp, 100 HVPs)'."""
    k = len(values)
    note = f"λ1 = {format_number(values[0])}, λ{k} = {format_number(values[-1])}"
    if values[-1] > 0:
        note += f" (ratio {format_number(values[0] / values[-1], 3)})"
    if trace and trace.get("estimate") is not None:
        err = f" ± {format_number(trace['stderr'], 2)}" if trace.get("stderr") is not None else ""
        how = "exact" if trace.get("method") == "exact" else f"{trace.get('method')}, {trace.get('hvps')} HVPs"
        note += f"\ntrace = {format_number(trace['estimate'])}{err} ({how})"
    return note


def draw_eigen_errors(ax, values, residuals, estimates, converged, tol=None, residual_kind=None,
                      which: str = "largest") -> None:
    """|λ_i|, the residual ||H v_i - λ_i v_i|| and the error estimate of each eigenvalue on one log axis (all three
    are eigenvalue units), the unconverged ones circled: how far below each eigenvalue its uncertainty lies
    (``which``: how the eigenvalues are ordered)."""
    idx = np.arange(1, len(values) + 1)
    mag = np.abs(np.asarray(values, float))
    ax.semilogy(idx, np.where(mag > 0, mag, np.nan), color=COLORS[0], linewidth=1.3, label="|λ|")
    shown = [mag[mag > 0]]
    for data, name, color, style in ((residuals, "residual ||Hv − λv||" + (f" ({residual_kind})" if residual_kind
                                                                            else ""), COLORS[1], "--"),
                                     (estimates, "error estimate min(r, r²/gap)", COLORS[2], ":")):
        if data and len(data) == len(values):
            arr = np.array([np.nan if v is None else float(v) for v in data])
            ok = np.isfinite(arr) & (arr > 0)
            if ok.any():
                ax.semilogy(idx[ok], arr[ok], color=color, linestyle=style, linewidth=1.2, label=name)
                shown.append(arr[ok])
    if tol:
        ax.semilogy(idx, tol * np.maximum(mag, 1e-300), color="0.5", linewidth=0.8, linestyle="-.",
                    label=f"convergence test: {tol:g} × |λ|")
    bad = ~np.asarray(converged, bool)
    if bad.any():
        ax.semilogy(idx[bad], mag[bad], linestyle="none", marker="o", markersize=6, markerfacecolor="none",
                    markeredgecolor="k", label=f"not converged ({int(bad.sum())})")
    label_axes(ax, f"eigenvalue index ({ORDER_NAMES[which]})", "eigenvalue units (log scale)",
               f"(b) residual and error estimate of each eigenvalue ({int((~bad).sum())} of {len(values)} converged)")
    ax.legend(fontsize=LEGEND_SIZE - 0.5, loc="best")


# ---------------------------------------------------------------------------------------------- hessian-clients
def clients_heatmap(metrics, title: str, fmt: str, data: str | None = None, curvature: str = "hessian") -> bytes:
    """The H_N and H_D matrices of a :class:`~flatfl.analysis.estimators.client_metrics.ClientMetrics` side by side; ``title``
    names the model and round, ``data`` what each client's curvature was taken on ('64 samples a client'),
    ``curvature`` which matrix (a name of :data:`CURVATURE_TITLES`)."""
    k = len(metrics.diag_norms)
    fig = new_figure((9.0, 4.2))
    matrices = "Hessians" if curvature == "hessian" else f"{CURVATURE_TITLES[curvature]} matrices"
    panels = ((metrics.pair_H_N, rf"(a) $H_N(k,j)$: norm gap of the client {matrices}", "magma_r",
               "H_N (dimensionless)"),
              (metrics.pair_H_D, r"(b) $H_D(k,j)$: cosine of the top eigenvectors", "viridis", "H_D (cosine)"))
    for i, (matrix, label, cmap, unit) in enumerate(panels, 1):
        ax = fig.add_subplot(1, 2, i)
        image = ax.imshow(np.ma.masked_invalid(np.asarray(matrix, dtype=float)), cmap=cmap, interpolation="nearest")
        bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        bar.set_label(unit, fontsize=LEGEND_SIZE)
        bar.ax.tick_params(labelsize=NOTE_SIZE)
        label_axes(ax, "client j", "client k", label, grid=False)
        step = max(1, k // 10)
        ax.set_xticks(np.arange(0, k, step))
        ax.set_yticks(np.arange(0, k, step))
    mean_n = "n/a" if not math.isfinite(metrics.H_N) else f"{metrics.H_N:.4g}"
    mean_d = "n/a" if not math.isfinite(metrics.H_D) else f"{metrics.H_D:.4g}"
    finish(fig, f"{context_title(title, method=data)}, protocol {metrics.protocol}: "
                f"H_N = {mean_n}, H_D = {mean_d} (means over client pairs)")
    return saved(fig, fmt)


# ---------------------------------------------------------------------------------------------- surface
def contour_levels(loss: np.ndarray, count: int = 25) -> np.ndarray:
    """Contour levels of a loss grid: geometric when the losses span decades (the basin shows), else linear."""
    low, high = float(np.nanmin(loss)), float(np.nanmax(loss))
    if not high > low:
        return np.array([low - 1e-12, high + 1e-12])
    if low > 0 and high / low > 20:
        return np.geomspace(low, high, count)
    return np.linspace(low, high, count)


def surface_figures(result, title: str, labels=("direction 1", "direction 2"), samples=None,
                    split=None) -> dict[str, bytes]:
    """Contour and 3-D surface figures of a :class:`~flatfl.analysis.estimators.surface.SurfaceResult`, PNG and PDF; ``title``
    names the model, round and directions, ``samples`` and ``split`` the data the loss was taken on."""
    X, Y = np.meshgrid(result.xs, result.ys)
    Z = result.loss
    heading = context_title(title, samples=samples, split=split)
    zlabel = "cross-entropy loss"

    def contour(fig, ax):
        filled = ax.contourf(X, Y, Z, levels=contour_levels(Z), cmap="viridis")
        lines = ax.contour(X, Y, Z, levels=contour_levels(Z), colors="k", linewidths=0.4)
        ax.clabel(lines, lines.levels[::4], inline=True, fontsize=6, fmt="%.3g")
        bar = fig.colorbar(filled, ax=ax)
        bar.set_label(zlabel, fontsize=LEGEND_SIZE)
        bar.ax.tick_params(labelsize=NOTE_SIZE)
        ax.plot([0], [0], marker="*", color="w", markeredgecolor="k", markersize=9, label="the checkpoint")
        label_axes(ax, labels[0], labels[1], "loss contours (★ the checkpoint)", grid=False)
        ax.set_aspect("equal")

    def surface(fig, ax):
        from matplotlib.ticker import MaxNLocator

        ax.plot_surface(X, Y, Z, rstride=1, cstride=1, cmap="viridis", edgecolor="none")
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.yaxis.set_major_locator(MaxNLocator(5))
        label_axes(ax, labels[0], labels[1], "loss surface", grid=False)
        ax.set_zlabel(zlabel, fontsize=TITLE_SIZE - 1.5)
        ax.view_init(elev=25.0, azim=-60.0)
        ax.set_box_aspect(None, zoom=0.85)  # room for the axis labels inside the figure

    files = {}
    for fmt in ("png", "pdf"):
        files[f"surface_contour.{fmt}"] = figure_bytes(contour, fmt, size=(5.6, 4.6), title=heading)
        files[f"surface_3d.{fmt}"] = figure_bytes(surface, fmt, size=(5.8, 5.0), projection="3d", title=heading)
    return files
