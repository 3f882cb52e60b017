"""Every figure that ``flatfl hessian``, ``hessian-clients`` and ``surface`` write, rendered on a small run (tiny
model, 4 clients, 1 round, few samples) and checked with matplotlib's own geometry for what a reader relies on: every
text inside the figure (renderer extents), every axes labelled, the model and round in the figure's text; the
density drawn from the average of the SLQ starts in hessian.json (recomputed here with numpy) with the Gaussian width
printed on the figure and the log axis no lower than the stated fraction of the peak; the top-k eigenvalues on a log
axis beside their residuals."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.text import Text

from flatfl.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, request):
    """Run the three commands once; (output folders, {png file name: the Figure that made it})."""
    import flatfl.analysis.commands.result_figures as figures_module

    root = tmp_path_factory.mktemp("figures")
    run = root / "run"
    r = CliRunner().invoke(main, ["train", "--model", "tiny", "--clients", "4", "--participation", "1.0", "--rounds",
                                  "1", "--batch-size", "64", "--save-clients", "--quiet", "--out", str(run)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    made = {}
    original = figures_module.saved

    def recording(fig, fmt):
        data = original(fig, fmt)
        made[data] = fig
        return data

    figures_module.saved = recording
    try:
        outs = {"hessian": root / "h", "clients": root / "c", "surface": root / "s"}
        for args in (["hessian", str(run / "final.pt"), "--top", "20", "--density", "--density-steps", "30",
                      "--density-starts", "4", "--no-trace", "--samples", "128", "--out", str(outs["hessian"])],
                     ["hessian-clients", str(run), "--probes", "4", "--groups", "2", "--samples", "64", "--out",
                      str(outs["clients"])],
                     ["surface", str(run), "--grid", "3", "--range", "0.5", "--samples", "128", "--out",
                      str(outs["surface"])]):
            r = CliRunner().invoke(main, args + ["--quiet"], catch_exceptions=False)
            assert r.exit_code == 0, r.output
    finally:
        figures_module.saved = original
    pngs = {}
    for out in outs.values():
        for path in sorted(out.glob("*.png")):
            pngs[path.name] = made[path.read_bytes()]
    return outs, pngs


def texts(fig) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def all_axes(fig) -> list:
    out = []
    for ax in fig.axes:
        out += [ax] + list(ax.child_axes)  # an inset is a child of its axes
    return out


def tick_labels(fig) -> set[int]:
    """The ids of every tick label Text (drawn only when its tick is inside the view: checked through the axes'
    tight bounding box instead)."""
    ids = set()
    for ax in all_axes(fig):
        for axis in (ax.xaxis, ax.yaxis) + ((ax.zaxis,) if hasattr(ax, "zaxis") else ()):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ids |= {id(tick.label1), id(tick.label2)}
    return ids


def renderer_of(fig):
    """The figure's Agg renderer (one is attached and the figure drawn if its canvas has none)."""
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        fig.canvas.draw()
    return fig.canvas.get_renderer()


def inside(ext, box) -> bool:
    return ext.x0 >= box.x0 - 1 and ext.y0 >= box.y0 - 1 and ext.x1 <= box.x1 + 1 and ext.y1 <= box.y1 + 1


def test_every_figure_keeps_its_text_inside_and_labels_its_axes(rendered):
    outs, pngs = rendered
    assert set(pngs) == {"eigenvalues.png", "density.png", "clients_heatmap-default.png", "surface_contour.png",
                         "surface_3d.png"}
    for name, fig in pngs.items():
        renderer = renderer_of(fig)
        box = fig.bbox
        ticks = tick_labels(fig)
        for t in texts(fig):  # titles, axis labels, legends, notes: each inside the figure
            if id(t) not in ticks:
                assert inside(t.get_window_extent(renderer), box), (name, t.get_text(), t.get_window_extent(renderer))
        for ax in all_axes(fig):  # everything an axes draws (its tick labels too) inside the figure
            assert inside(ax.get_tightbbox(renderer), box), (name, ax.get_title(), ax.get_tightbbox(renderer))
        for ax in fig.axes:
            assert ax.get_xlabel().strip() or ax.get_ylabel().strip(), (name, ax)  # a colour bar labels one axis
            if ax.get_label() != "<colorbar>":
                assert ax.get_xlabel().strip() and ax.get_ylabel().strip(), (name, ax.get_title())
                if hasattr(ax, "get_zlabel"):
                    assert ax.get_zlabel().strip(), name
    for name, fig in pngs.items():
        words = " ".join(t.get_text() for t in texts(fig))
        assert "tiny" in words and "round 1" in words, (name, words)  # the model and the round
        if name != "clients_heatmap-default.png":
            assert "128 train samples" in words, (name, words)
        else:
            assert "64 samples a client" in words, words


def test_density_is_the_average_of_the_starts_with_its_width_and_floor_stated(rendered):
    outs, pngs = rendered
    report = json.loads((outs["hessian"] / "hessian.json").read_text())
    dens = report["density"]
    assert len(dens["nodes"]) == 4
    fig = pngs["density.png"]
    (ax,) = fig.axes
    words = " ".join(t.get_text() for t in texts(fig))
    lo = min(min(t) for t in dens["nodes"])
    hi = max(max(t) for t in dens["nodes"])
    sigma = 0.01 * (hi - lo)
    m = re.search(r"σ = (-?[0-9.]+(?:e-?\d+)?)", words)
    assert m, words
    assert float(m.group(1)) == pytest.approx(sigma, rel=5e-3)  # printed to 3 significant digits
    (curve,) = [ln for ln in ax.get_lines() if "SLQ start" in ln.get_label()]
    assert "4 SLQ starts" in curve.get_label()
    x, y = np.asarray(curve.get_xdata(), float), np.asarray(curve.get_ydata(), float)
    # the truth: every start's Gaussian mixture, averaged (numpy, from hessian.json)
    truth = np.mean([np.exp(-((x[:, None] - np.asarray(t)[None, :]) ** 2) / (2 * sigma ** 2)) @ np.asarray(w)
                     for t, w in zip(dens["nodes"], dens["weights"])], axis=0) / (sigma * np.sqrt(2 * np.pi))
    drawn = np.isfinite(y)
    np.testing.assert_allclose(y[drawn], truth[drawn], rtol=1e-6)
    # the log axis starts at the fraction of the peak printed on the axis label, never lower; nothing drawn below it
    assert ax.get_yscale() == "log"
    m = re.search(r"from ([0-9.e+-]+) × peak", ax.get_ylabel())
    assert m, ax.get_ylabel()
    fraction = float(m.group(1))
    peak = truth.max()
    assert 0 < fraction <= 1e-4
    assert ax.get_ylim()[0] >= fraction * peak * (1 - 1e-9)
    assert np.nanmin(y) >= ax.get_ylim()[0]
    assert not drawn[truth < ax.get_ylim()[0]].any() and drawn[truth >= ax.get_ylim()[0]].all()
    # the top-k eigenvalues are marked on the density's axis
    assert any("top 20 eigenvalues" in c.get_label() for c in ax.collections)


def test_eigenvalue_figure_has_a_log_axis_and_the_residuals(rendered):
    outs, pngs = rendered
    report = json.loads((outs["hessian"] / "hessian.json").read_text())
    fig = pngs["eigenvalues.png"]
    values = np.asarray(report["top_eigenvalues"])
    assert len(fig.axes) == 2, fig.axes  # the eigenvalues, and their residuals and error estimates
    ax_values, ax_errors = fig.axes
    (line,) = [ln for ln in ax_values.get_lines() if len(ln.get_xdata()) == len(values)]
    np.testing.assert_allclose(line.get_ydata(), values)
    assert ax_values.get_yscale() == ("log" if values.min() > 0 else "symlog")  # the tail under the top few shows
    if values.min() <= 0:  # a negative eigenvalue is drawn below the zero line, not hidden
        assert ax_values.get_ylim()[0] < 0
    (res,) = [ln for ln in ax_errors.get_lines() if ln.get_label().startswith("residual")]
    shown = np.asarray(report["residuals"], float)
    np.testing.assert_allclose(res.get_ydata(), shown[shown > 0])
    assert ax_errors.get_yscale() == "log" and ax_errors.get_legend() is not None


def test_negative_eigenvalues_stay_visible_below_zero():
    """A spectrum with negative eigenvalues: the top-k panel switches to a symmetric log axis on which the negative
    values are drawn below the zero line (log would drop them), and the density notes the SLQ weight below -sigma,
    equal to the quadrature weights' share computed by hand, with the negative side shaded."""
    from flatfl.utils.plots import draw_density, draw_top_eigenvalues, new_figure

    values = [5.0, 2.0, 0.5, 0.01, -0.2, -1.5]
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    draw_top_eigenvalues(ax, {"run": [values]}, scale="log")
    assert ax.get_yscale() == "symlog"
    fig.canvas.draw()
    screen = ax.transData.transform(np.column_stack([np.arange(1, 7), values]))[:, 1]
    zero = ax.transData.transform((1, 0))[1]
    assert (screen[values.index(-1.5)] < zero) and (screen[values.index(-0.2)] < zero)
    assert ax.get_ylim()[0] <= -1.5 and np.all(np.diff(screen) < 0)  # order kept, nothing folded over

    nodes = [np.array([-2.0, -0.001, 0.0, 0.3, 4.0]), np.array([-1.8, 0.0, 0.2, 4.1])]
    weights = [np.array([0.1, 0.3, 0.3, 0.2, 0.1]), np.array([0.05, 0.6, 0.25, 0.1])]
    dens = {"nodes": nodes, "weights": weights, "dim": 1000}
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    grid, curves, sigma, fraction = draw_density(ax, {"m": [dens]})
    assert sigma == pytest.approx(0.01 * (4.1 + 2.0))
    share = (0.1 + 0.05) / 2  # only the nodes below -sigma (the one at -0.001 is within the smoothing width)
    note = " ".join(t.get_text() for t in texts(fig))
    assert f"weight on λ < −σ: {share:.2%}" in note, note
    assert any(p.get_label() == "λ < 0" for p in ax.patches)
    assert grid[0] < -2.0

