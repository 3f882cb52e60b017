"""The report's headline (flatfl.report.headline) and its forest plot sized to its lines (flatfl.report.forest).

The headline is checked on small runs.csv files whose per-seed values are chosen here, so that every count it says
was counted by hand: which changes fell, rose or stayed (a tie exact, and one within float rounding), which the
paired 95% t interval resolves, and the verdicts on the paper's direction (MAN Table 2's values, CIFAR-100: MAN
lowers the top eigenvalue and trace of FedAvg, FedSAM and FedDyn at Dirichlet 0.3 and raises their accuracy); then a
report without paper values, one with a single seed a side and an incomparable pair, and a contrast. The figure is
rendered to PNG and measured: its height grows with its lines, and it is never mostly blank."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flatfl.paper_tables import TABLES
from flatfl.report import build_report
from flatfl.report.forest import LINE_IN, MIN_HEIGHT, forest_figure, forest_page
from flatfl.report.headline import check_items, contrast_headline, headline, report_headline
from flatfl.report.tables import build_table
from flatfl.report.verdicts import direction_checks
from flatfl.utils.plots import saved
from test_report_contracts import Run as FakeRun  # what build_table reads of a run

REPORTS = Path(__file__).resolve().parent.parent / "reports"
DPI = 150  # flatfl's figures (flatfl.utils.plots)

# per method, per seed 0, 1, 2: (top eigenvalue, trace, accuracy %); the differences X+MAN - X per seed:
#   top eigenvalue  FedAvg -1, -1.2, -0.8 (resolved lower: sd 0.2); FedSAM -1, -1, -3 (its interval holds 0);
#                   FedDyn +1, +1.1, +0.9 (resolved higher)
#   trace           FedAvg 0, 0, 0 (no change); FedSAM 0, 0, 7e-15 (no change: float rounding);
#                   FedDyn -10, -9, -11 (resolved lower)
#   accuracy        FedAvg +2, +2, +2 (resolved higher); FedSAM +1, -1, +1 (holds 0); FedDyn -1, -1, -1 (resolved lower)
MAN_RUNS = {
    "FedAvg": ((10.0, 100.0, 80.0), (14.0, 110.0, 81.0), (12.0, 120.0, 82.0)),
    "FedAvg+MAN": ((9.0, 100.0, 82.0), (12.8, 110.0, 83.0), (11.2, 120.0, 84.0)),
    "FedSAM": ((10.0, 50.1, 80.0), (14.0, 50.2, 81.0), (12.0, 50.3, 82.0)),
    "FedSAM+MAN": ((9.0, 50.1, 81.0), (13.0, 50.2, 80.0), (9.0, 50.300000000000004, 83.0)),
    "FedDyn": ((10.0, 40.0, 80.0), (14.0, 44.0, 81.0), (12.0, 42.0, 82.0)),
    "FedDyn+MAN": ((11.0, 30.0, 79.0), (15.1, 35.0, 80.0), (12.9, 31.0, 81.0)),
}


def _runs_csv(path: Path, runs: dict, partition: str = "dirichlet-0.3") -> Path:
    """A runs.csv of the committed quick report's columns, one line per (method, seed) of ``runs``."""
    with open(REPORTS / "man-tables-quick" / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    template = rows[0]
    lines = []
    for method, seeds in runs.items():
        for seed, (lam, trace, acc) in enumerate(seeds):
            name = f"{method.lower().replace('+', '-')}-s{seed}"
            lines.append(dict(template, run=name, method=method, partition=partition, seed=str(seed),
                              top_eigenvalue=repr(lam), trace=repr(trace), test_acc=repr(acc),
                              all_test_acc=repr(acc), run_dir=f"runs/{name}"))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(template), lineterminator="\n")
        w.writeheader()
        w.writerows(lines)
    return path


@pytest.fixture(scope="module")
def man_headline(tmp_path_factory, reports_undrawn):
    root = tmp_path_factory.mktemp("headline")
    with reports_undrawn():
        summary = build_report([_runs_csv(root / "runs.csv", MAN_RUNS)], root / "report", tables=("man-table2",))
    return root / "report", summary


def test_the_headline_counts_each_metrics_changes_as_counted_by_hand(man_headline):
    out, summary = man_headline
    said = summary["headline"]
    assert said[0] == ("With MAN (X+MAN against X): "
                       "the top eigenvalue fell in 2 of 3 comparisons (1 resolved) and rose in 1 (1 resolved); "
                       "the trace fell in 1 of 3 comparisons (1 resolved) and was unchanged in 2; "
                       "the accuracy fell in 1 of 3 comparisons (1 resolved) and rose in 2 (1 resolved).")
    assert said[1] == ("Resolved: the 95% t interval of the per-seed differences (3 seeds) excludes 0; an "
                       "unresolved change is within the spread between seeds.")
    # the paper (MAN Table 2): MAN lowers both curvatures and raises accuracy in each of the three pairs
    assert said[2] == ("Against the paper's direction: top eigenvalue 1 agree, 1 disagree, 1 inconclusive; "
                       "trace 1 agree, 0 disagree, 2 inconclusive; accuracy 1 agree, 1 disagree, 1 inconclusive.")
    # digits, not the paper's CIFAR-100: said, with how to read the paper's numbers
    assert said[3].startswith("Not the paper's setting (dataset digits (paper cifar100); ")
    assert said[3].endswith("compare directions with the paper's, not sizes.")
    assert len(said) == 4


def test_the_headline_agrees_with_the_reports_own_checks(man_headline):
    """The resolved counts are directions.csv's effects, the verdict counts summary.json's: one source of truth."""
    out, summary = man_headline
    with open(out / "directions.csv", newline="") as f:
        checks = list(csv.DictReader(f))
    counts = summary["directions"]["man-table2"]
    assert counts["top_eigenvalue"]["effects"] == {"lower": 1, "higher": 1, "unresolved": 1}
    assert counts["trace"]["effects"] == {"lower": 1, "higher": 0, "unresolved": 2}
    assert {c["effect"] for c in checks if c["metric"] == "trace" and c["compared"] != "FedDyn+MAN"} == {"unresolved"}
    # the float-rounding tie is a change of 7e-15 / 3 in the report's own numbers, not exactly 0
    sam = next(c for c in checks if c["metric"] == "trace" and c["compared"] == "FedSAM+MAN")
    assert 0 < float(sam["paired_change"]) < 1e-13


def test_report_md_opens_with_the_headline(man_headline):
    out, summary = man_headline
    md = (out / "report.md").read_text().splitlines()
    assert md[0] == "# flatfl report"
    assert md[2] == "**What the tables found.** " + " ".join(summary["headline"])
    assert md[4].startswith("ours: ")


def test_without_paper_values_the_headline_says_so(tmp_path, reports_undrawn):
    """The SAM family's FedAvg against MoFedSAM and FedGAMMA: the paper gives neither; the methods share their
    reference, so they are said against it. MoFedSAM lowers the top eigenvalue in every seed (-2, -2.5, -1.5),
    FedGAMMA raises it within the seeds' spread (+1, -0.5, +2)."""
    runs = {"FedAvg": ((10.0, 100.0, 80.0), (12.0, 100.0, 80.0), (11.0, 100.0, 80.0)),
            "MoFedSAM": ((8.0, 90.0, 80.0), (9.5, 95.0, 80.0), (9.5, 92.0, 80.0)),
            "FedGAMMA": ((11.0, 100.0, 81.0), (11.5, 100.0, 79.0), (13.0, 100.0, 80.0))}
    with reports_undrawn():
        summary = build_report([_runs_csv(tmp_path / "runs.csv", runs)], tmp_path / "rep", tables=("sam-family",))
    said = summary["headline"]
    assert said[0] == ("Each method against FedAvg: "
                       "the top eigenvalue fell in 1 of 2 comparisons (1 resolved) and rose in 1 (none resolved); "
                       "the trace fell in 1 of 2 comparisons (1 resolved) and was unchanged in 1; "
                       "the accuracy was unchanged in 2 of 2 comparisons.")
    assert "The paper gives no value for these comparisons: there is no direction of its to agree with." in said
    assert not any("agree," in s for s in said)


class _Run(FakeRun):
    """A run whose top eigenvalue was measured with ``setting``."""

    def __init__(self, *args, setting="same", **kw):
        super().__init__(*args, **kw)
        self.setting_ = setting

    def setting(self, metric):
        return self.setting_


def _paper(method, value):
    return {"source": "MAN", "table": "Table 2", "method": method, "partition": "dirichlet-0.3",
            "metric": "top_eigenvalue", "value": value}


def _checks(runs, paper=()):
    spec = TABLES["man-table2"]
    return spec, direction_checks(spec, build_table(spec, runs, list(paper)))


def test_one_seed_a_side_and_incomparable_pairs_are_not_counted_as_findings():
    """FedAvg one seed a side (no interval: counted, never resolved); FedSAM's two sides measured with other
    settings (incomparable: no direction counted)."""
    runs = [_Run("FedAvg", 0, 10.0), _Run("FedAvg+MAN", 0, 7.0),
            _Run("FedSAM", 0, 10.0), _Run("FedSAM", 1, 11.0),
            _Run("FedSAM+MAN", 0, 5.0, setting="other"), _Run("FedSAM+MAN", 1, 6.0, setting="other")]
    _, checks = _checks(runs, [_paper("FedAvg", 20.0), _paper("FedAvg+MAN", 10.0)])
    assert sorted(c["verdict"] for c in checks) == ["incomparable", "too few seeds"]
    said = headline(check_items(checks))
    assert said[0] == ("With MAN (X+MAN against X): the top eigenvalue fell in 1 of 2 comparisons (none resolved), "
                       "1 incomparable (trained or measured otherwise).")
    assert said[1] == ("No change is resolved: no comparison has 2 seeds a side, so there is no interval between "
                       "seeds.")
    assert said[2] == ("Against the paper's direction: top eigenvalue 0 agree, 0 disagree, 0 inconclusive, 1 without "
                       "a verdict (fewer than 2 seeds a side), 1 incomparable.")


def test_a_report_without_comparisons_says_so():
    assert headline([]) == ["No comparison has our values on both sides, so there is no change to count."]
    assert report_headline([]) == ["No table layout matched these runs, so there is no comparison to count."]


def test_a_contrast_headline_is_each_reports_own():
    """Two reports' rows of one comparison: A resolves a fall (interval below 0), B a rise within its interval."""
    base = {"table": "man-table2", "partition": "dirichlet-0.3", "reference": "FedAvg", "compared": "FedAvg+MAN",
            "metric": "trace", "paired_seeds": 3, "paper_change_pct": -49.7}
    rows = [dict(base, report="A", ours_change_pct=-20.0, ci_low_pct=-30.0, ci_high_pct=-10.0, verdict="agree"),
            dict(base, report="B", ours_change_pct=5.0, ci_low_pct=-4.0, ci_high_pct=14.0, verdict="inconclusive")]
    said = contrast_headline(rows, ["A", "B"])
    assert said == [
        "A, with MAN (X+MAN against X): the trace fell in 1 of 1 comparison (1 resolved).",
        "A, against the paper's direction: trace 1 agree, 0 disagree, 0 inconclusive.",
        "B, with MAN (X+MAN against X): the trace rose in 1 of 1 comparison (none resolved).",
        "B, against the paper's direction: trace 0 agree, 0 disagree, 1 inconclusive.",
        "Resolved: the 95% t interval of the per-seed differences (3 seeds) excludes 0; an unresolved change is "
        "within the spread between seeds."]


# ------------------------------------------------------------------------------------------------ the figure
def _items(n: int) -> list[dict]:
    return [{"label": f"M{k}+MAN vs M{k}", "effect": ("lower", "higher", "unresolved")[k % 3],
             "change": -5.0 + k % 7, "low": -9.0 + k % 7, "high": -1.0 + k % 7, "how": "paired", "paper": -3.0}
            for k in range(n)]


def _png(fig) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(saved(fig, "png"))).convert("L"))


def _blank_share(pixels: np.ndarray) -> float:
    """The share of the image's pixel rows that are white from edge to edge."""
    return float((pixels.min(axis=1) >= 250).mean())


def _line_gap_inches(fig) -> float:
    """The smallest distance between two neighbouring comparison lines of the figure's panels, in inches."""
    fig.canvas.draw()
    gaps = []
    for ax in fig.axes:
        ys = sorted(ax.transData.transform([(0.0, y) for y in ax.get_yticks()])[:, 1])
        gaps += [b - a for a, b in zip(ys, ys[1:])]
    return min(gaps) / fig.dpi


@pytest.fixture(scope="module")
def pages():
    """One panel of 2, 30 and 80 comparison lines: each page, its PNG pixels."""
    out = {}
    for n in (2, 30, 80):
        fig = forest_page([("Table", [("top eigenvalue", _items(n))])], "scale line",
                          headline=["What was found, in a sentence.", "How sure it is, in another."])
        out[n] = (fig, _png(fig))
    return out


def test_the_figure_grows_with_its_lines(pages):
    heights = {n: px.shape[0] for n, (_, px) in pages.items()}
    assert heights[2] < heights[30] < heights[80]
    assert heights[2] >= MIN_HEIGHT * DPI - 1  # the shortest page
    # each line added takes its height: 50 more lines, about 50 line heights more
    assert (heights[80] - heights[30]) == pytest.approx(50 * LINE_IN * DPI, rel=0.02)
    assert {px.shape[1] for _, px in pages.values()} == {int(11.69 * DPI)}  # A4 landscape's width


def test_the_figure_is_not_mostly_blank_nor_cramped(pages):
    for n, (fig, px) in pages.items():
        assert _blank_share(px) < 0.3, n
        assert _line_gap_inches(fig) >= 0.95 * LINE_IN, n  # 80 lines as far apart as 30


def test_the_report_figure_carries_the_headline():
    runs = [FakeRun("FedAvg", s, v) for s, v in enumerate((10.0, 14.0, 12.0))] + \
        [FakeRun("FedAvg+MAN", s, v) for s, v in enumerate((9.0, 12.8, 11.2))]
    spec, checks = _checks(runs, [_paper("FedAvg", 20.0), _paper("FedAvg+MAN", 10.0)])
    fig = forest_figure([SimpleNamespace(spec=spec, checks=checks)], "scale line")
    from matplotlib.text import Text

    text = " ".join(" ".join(t.get_text().split()) for t in fig.findobj(Text))
    assert "With MAN (X+MAN against X): the top eigenvalue fell in 1 of 1 comparison (1 resolved)." in text
    assert "Against the paper's direction: top eigenvalue 1 agree, 0 disagree, 0 inconclusive." in text
    # one line: the page's shortest height
    assert math.isclose(fig.get_size_inches()[1], MIN_HEIGHT)


def test_summary_json_keeps_the_headline(man_headline):
    out, summary = man_headline
    assert json.loads((out / "summary.json").read_text())["headline"] == summary["headline"]


def test_unpaired_and_seedless_comparisons_say_how_they_were_judged():
    """FedAvg's two seeds and FedAvg+MAN's two others share none: judged unpaired, the change of the means (-5)
    against twice its standard error (sqrt(2) x 0.1: each side's sd 0.1414 / sqrt(2)), so resolved lower; FedSAM
    one seed a side: no interval; FedDyn paired by two seeds, its differences -1 and -3 (interval holds 0)."""
    runs = [FakeRun("FedAvg", 0, 10.0), FakeRun("FedAvg", 1, 10.2),
            FakeRun("FedAvg+MAN", 2, 5.0), FakeRun("FedAvg+MAN", 3, 5.2),
            FakeRun("FedSAM", 0, 10.0), FakeRun("FedSAM+MAN", 0, 12.0),
            FakeRun("FedDyn", 0, 10.0), FakeRun("FedDyn", 1, 12.0),
            FakeRun("FedDyn+MAN", 0, 9.0), FakeRun("FedDyn+MAN", 1, 9.0)]
    _, checks = _checks(runs)
    assert [c["verdict_from"].split(" ")[0] for c in checks] == ["unpaired", "none:", "paired,"]
    said = headline(check_items(checks))
    assert said[0] == ("With MAN (X+MAN against X): the top eigenvalue fell in 2 of 3 comparisons (1 resolved) and "
                       "rose in 1 (none resolved).")
    assert said[1] == ("Resolved where the 95% t interval of the per-seed differences over 2 seeds excludes 0 "
                       "(1 comparison), or unpaired, where the change of the means exceeds twice its standard "
                       "error (1); no interval with fewer than 2 seeds a side (1), counted unresolved.")
    assert said[2] == "The paper gives no value for these comparisons: there is no direction of its to agree with."
