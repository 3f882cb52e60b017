"""The report from hand-written run folders (no training): mean +- sd over two seeds and an 'inconclusive' verdict
where the seeds disagree, every row naming its model, daggers on numbers made with other settings, and every page
of both report layouts rendered with no text leaving its cell, axes or page (matplotlib renderer extents)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

import flatfl.report.pdf as report_pdf
from flatfl.analysis.commands.result_files import clients_file
from flatfl.train.config import build_config
from flatfl.report import build_report
from flatfl.reproduce import Selection, plan
from flatfl.run_layout import CLIENTS_DIR, MODEL_CHECKPOINTS, analysis_dir

AVERAGE_HESSIAN = analysis_dir("hessian", "clients-average")  # where the MAN tables' Hessian lives in a run


def _write_checkpoint(path: Path, cfg: dict, rounds: int) -> None:
    """A real final.pt (the report checks each result against it): a tiny network whose weights are seeded by the
    run's folder name, so that no two fake runs hold the same weights."""
    import zlib

    import torch

    from flatfl.checkpoint import save_checkpoint
    from flatfl.models import build_model

    torch.manual_seed(zlib.crc32(path.parent.name.encode()))
    net = build_model("tiny", num_classes=10, in_channels=1, image_size=8)
    # the report reads the record and the weights, never builds the network: the spec names the run's model
    save_checkpoint(path, {"model_spec": dict(net.flatfl_spec, name=cfg["model"]), "state_dict": net.state_dict(),
                           "dataset": {"name": cfg["dataset"]}, "config": cfg, "round": rounds})


def _write_run(task, *, lam, trace, trace_se, acc, model, topk=None, density=False, clients=None, surface=False,
               samples=1437, train_loss=0.05):
    d = Path(task.run_dir)
    d.mkdir(parents=True)
    cfg = build_config({}, task.settings).to_dict()
    (d / "config.json").write_text(json.dumps({"config": cfg}))
    with (d / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "train_loss", "test_acc", "all_test_acc"])
        for r in (1, 2, 3):
            w.writerow([r, train_loss * (4 - r), acc / 100 * r / 3, (acc - 1) / 100 * r / 3])
    _write_checkpoint(d / MODEL_CHECKPOINTS["server"], cfg, rounds=3)
    ckpt = MODEL_CHECKPOINTS[model]
    folder = analysis_dir("hessian", model)
    top = topk or [lam]
    h = {"checkpoint": str(d / ckpt), "num_samples": min(samples, 1437),
         "settings": {"method": "lanczos", "trace_method": "hutchpp", "samples": samples if samples != 1437 else None},
         "top_eigenvalues": top, "residuals": [1e-3] * len(top), "error_estimates": [1e-4] * len(top),
         "trace": {"estimate": trace, "stderr": trace_se}, "density": None}
    (d / folder).mkdir()
    (d / folder / "hessian.json").write_text(json.dumps(h))
    if density:
        rng = np.random.default_rng(len(d.name))
        spec = dict(h, top_eigenvalues=sorted(rng.uniform(0.1, lam, 60).tolist() + [lam], reverse=True),
                    density={"nodes": [sorted(rng.uniform(-0.5, lam, 12).tolist()) for _ in range(3)],
                             "weights": [(np.ones(12) / 12).tolist() for _ in range(3)]})
        sd = analysis_dir("spectrum", model)
        (d / sd).mkdir()
        (d / sd / "hessian.json").write_text(json.dumps(spec))
    if clients:
        (d / CLIENTS_DIR).mkdir(exist_ok=True)
        (d / CLIENTS_DIR / clients_file("default")).write_text(
            json.dumps(dict(clients, protocol="default", settings={"probes": 20, "samples": 64})))
    if surface:
        sdir = d / analysis_dir("surface", model)
        sdir.mkdir()
        x = np.linspace(-1, 1, 5)
        loss = (x[:, None] ** 2 + 2 * x[None, :] ** 2) * lam / 10 + 0.1
        np.savez(sdir / "surface.npz", x=x, y=x, loss=loss, done=np.ones_like(loss, dtype=bool))
        (sdir / "surface.json").write_text(json.dumps({"settings": {"directions": "hessian"}}))


# top eigenvalue per (method, seed): FedAvg's seeds disagree about MAN; FedDyn's agree that MAN lowers it
MAN_VALUES = {"FedAvg": (10.0, 12.0), "FedAvg+MAN": (13.0, 8.0), "FedDyn": (20.0, 20.2), "FedDyn+MAN": (10.0, 10.2)}


@pytest.fixture(scope="module")
def man_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("man-fake")
    tasks = plan(Selection("man-table2", "tiny", seeds=(0, 1)), runs_dir=root)
    from flatfl.report.records import method_label

    for t in tasks:
        method = method_label(t.settings | t.settings.get("params", {}))
        if method not in MAN_VALUES or t.settings["alpha"] != 0.3:
            continue
        lam = MAN_VALUES[method][t.settings["seed"]]
        _write_run(t, lam=lam, trace=10 * lam, trace_se=0.5, acc=90 + lam / 10, model="clients-average",
                   density=method.startswith("FedAvg"),
                   samples={"FedDyn+MAN": 512, "FedAvg+MAN": 2048}.get(method, 1437))
    return root


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_two_seeds_mean_sd_and_inconclusive_direction(man_runs, tmp_path, reports_undrawn):
    """The FedAvg pair: seeds 10, 12 -> 13, 8. Mean 11 -> 10.5, sd sqrt(2) and sqrt(12.5); the standard error of
    the difference sqrt(2/2 + 12.5/2) = 2.69 exceeds |-0.5| / 2: inconclusive, although the means fall as in the
    paper. FedDyn: 20.1 -> 10.1 with sd 0.141 both: agree."""
    with reports_undrawn():  # the numbers and verdicts: the pages are drawn by the tests below
        summary = build_report([man_runs], tmp_path / "rep")
    rows = {(r["method"], r["partition"]): r for r in _rows(tmp_path / "rep" / "man-table2.csv")}
    fa = rows[("FedAvg", "dirichlet-0.3")]
    assert float(fa["ours_top_eigenvalue"]) == 11.0 and fa["ours_top_eigenvalue_n"] == "2"
    assert math.isclose(float(fa["ours_top_eigenvalue_sd"]), math.sqrt(2))
    assert fa["model"] == "all-clients average"
    checks = {(c["reference"], c["metric"]): c for c in _rows(tmp_path / "rep" / "directions.csv")
              if c["partition"] == "dirichlet-0.3"}
    c = checks[("FedAvg", "top_eigenvalue")]
    se = math.sqrt(2 / 2 + 12.5 / 2)
    assert math.isclose(float(c["ours_uncertainty"]), se) and float(c["ours_change"]) == -0.5
    assert c["ours_direction"] == c["paper_direction"] == "lower" and c["verdict"] == "inconclusive"
    dyn = checks[("FedDyn", "top_eigenvalue")]
    # FedDyn+MAN's Hessian used 512 samples, the others the whole split: marked, and not judged
    assert dyn["verdict"] == "incomparable"
    assert rows[("FedDyn+MAN", "dirichlet-0.3")]["ours_top_eigenvalue_mark"] == "†"
    # FedAvg+MAN's asked 2048 of a 1437-image split: said, and its (capped) number is comparable
    assert any(n.startswith("fedavg-man-") and "2,048 samples asked" in n and "all 1,437 used" in n
               for n in summary["notices"])
    # the table shows mean +- sd (n) and names the model; the findings name the rows
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "11.00 ±1.4 (n=2)" in md and "all-clients average" in md
    assert "inconclusive: FedAvg+MAN vs FedAvg dirichlet-0.3" in md
    assert "1437 samples" in md and "1437 samples" in rows[("FedAvg", "dirichlet-0.3")]["ours_top_eigenvalue_setting"]


def test_agree_when_the_change_exceeds_twice_its_error(man_runs, tmp_path, reports_undrawn):
    # without FedDyn+MAN's 2048-sample analysis the FedDyn pair is comparable: 20.1 -> 10.1, se 0.141: agree
    import shutil

    src = tmp_path / "runs"
    shutil.copytree(man_runs, src)
    for d in src.glob("feddyn-man-*"):
        h = json.loads((d / AVERAGE_HESSIAN / "hessian.json").read_text())
        h["settings"]["samples"], h["num_samples"] = None, 1437
        (d / AVERAGE_HESSIAN / "hessian.json").write_text(json.dumps(h))
    with reports_undrawn():
        build_report([src], tmp_path / "rep")
    c = {(c["reference"], c["metric"]): c for c in _rows(tmp_path / "rep" / "directions.csv")}
    assert c[("FedDyn", "top_eigenvalue")]["verdict"] == "agree"
    assert math.isclose(float(c[("FedDyn", "top_eigenvalue")]["ours_uncertainty"]), math.sqrt(0.02))


@pytest.fixture(scope="module")
def fedalign_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fa-fake")
    for k, t in enumerate(plan(Selection("fedalign-table1", "tiny", seeds=(0,)), runs_dir=root)):
        _write_run(t, lam=5.0 + k, trace=40.0 + 3 * k, trace_se=1.0, acc=60 + k, model="server",
                   clients={"H_N": 30.0 + k, "H_N_stderr": 2.0, "H_D": 0.9, "H_D_stderr": 0.01}, surface=True)
    return root


def _text_leaks(fig) -> list[str]:
    """Every visible text that leaves the page, its table cell or (for texts placed in axes) its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.table import Table
    from matplotlib.text import Text

    FigureCanvasAgg(fig)
    drawn = []  # only the texts matplotlib actually draws (ticks outside the view limits exist but are not drawn)
    original = Text.draw

    def record(self, renderer):
        drawn.append(self)
        return original(self, renderer)

    Text.draw = record
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    drawn = set(map(id, drawn))
    r = fig.canvas.get_renderer()
    page = fig.bbox
    bad = []

    def inside(inner, outer, tol=1.0):
        return (inner.x0 >= outer.x0 - tol and inner.x1 <= outer.x1 + tol and inner.y0 >= outer.y0 - tol
                and inner.y1 <= outer.y1 + tol)

    for t in fig.findobj(Text):
        if id(t) not in drawn or not t.get_visible() or not t.get_text().strip():
            continue
        if not inside(t.get_window_extent(r), page):
            bad.append(f"off the page: {t.get_text()[:60]!r}")
    for table in fig.findobj(Table):
        for cell in table.get_celld().values():
            txt = cell.get_text()
            if txt.get_text().strip() and not inside(txt.get_window_extent(r), cell.get_window_extent(r)):
                bad.append(f"out of its cell: {txt.get_text()[:60]!r}")
    for ax in fig.axes:
        for t in ax.texts:
            if t.get_visible() and t.get_text().strip() and not inside(t.get_window_extent(r), ax.bbox):
                bad.append(f"out of its axes: {t.get_text()[:60]!r}")
    return bad


@pytest.fixture(scope="module")
def man_report(man_runs, tmp_path_factory):
    """The MAN Table 2 report of ``man_runs``, drawn once for the tests of its pages: (its folder, its summary, the
    figures of its PDF's pages in order, as :func:`conftest.pdf_pages` captures them)."""
    from conftest import capture_pdf_pages

    out = tmp_path_factory.mktemp("man-report") / "rep"
    with pytest.MonkeyPatch.context() as mp:
        captured = capture_pdf_pages(mp)
        summary = build_report([man_runs], out, tables=["man-table2"])
    return out, summary, captured


@pytest.mark.parametrize("which", ["man", "fedalign"])
def test_every_page_keeps_its_text_inside(which, man_report, fedalign_runs, tmp_path, pdf_pages):
    if which == "man":
        _, summary, captured = man_report
    else:
        summary, captured = build_report([fedalign_runs], tmp_path / "rep"), pdf_pages
    names = summary["pages"]
    assert len(captured) == len(names)
    if which == "man":
        assert any(n.startswith("man-table2: spectrum") for n in names)
    else:
        assert "fedalign-table1: surfaces" in names and "fedalign-table1: table" in names
    leaks = {name: _text_leaks(fig) for name, fig in zip(names, captured)}
    assert {k: v for k, v in leaks.items() if v} == {}


def test_the_extent_check_sees_a_leak():
    """The checker itself: a word far wider than its forced column is reported."""
    from flatfl.report.figure_pages import table_page

    fig = table_page("t", ["a", "b"], [["x" * 300, "y"]], col_widths=[0.1, 0.9])
    assert any("out of its cell" in b for b in _text_leaks(fig))


def test_other_protocols_are_never_shown_unmarked(fedalign_runs, tmp_path, reports_undrawn):
    """H_N / H_D of two protocols: where every run has one protocol, that one fills the column (the other said in a
    notice); a run that has only the other protocol gets a dagger, its direction checks are 'incomparable', and the
    settings of each row (protocol included) are in the Markdown table and runs.csv (which the 'Every run' pages
    show; the pages themselves are drawn and checked by test_every_page_keeps_its_text_inside)."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(fedalign_runs, runs)
    prox = next(runs.glob("fedprox-*"))
    (prox / CLIENTS_DIR / clients_file("fedalign")).write_text(json.dumps(
        {"protocol": "fedalign", "H_N": 999.0, "H_N_stderr": 1.0, "H_D": 0.5, "H_D_stderr": 0.01,
         "settings": {"protocol": "fedalign", "probes": 20, "samples": 640}}))
    with reports_undrawn():  # the tables, report.md and runs.csv (the pages: test_every_page_keeps_its_text_inside)
        s = build_report([runs], tmp_path / "a")
    rows = {r["method"]: r for r in _rows(tmp_path / "a" / "fedalign-table1.csv")}
    assert float(rows["FedProx"]["ours_hessian_norm_gap"]) != 999.0  # the common (default) protocol is used
    assert not any(r["ours_hessian_norm_gap_mark"] for r in rows.values())
    assert any("default and fedalign protocols" in n and "the default protocol's" in n for n in s["notices"])

    moon = next(runs.glob("moon-*"))
    moon_clients = moon / CLIENTS_DIR
    (moon_clients / clients_file("default")).rename(moon_clients / clients_file("fedalign"))
    data = json.loads((moon_clients / clients_file("fedalign")).read_text())
    data.update(protocol="fedalign", settings=dict(data["settings"], protocol="fedalign"))
    (moon_clients / clients_file("fedalign")).write_text(json.dumps(data))
    with reports_undrawn():
        build_report([runs], tmp_path / "b")
    rows = {r["method"]: r for r in _rows(tmp_path / "b" / "fedalign-table1.csv")}
    # no protocol common to all: the one most runs hold (default) wherever a run has it; MOON's own is marked
    assert float(rows["FedProx"]["ours_hessian_norm_gap"]) != 999.0
    marked = {m for m, r in rows.items() if r["ours_hessian_norm_gap_mark"]}
    assert marked == {"MOON"} == {m for m, r in rows.items() if r["ours_hessian_direction_mark"]}
    checks = [c for c in _rows(tmp_path / "b" / "directions.csv") if c["metric"].startswith("hessian_")]
    for c in checks:
        assert (c["verdict"] == "incomparable") == (c["compared"] in marked), c
    md = (tmp_path / "b" / "report.md").read_text()
    moon_line = next(ln for ln in md.splitlines() if ln.startswith("| MOON |"))
    assert "†" in moon_line and "H_N, H_D: protocol fedalign" in moon_line and "default" not in moon_line
    assert "H_N, H_D: protocol default" in next(ln for ln in md.splitlines() if ln.startswith("| FedAvg |"))
    assert {r["clients_protocol"] for r in _rows(tmp_path / "b" / "runs.csv")} == {"default", "fedalign"}


def test_density_panel_averages_slq_starts_and_states_its_width(tmp_path):
    """SLQ on a matrix with known eigenvalues: the panel's curve (every start averaged, Gaussian width sigma) is the
    sigma-smoothed density of the true eigenvalues (numpy eigh) within the sampling error of 32 starts, and much
    closer to it than one start; the width and the number of starts are printed on the panel, and the log axis starts at
    1e-4 of the peak with nothing drawn below it."""
    from types import SimpleNamespace

    import torch

    from flatfl.analysis import MatrixOperator, spectral_density
    from flatfl.report.figure_pages import format_number, spectrum_pair_page
    from flatfl.utils.plots import density_curves

    rng = np.random.default_rng(0)
    n = 60
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    lam = np.concatenate([rng.normal(0.0, 0.3, n - 6), [2.0, 2.5, 3.0, 4.0, 6.0, 9.0]])
    a = (q * lam) @ q.T
    true = np.linalg.eigvalsh(a)
    dens = spectral_density(MatrixOperator(torch.tensor(a)), steps=n, starts=32, seed=1).as_dict()
    one = {"nodes": dens["nodes"][:1], "weights": dens["weights"][:1]}
    grid, curves, sigma = density_curves({"all": [dens], "one": [one]})
    assert sigma == pytest.approx(0.01 * (max(max(t) for t in dens["nodes"]) - min(min(t) for t in dens["nodes"])))
    truth = np.exp(-((grid[:, None] - true[None, :]) ** 2) / (2 * sigma ** 2)).sum(1) / (n * sigma * np.sqrt(2 * np.pi))
    dx = grid[1] - grid[0]
    assert curves["all"].sum() * dx == pytest.approx(1.0, abs=1e-3)
    err_all = np.abs(curves["all"] - truth).sum() * dx  # L1 distance of two densities (0..2)
    err_one = np.abs(curves["one"] - truth).sum() * dx
    assert err_all < 0.6 * err_one and err_all < 0.15, (err_all, err_one)

    rec = [SimpleNamespace(method=m, hessian=None, spectrum={"top_eigenvalues": sorted(true)[::-1][:20], "density":
                                                              {"nodes": d["nodes"], "weights": d["weights"]}})
           for m, d in (("FedAvg", dens), ("FedAvg+MAN", {"nodes": [list(np.array(t) / 2) for t in dens["nodes"]],
                                                          "weights": dens["weights"]}))]
    fig = spectrum_pair_page([rec[0]], [rec[1]], "FedAvg vs FedAvg+MAN")
    ax_top, ax_dens = fig.axes
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    for ax in (ax_top, ax_dens):  # the panel titles (the smoothing width in (b)) inside the page
        ext = ax.title.get_window_extent(renderer)
        assert ext.x0 >= 0 and ext.x1 <= fig.bbox.width, ax.get_title()
    _, both, s2 = density_curves({"a": [rec[0].spectrum["density"]], "b": [rec[1].spectrum["density"]]})
    assert f"σ = {format_number(s2, 3)}" in ax_dens.get_title().replace("\n", " ")
    curves = [ln for ln in ax_dens.lines if "SLQ start" in ln.get_label()]
    assert [ln.get_label().endswith("32 SLQ starts") for ln in curves] == [True, True]
    assert ax_dens.get_yscale() == "log"
    peak = max(c.max() for c in both.values())
    assert ax_dens.get_ylim()[0] == pytest.approx(1e-4 * peak)
    for ln in curves:
        y = np.asarray(ln.get_ydata(), float)
        assert np.nanmin(y) >= 1e-4 * peak  # below the axis nothing is drawn (no floor line)
    # the MAN Fig. 4a panel: index against eigenvalue, both models on one axis, labelled
    assert [len(ln.get_xdata()) for ln in ax_top.lines] == [20, 20]
    (inset,) = ax_top.child_axes  # the same on a log axis: the tail under the top few eigenvalues shows
    assert inset.get_yscale() == "log" and [len(ln.get_xdata()) for ln in inset.lines] == [20, 20]
    assert ax_top.get_xlabel().startswith("eigenvalue index") and ax_top.get_legend() is not None


def test_surface_panels_share_one_colour_scale(tmp_path):
    """Two surfaces with very different losses: both panels use the same levels and norm (min of both, 98th
    percentile of both), one colour bar, and the axes name the two directions."""
    from types import SimpleNamespace

    from matplotlib.contour import ContourSet

    from flatfl.report.figure_pages import surface_page

    recs = []
    x = np.linspace(-1, 1, 7)
    for k, scale in enumerate((1.0, 10.0)):
        d = tmp_path / f"s{k}"
        d.mkdir()
        loss = scale * (x[:, None] ** 2 + x[None, :] ** 2) + 0.5
        np.savez(d / "surface.npz", x=x, y=x, loss=loss, done=np.ones_like(loss, dtype=bool))
        (d / "surface.json").write_text(json.dumps({"settings": {"directions": "random"}}))
        recs.append(SimpleNamespace(method=f"M{k}", partition="iid", seed=0, surface_path=d / "surface.npz"))
    fig = surface_page("surfaces", recs)
    sets = [c for ax in fig.axes for c in ax.collections if isinstance(c, ContourSet)]
    assert len(sets) == 2
    pooled = np.concatenate([(s * (x[:, None] ** 2 + x[None, :] ** 2) + 0.5).ravel() for s in (1.0, 10.0)])
    for cs in sets:
        np.testing.assert_allclose(cs.levels, sets[0].levels)
        assert cs.levels[0] == pytest.approx(0.5) and cs.levels[-1] == pytest.approx(np.quantile(pooled, 0.98))
        assert (cs.norm.vmin, cs.norm.vmax) == (sets[0].norm.vmin, sets[0].norm.vmax)
    bars = [cs.colorbar for cs in sets if cs.colorbar is not None]
    assert len(bars) == 1 and "shared" in bars[0].ax.get_ylabel()
    assert (bars[0].vmin, bars[0].vmax) == (sets[0].norm.vmin, sets[0].norm.vmax)
    panels = [ax for ax in fig.axes if ax is not bars[0].ax]
    assert len(panels) == 2
    assert all(ax.get_xlabel().endswith("direction 1") and ax.get_ylabel().endswith("direction 2") for ax in panels)


def test_pdfs_carry_no_creation_date(monkeypatch, tmp_path):
    """The same pages give the same bytes whenever they are rendered: the report's PDF and an analysis figure's PDF
    are rendered at two different (SOURCE_DATE_EPOCH) dates and must be equal, with no /CreationDate."""
    from matplotlib.figure import Figure

    from flatfl.analysis.commands.result_figures import figure_bytes
    from flatfl.report.pdf import write_pdf

    def draw(fig, ax):
        ax.plot([0, 1, 2], [2.0, 1.0, 3.0])

    rendered = []
    for epoch, name in (("1000000000", "a.pdf"), ("1700000000", "b.pdf")):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
        fig = Figure(figsize=(4, 3))
        draw(fig, fig.add_subplot(1, 1, 1))
        path = tmp_path / name
        write_pdf([fig], path)
        rendered.append((path.read_bytes(), figure_bytes(draw, "pdf")))
    (report_a, figure_a), (report_b, figure_b) = rendered
    assert report_a == report_b and figure_a == figure_b
    assert b"/CreationDate" not in report_a and b"/CreationDate" not in figure_a


def test_title_page_time_follows_source_date_epoch(monkeypatch):
    """The title page's time is SOURCE_DATE_EPOCH's when set (1e9 s after 1970 is 2001-09-09 01:46:40 UTC), so two
    reports of the same runs are the same bytes; a value that is no count of seconds is one ConfigError line."""
    from flatfl.errors import ConfigError

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1000000000")
    assert report_pdf.made_at() == "2001-09-09 01:46 UTC"
    for bad in ("-5", "soon", "1.5"):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", bad)
        with pytest.raises(ConfigError, match="SOURCE_DATE_EPOCH must be a non-negative integer"):
            report_pdf.made_at()
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    assert len(report_pdf.made_at()) == len("2026-11-23 15:31")


def test_the_forest_plot_is_page_one_and_its_own_files(man_report):
    """The first page is the forest plot of the report's comparisons, written beside it as effects.png and
    effects.pdf (listed in the folder's manifest, as the report's other files); each line it draws is a check of
    directions.csv at that check's change in % of its reference."""
    from flatfl.utils.manifest import MANIFEST

    out, summary, pdf_pages = man_report
    assert summary["pages"][:2] == ["effects", "summary"]
    assert {"effects.png", "effects.pdf"} <= set(summary["files"])
    assert (out / "effects.png").read_bytes().startswith(b"\x89PNG") and \
        (out / "effects.pdf").read_bytes().startswith(b"%PDF")
    assert {"effects.png", "effects.pdf"} <= set(json.loads((out / MANIFEST).read_text())["files"])
    first = pdf_pages[0]
    assert first.get_suptitle().startswith("Effects at a glance")
    checks = [c for c in _rows(out / "directions.csv") if c["metric"] == "top_eigenvalue"]
    (ax,) = [a for a in first.axes if a.get_title().startswith("top eigenvalue")]
    drawn = {t.get_text().split("  [")[0]: y for t, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    assert len(drawn) == len(checks)
    for c in checks:
        y = drawn[f"{c['compared']} vs {c['reference']} ({c['partition'].replace('dirichlet-', 'Dir ')})"]
        ref = float(c["ours_reference"])
        if c["paired_ci_low"] and c["verdict_from"].startswith("paired"):
            want = 100 * float(c["paired_change"]) / abs(ref)
        else:
            want = float(c["ours_change_pct"])
        xs = [float(x) for coll in ax.collections for x, yy in coll.get_offsets() if math.isclose(yy, y)]
        assert any(math.isclose(x, want, rel_tol=1e-9) for x in xs), (c, xs)
