"""Figures name the curvature they show: the density and top-eigenvalue axes of `flatfl.utils.plots`, and the
report's Fig. 4 page from the analyses' recorded `curvature` (a GGN spectrum is labelled GGN; files written before
the field existed are the Hessian's; two kinds on one page are neither)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from matplotlib.figure import Figure

from flatfl.report.figure_pages import spectrum_pair_page
from flatfl.utils.plots import draw_density, draw_top_eigenvalues


def _density(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"nodes": [sorted(rng.normal(size=6).tolist())], "weights": [[1 / 6] * 6], "dim": 40}


def test_the_plot_axes_name_the_curvature():
    ax = Figure().add_subplot()
    draw_top_eigenvalues(ax, {"a": [[3.0, 2.0, 1.0]]}, curvature="GGN")
    assert ax.get_ylabel() == "GGN eigenvalue λ"
    ax = Figure().add_subplot()
    draw_density(ax, {}, curvature="empirical Fisher")
    assert ax.get_xlabel() == "empirical Fisher eigenvalue λ"
    ax = Figure().add_subplot()
    draw_density(ax, {})
    assert ax.get_xlabel() == "Hessian eigenvalue λ"


def _record(method: str, analysis: dict):
    return SimpleNamespace(method=method, spectrum=analysis, hessian=None)


def _labels(fig) -> tuple[str, str]:
    a, b = fig.axes[0], fig.axes[1]
    return a.get_ylabel(), b.get_xlabel()


def test_the_fig4_page_names_the_recorded_curvature():
    ggn = {"top_eigenvalues": [3.0, 2.0, 1.5], "density": _density(0), "curvature": "ggn"}
    old = {"top_eigenvalues": [3.0, 2.0, 1.5], "density": _density(1)}  # written before curvature was recorded
    fig = spectrum_pair_page(_record("FedAvg", ggn), _record("FedAvg+MAN", dict(ggn, density=_density(2))), "t")
    assert _labels(fig) == ("GGN eigenvalue λ", "GGN eigenvalue λ (of the mean training loss)")
    fig = spectrum_pair_page(_record("FedAvg", old), _record("FedAvg+MAN", old), "t")
    assert _labels(fig)[0] == "Hessian eigenvalue λ"
    fig = spectrum_pair_page(_record("FedAvg", old), _record("FedAvg+MAN", ggn), "t")
    assert _labels(fig)[0] == "curvature eigenvalue λ"
