"""The analysis commands' figures, rendered in memory as PNG / PDF bytes (the commands write them atomically).

* :func:`hessian_figures`: the top-k eigenvalue curve (as MAN Fig. 4a) and the spectral density on a log axis
  (MAN Fig. 4b) of ``flatfl hessian``.
* :func:`clients_heatmap`: the per-pair H_N and H_D matrices of ``flatfl hessian-clients``.
* :func:`surface_figures`: the loss contour (as MAN Fig. 1) and the 3-D surface (as FedAlign Fig. 1) of
  ``flatfl surface``."""
from __future__ import annotations

import io
import math

import numpy as np

from .density import smoothed_density

__all__ = ["hessian_figures", "clients_heatmap", "surface_figures"]


def figure_bytes(draw, fmt: str, size=(5.0, 3.6), projection=None) -> bytes:
    """One axes drawn by ``draw(fig, ax)``, saved as ``fmt``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=150)
    ax = fig.add_subplot(1, 1, 1, projection=projection)
    draw(fig, ax)
    fig.tight_layout()
    return saved(fig, fmt)


def saved(fig, fmt: str) -> bytes:
    """``fig`` as ``fmt`` bytes; a PDF without its creation date, so the same result gives the same file."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, metadata={"CreationDate": None} if fmt == "pdf" else None)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- flatfl hessian
def hessian_figures(values, dens, title: str) -> dict[str, bytes]:
    """eigenvalues.png/.pdf (when there are 2 or more ``values``) and density.png/.pdf (when ``dens``, a
    :class:`~flatfl.analysis.density.DensityResult`, is given)."""
    files: dict[str, bytes] = {}
    if len(values) >= 2:
        def draw_eigenvalues(fig, ax):
            ax.plot(np.arange(1, len(values) + 1), values, marker="o" if len(values) <= 50 else None,
                    markersize=3, linewidth=1.2)
            ax.set_xlabel("Index")
            ax.set_ylabel("Eigenvalue")
            ax.set_title(f"Top {len(values)} Hessian eigenvalues: {title}", fontsize=9)
            ax.grid(alpha=0.3)

        for fmt in ("png", "pdf"):
            files[f"eigenvalues.{fmt}"] = figure_bytes(draw_eigenvalues, fmt)
    if dens is not None:
        grid, curve = smoothed_density(dens.nodes, dens.weights)

        def draw_density(fig, ax):
            ax.semilogy(grid, curve + 1e-7, linewidth=1.0)
            ax.set_xlabel("Eigenvalue")
            ax.set_ylabel("Density (log scale)")
            ax.set_title(f"Hessian eigenvalue spectral density: {title}", fontsize=9)
            nodes = np.concatenate(dens.nodes)
            ax.set_xlim(nodes.min() - 1, nodes.max() + 1)

        for fmt in ("png", "pdf"):
            files[f"density.{fmt}"] = figure_bytes(draw_density, fmt)
    return files


# ---------------------------------------------------------------------------------------------- hessian-clients
def clients_heatmap(metrics, title: str, fmt: str) -> bytes:
    """The H_N and H_D matrices of a :class:`~flatfl.analysis.client_metrics.ClientMetrics` side by side."""
    from matplotlib.figure import Figure

    k = len(metrics.diag_norms)
    fig = Figure(figsize=(9.0, 4.0), dpi=150)
    panels = ((metrics.pair_H_N, r"$H_N(k,j)$ (norm gap)", "magma_r"),
              (metrics.pair_H_D, r"$H_D(k,j)$ (cosine)", "viridis"))
    for i, (matrix, label, cmap) in enumerate(panels, 1):
        ax = fig.add_subplot(1, 2, i)
        image = ax.imshow(np.ma.masked_invalid(np.asarray(matrix, dtype=float)), cmap=cmap, interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("client j")
        ax.set_ylabel("client k")
        step = max(1, k // 10)
        ax.set_xticks(np.arange(0, k, step))
        ax.set_yticks(np.arange(0, k, step))
    mean_n = "n/a" if not math.isfinite(metrics.H_N) else f"{metrics.H_N:.4g}"
    mean_d = "n/a" if not math.isfinite(metrics.H_D) else f"{metrics.H_D:.4g}"
    fig.suptitle(f"{title}: protocol {metrics.protocol}, H_N = {mean_n}, H_D = {mean_d}", fontsize=10)
    fig.tight_layout()
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


def surface_figures(result, title: str, labels=("direction 1", "direction 2")) -> dict[str, bytes]:
    """Contour and 3-D surface figures of a :class:`~flatfl.analysis.surface.SurfaceResult`, PNG and PDF."""
    X, Y = np.meshgrid(result.xs, result.ys)
    Z = result.loss

    def contour(fig, ax):
        filled = ax.contourf(X, Y, Z, levels=contour_levels(Z), cmap="viridis")
        lines = ax.contour(X, Y, Z, levels=contour_levels(Z), colors="k", linewidths=0.4)
        ax.clabel(lines, lines.levels[::4], inline=True, fontsize=6, fmt="%.3g")
        fig.colorbar(filled, ax=ax, label="loss")
        ax.plot([0], [0], marker="*", color="w", markeredgecolor="k", markersize=9)
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=8)

    def surface(fig, ax):
        from matplotlib.ticker import MaxNLocator

        ax.plot_surface(X, Y, Z, rstride=1, cstride=1, cmap="viridis", edgecolor="none")
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.yaxis.set_major_locator(MaxNLocator(5))
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.set_zlabel("loss")
        ax.view_init(elev=25.0, azim=-60.0)
        ax.set_title(title, fontsize=8)

    files = {}
    for fmt in ("png", "pdf"):
        files[f"surface_contour.{fmt}"] = figure_bytes(contour, fmt, size=(5.2, 4.2))
        files[f"surface_3d.{fmt}"] = figure_bytes(surface, fmt, size=(5.6, 4.6), projection="3d")
    return files
