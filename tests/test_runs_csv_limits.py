"""Re-rendering a runs.csv at the edges: a file with only the required columns renders (what it does not record said
as such); a value of 1e308, a 5,000-digit seed and a count beyond 2^63 are each one line naming the file, the line
and the column, with nothing written; a 20 kB and a 2 MB field render in seconds, kept whole in the new runs.csv and
cut on the PDF's pages (the quadratic step was the page layout of the whole text)."""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.report.bounded import field_limit
from flatfl.report.display import LINE_CHARS, shown
from flatfl.report.figure_pages import table_page
from flatfl.report.runs_csv import REQUIRED_COLUMNS

COMMITTED = Path(__file__).resolve().parent.parent / "reports" / "fedalign-table1-quick" / "runs.csv"


def lines_of(count: int = 3) -> list[dict]:
    """The committed FedAlign report's first ``count`` runs."""
    with open(COMMITTED, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))[:count]


def write(path: Path, rows: list[dict], columns=None) -> Path:
    columns = list(columns or rows[0])
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return path


def render(source: Path, out: Path):
    return CliRunner().invoke(main, ["report", str(source), "--out", str(out)])


def test_only_the_required_columns(tmp_path, reports_undrawn):
    source = write(tmp_path / "runs.csv", lines_of(), REQUIRED_COLUMNS)
    with reports_undrawn():
        r = render(source, tmp_path / "out")
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["runs"] == 3 and summary["tables"] == ["fedalign-table1"]
    assert "not recorded clients" in summary["ours_scale"] and ", not recorded, " in summary["ours_scale"]
    assert any("has no column" in n and "trace" in n for n in summary["notices"])


BAD = {
    "1e308": ("top_eigenvalue", "1e308", "column top_eigenvalue: 1e+308 is beyond +-1e+150"),
    "-1e200 trace": ("trace", "-1e200", "column trace: -1e+200 is beyond +-1e+150"),
    "5,000-digit seed": ("seed", "9" * 5000, "column seed: '9999999999999999999999999999999999999999'... "
                         "(5,000 characters) is not an integer in 0..4294967295"),
    "seed over --seed's range": ("seed", str(2**32), "column seed: '4294967296' is not an integer in 0..4294967295"),
    "5,000 zeros then 2^32": ("seed", "0" * 5000 + str(2**32), "column seed: '" + "0" * 40 + "'... (5,010 "
                              "characters) is not an integer in 0..4294967295"),
    "count beyond 2^63": ("hessian_samples", str(2**63), f"column hessian_samples: '{2**63}' is not an integer in "
                          f"0..{2**63 - 1}"),
    "long boolean": ("finished", "T" * 100_000, "column finished: 'TTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT'... "
                     "(100,000 characters) is not True or False"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_value_out_of_range_is_one_line(case, tmp_path, monkeypatch):
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    column, value, words = BAD[case]
    rows = lines_of()
    rows[1][column] = value
    source = write(tmp_path / "runs.csv", rows)
    r = render(source, tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and len(r.output) < 600, r.output
    assert f"{source} line 3, {words}" in r.output, r.output
    assert "internal error" not in r.output and "int_max_str_digits" not in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", [20_000, 2_000_000])
def test_a_long_field_renders_in_seconds(size, tmp_path):
    """Drawn in full (the PDF's pages are where the time went): the whole report within a minute even on a busy
    machine (before, a 2 MB field did not finish), the field whole in the new runs.csv."""
    rows = lines_of()
    rows[0]["hessian_method"] = "m" * size
    source = write(tmp_path / "runs.csv", rows)
    start = time.perf_counter()
    r = render(source, tmp_path / "out")
    took = time.perf_counter() - start
    assert r.exit_code == 0, r.output
    assert took < 60, took
    with open(tmp_path / "out" / "runs.csv", newline="", encoding="utf-8") as f, field_limit():
        assert next(csv.DictReader(f))["hessian_method"] == "m" * size
    assert (tmp_path / "out" / "report.pdf").stat().st_size > 0


def test_a_page_shows_a_long_line_cut_and_says_its_length():
    text = "x" * 2_000_000
    cut = shown(f"short\n{text}")
    assert cut.startswith("short\nxxx") and cut.endswith("... (2,000,000 characters)")
    assert len(cut.split("\n")[1]) == LINE_CHARS and shown("short") == "short"
    start = time.perf_counter()
    fig = table_page("a long cell", ["run", "method"], [[text, "FedAvg"]])
    assert time.perf_counter() - start < 30
    drawn = [cell.get_text().get_text() for ax in fig.axes for table in ax.tables
             for cell in table.get_celld().values()]
    assert max(len(t) for t in drawn) <= LINE_CHARS
    assert any(t.endswith("(2,000,000 characters)") for t in drawn)


def test_leading_zeros_are_read_as_the_number(tmp_path, reports_undrawn):
    rows = lines_of()
    rows[0]["seed"] = "0" * 5000 + rows[0]["seed"]
    with reports_undrawn():
        r = render(write(tmp_path / "runs.csv", rows), tmp_path / "out")
    assert r.exit_code == 0, r.output
    with open(tmp_path / "out" / "runs.csv", newline="", encoding="utf-8") as f:
        assert [line["seed"] for line in csv.DictReader(f)] == [line["seed"].lstrip("0") or "0" for line in rows]
