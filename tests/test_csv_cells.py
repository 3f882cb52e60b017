"""CSV cells a spreadsheet would execute are neutralised in every CSV flatfl writes (the OWASP rule: a leading single
quote before =, +, -, @, tab or carriage return, plain numbers left alone), and flatfl reading its own CSVs gets the
original values back: the rule on hand-written cells, the round trip on every tricky start, and end to end through a
report re-rendered from a runs.csv whose run names and methods are formulas, a contrast labelled with formulas,
metrics.csv and per_layer.csv."""
from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from flatfl.report import build_report
from flatfl.report.contrast import write_contrast
from flatfl.report.runs_csv import read_runs_csv
from flatfl.utils.csv_cells import csv_cell, csv_row, read_csv_cell
from flatfl.utils.io import csv_text

REPORTS = Path(__file__).resolve().parent.parent / "reports"
FORMULAS = ["=cmd|' /C calc'!A0", "+1+1", "-2+3", "@SUM(A1:A2)", "\t=1", "\r=1", "=HYPERLINK(\"http://x\")", "-",
            "+", "=", "-1-1", "--1", "- 1"]
NUMBERS = ["-0.5", "+3", "-1e-05", "-inf", "+INF", "-nan", "-.5", "-5.", "1e308", "0", "12"]


def executable(cell: str) -> bool:
    """What a spreadsheet runs as a formula: a cell starting with =, +, -, @, tab or CR that is not a number."""
    if not cell or cell[0] not in "=+-@\t\r":
        return False
    try:
        float(cell)
        return False
    except ValueError:
        return True


def cells(text: str) -> list[str]:
    return [c for row in csv.reader(io.StringIO(text, newline="")) for c in row]


def test_the_rule_on_hand_written_cells():
    for text in FORMULAS:
        assert csv_cell(text) == "'" + text, text
    for text in NUMBERS + ["plain", "a=b", "", "'", "'quoted", "'-0.5", " =1"]:
        assert csv_cell(text) == text, text
    assert csv_cell("'=x") == "''=x" and csv_cell("''") == "'''"  # a quote that reading back would take away
    assert csv_cell(-0.5) == -0.5 and csv_cell(None) is None and csv_cell(True) is True
    assert csv_row({"a": "=1", "b": 2}) == {"a": "'=1", "b": 2} and csv_row(["@x", "y"]) == ["'@x", "y"]


def test_every_value_reads_back_as_written():
    tricky = FORMULAS + NUMBERS + ["", "'", "''", "'''", "'=x", "''=x", "'-0.5", "'hello", "x'", "'\t", "'@"]
    for text in tricky:
        assert read_csv_cell(csv_cell(text)) == text, text
        assert not executable(csv_cell(text)), text
    written = csv_text([{"name": t, "value": k} for k, t in enumerate(tricky)], ["name", "value"])
    assert not any(executable(c) for c in cells(written))
    back = list(csv.DictReader(io.StringIO(written, newline="")))
    assert [read_csv_cell(r["name"]) for r in back] == tricky


def test_a_report_and_a_contrast_neutralise_what_they_copy(tmp_path, reports_undrawn):
    """A runs.csv whose run names and methods are formulas: the re-rendered report's CSVs (runs.csv, the table's
    'runs' column, directions.csv) hold none a spreadsheet runs, and reading the new runs.csv back gives the
    original names; a contrast labelled with formulas likewise."""
    with open(REPORTS / "fedalign-table1-quick" / "runs.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    names = {rows[0]["run"]: "=cmd|' /C calc'!A0", rows[1]["run"]: "@SUM(1+1)*cmd|' /C calc'!A0",
             rows[2]["run"]: "-2+3+cmd|' /C calc'!A0"}
    for r in rows:
        r["run"] = names.get(r["run"], r["run"])
    rows[3]["method"] = "+cmd|' /C notepad'!A0"
    source = tmp_path / "runs.csv"
    with open(source, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    assert any(executable(c) for c in cells(source.read_text()))  # the input holds them
    with reports_undrawn():
        build_report([source], tmp_path / "report")
    written = sorted((tmp_path / "report").glob("*.csv"))
    assert {p.name for p in written} >= {"runs.csv", "fedalign-table1.csv", "directions.csv"}
    for path in written:
        assert not any(executable(c) for c in cells(path.read_text(encoding="utf-8"))), path.name
    table = (tmp_path / "report" / "fedalign-table1.csv").read_text(encoding="utf-8")
    assert "'=cmd|" in table  # the FedAvg row's runs, named in its 'runs' column
    again = read_runs_csv(tmp_path / "report" / "runs.csv")
    assert [r.name for r in again] == [r["run"] for r in rows]
    assert again[3].method == rows[3]["method"]

    labels = ["=A1+HYPERLINK(\"http://x\")", "@B"]
    write_contrast([REPORTS / "man-tables-fmnist", REPORTS / "man-tables-fmnist-cnn"], tmp_path / "contrast", labels)
    text = (tmp_path / "contrast" / "contrast.csv").read_text(encoding="utf-8")
    assert not any(executable(c) for c in cells(text))
    assert {read_csv_cell(r["report"]) for r in csv.DictReader(io.StringIO(text, newline=""))} == set(labels)


def test_metrics_and_per_layer_csv(tmp_path):
    from flatfl.analysis.estimators.per_layer import per_layer_csv
    from flatfl.report.run_reader import read_metrics
    from flatfl.train.run_folder import write_metrics

    write_metrics(tmp_path, [{"round": 1, "test_acc": -0.5, "note": "=1+1"}], extra=["note"])
    text = (tmp_path / "metrics.csv").read_text()
    assert not any(executable(c) for c in cells(text)) and "'=1+1" in text and ",-0.5," in text
    assert read_metrics(tmp_path / "metrics.csv")[0]["test_acc"] == -0.5
    block = {"module": "=cmd|' /C calc'!A0", "params": ["w"], "dim": 2, "method": "lanczos",
             "top_eigenvalues": [-1.5], "trace": -1.5, "trace_stderr": 0.0, "hvps": 3}
    text = per_layer_csv({"top": 1, "blocks": [block]})
    assert not any(executable(c) for c in cells(text))
    row = next(csv.DictReader(io.StringIO(text, newline="")))
    assert read_csv_cell(row["module"]) == block["module"] and float(row["eigenvalue_1"]) == -1.5


@pytest.mark.parametrize("text", ["=1", "-0.5", "'=1", "plain"])
def test_a_spreadsheet_cell_is_quoted_only_where_it_would_run(text):
    assert (csv_cell(text) != text) == (executable(text) or (text.startswith("'") and executable(text[1:])))
