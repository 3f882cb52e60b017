"""The report's forest plot (flatfl.report.forest) on hand-made checks: each line drawn at the change and interval
computed here by hand, in % of the reference's mean, the paper's change marked, the unresolved lines below the
resolved ones on their grey band; no training, no run folders."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from flatfl.paper_tables import TABLES
from flatfl.report.forest import forest_figure
from flatfl.report.tables import build_table
from flatfl.report.verdicts import direction_checks
from test_report_contracts import Run as FakeRun  # what build_table reads of a run

T975_2 = 4.302653  # Student's t(0.975, 2), from printed tables


def _paper(method, value):
    return {"source": "MAN", "table": "Table 2", "method": method, "partition": "dirichlet-0.3",
            "metric": "top_eigenvalue", "value": value}


@pytest.fixture(scope="module")
def drawn():
    """FedAvg 10, 14, 12 -> 9, 12.8, 11.2 (resolved lower, paper 20 -> 10); FedSAM 10, 14, 12 -> 9, 13, 9
    (interval holds 0); FedDyn one seed a side (no interval)."""
    runs = [FakeRun("FedAvg", s, v) for s, v in enumerate((10.0, 14.0, 12.0))] + \
        [FakeRun("FedAvg+MAN", s, v) for s, v in enumerate((9.0, 12.8, 11.2))] + \
        [FakeRun("FedSAM", s, v) for s, v in enumerate((10.0, 14.0, 12.0))] + \
        [FakeRun("FedSAM+MAN", s, v) for s, v in enumerate((9.0, 13.0, 9.0))] + \
        [FakeRun("FedDyn", 0, 10.0), FakeRun("FedDyn+MAN", 0, 7.0)]
    spec = TABLES["man-table2"]
    checks = direction_checks(spec, build_table(spec, runs, [_paper("FedAvg", 20.0), _paper("FedAvg+MAN", 10.0)]))
    fig = forest_figure([SimpleNamespace(spec=spec, checks=checks)], "scale line")
    fig.canvas.draw()
    (ax,) = [a for a in fig.axes if a.get_title().startswith("top eigenvalue")]
    return ax


def _line_y(ax, label: str) -> float:
    ticks = {t.get_text(): y for t, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    return ticks[label]


def _points_at(ax, y: float) -> list[tuple[float, str]]:
    """(x, marker face) of every scatter point drawn on the line at height y."""
    out = []
    for coll in ax.collections:
        faces = [tuple(round(float(v), 3) for v in f) for f in coll.get_facecolors()] or [None]  # None: hollow
        for k, (x, yy) in enumerate(coll.get_offsets()):
            if math.isclose(yy, y):
                out.append((float(x), faces[k % len(faces)]))
    return out


def _segments_at(ax, y: float) -> list[tuple[float, float]]:
    return [(min(line.get_xdata()), max(line.get_xdata())) for line in ax.get_lines()
            if len(line.get_xdata()) == 2 and all(math.isclose(v, y) for v in line.get_ydata())]


def test_each_change_at_its_paired_mean_and_interval_in_percent(drawn):
    y = _line_y(drawn, "FedAvg+MAN vs FedAvg (Dir 0.3)")
    # mean difference -1.0 over the reference's mean 12: -8.33%; interval -1 +- 4.3027 * 0.2 / sqrt(3), in % of 12
    half = T975_2 * 0.2 / math.sqrt(3)
    xs = sorted(x for x, _ in _points_at(drawn, y))
    paper = 100 * (10.0 - 20.0) / 20.0  # the paper's change, -50%
    assert xs == pytest.approx(sorted([100 * -1.0 / 12, paper]), abs=1e-9)
    (seg,) = _segments_at(drawn, y)
    assert seg == pytest.approx((100 * (-1.0 - half) / 12, 100 * (-1.0 + half) / 12), abs=1e-6)


def test_unresolved_lines_sit_apart_below_the_resolved(drawn):
    resolved = _line_y(drawn, "FedAvg+MAN vs FedAvg (Dir 0.3)")
    held = _line_y(drawn, "FedSAM+MAN vs FedSAM (Dir 0.3)")
    one_seed = _line_y(drawn, "FedDyn+MAN vs FedDyn (Dir 0.3)  [1 seed a side]")
    assert resolved > held and resolved > one_seed
    # the dashed line between them, and the grey band under it holding the unresolved ones
    dashed = [ln for ln in drawn.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 1 and held < dashed[0].get_ydata()[0] < resolved
    # FedSAM: diffs -1, -1, -3: mean -5/3, its interval in % of 12 holds 0, drawn hollow (white face)
    # its interval, sd sqrt(((2/3)^2 * 2 + (4/3)^2) / 2), [-37.8%, +10.0%], reaches past the panel's right edge
    # (0 and the changes, paper's included, padded by 8% of their range): cut there, with an arrow head
    half = T975_2 * math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2) / math.sqrt(3)
    low, high = 100 * (-5 / 3 - half) / 12, 100 * (-5 / 3 + half) / 12
    assert low < 0 < high
    right = 0 + 0.08 * 50.0  # the range is [-50, 0]: the paper's -50% to 0
    assert drawn.get_xlim()[1] == pytest.approx(right) and high > right
    (seg,) = _segments_at(drawn, held)
    assert seg == pytest.approx((low, right))
    assert any(ln.get_marker() == ">" and ln.get_xdata()[0] == pytest.approx(right) for ln in drawn.get_lines())
    [(x, face)] = _points_at(drawn, held)
    assert x == pytest.approx(100 * (-5 / 3) / 12) and face == (1.0, 1.0, 1.0, 1.0)
    # one seed a side: its change (-30%) alone, no interval
    assert [x for x, _ in _points_at(drawn, one_seed)] == pytest.approx([-30.0])
    assert _segments_at(drawn, one_seed) == []
    labels = {t.get_text(): t.get_color() for t in drawn.get_yticklabels()}
    assert labels["FedAvg+MAN vs FedAvg (Dir 0.3)"] == "black" and labels["FedSAM+MAN vs FedSAM (Dir 0.3)"] != "black"


def test_no_comparison_is_said_on_the_page():
    fig = forest_figure([])
    assert any("no comparison" in t.get_text() for t in fig.texts)
