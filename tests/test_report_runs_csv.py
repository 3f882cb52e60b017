"""``flatfl report path/to/runs.csv``: a report re-rendered from its runs.csv alone.

* Round trip: a report built from hand-written run folders (real final.pt files, as tests/test_report_pages.py
  writes them; two seeds, a Hessian of other samples that must keep its dagger and 'incomparable' verdict, H_N / H_D,
  lambda_1/lambda_5), re-rendered from its own runs.csv through the command line, gives the same table CSVs,
  directions.csv and runs.csv (numbers within 1e-12, text equal), the same verdict counts, a forest plot and the
  notice saying what a runs.csv cannot give.
* Hostile files: each a one-line error naming the problem, a non-zero exit and nothing written.
* The committed reports whose run folders are gone re-render with their committed numbers.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.report import build_report
from flatfl.reproduce import Selection, plan
from flatfl.run_layout import analysis_dir
from test_report_pages import MAN_VALUES, _write_run  # hand-written run folders, checked against their final.pt

REPORTS = Path(__file__).resolve().parent.parent / "reports"
NOTICE = "re-rendered from runs.csv"
#: per (method, seed) the top eigenvalue: MAN's pairs and FedSAM for the SAM family's FedAvg vs FedSAM
VALUES = dict(MAN_VALUES, FedSAM=(9.0, 11.5))
#: the table columns that hold text or numbers, compared as numbers where both parse
RTOL = 1e-12


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _with_ratio(run_dir: Path, value: float) -> None:
    """A five-eigenvalue analysis records lambda_1 / lambda_5 (hessian.json's eigenvalue_ratio)."""
    f = run_dir / analysis_dir("hessian", "clients-average") / "hessian.json"
    h = json.loads(f.read_text())
    h["eigenvalue_ratio"] = {"k": 5, "value": value}
    f.write_text(json.dumps(h))


@pytest.fixture(scope="module")
def man_report(tmp_path_factory, reports_undrawn):
    """MAN Table 2 and the SAM family from 10 runs (two seeds of five methods), FedDyn+MAN's Hessian of 512
    samples (the others: the whole split), and a third FedAvg seed not finished. Its figures are not drawn: the
    tests compare its numbers with the re-rendered report's (which is drawn)."""
    from flatfl.report.records import method_label

    root = tmp_path_factory.mktemp("csv-man")
    for t in plan(Selection("man-table2", "tiny", seeds=(0, 1)), runs_dir=root / "runs"):
        method = method_label(t.settings | t.settings.get("params", {}))
        if method not in VALUES or t.settings["alpha"] != 0.3:
            continue
        lam = VALUES[method][t.settings["seed"]]
        _write_run(t, lam=lam, trace=10 * lam, trace_se=0.5, acc=90 + lam / 10, model="clients-average",
                   samples={"FedDyn+MAN": 512}.get(method, 1437))
        _with_ratio(Path(t.run_dir), 1.5 + lam / 100)
    killed = next(t for t in plan(Selection("man-table2", "tiny", seeds=(2,)), runs_dir=root / "runs")
                  if t.settings["algo"] == "fedavg" and not t.settings.get("reg") and t.settings["alpha"] == 0.3)
    _write_run(killed, lam=30.0, trace=300.0, trace_se=0.5, acc=50.0, model="clients-average")
    (Path(killed.run_dir) / "final.pt").unlink()  # stopped before its last round: in no column, listed
    with reports_undrawn():
        build_report([root / "runs"], root / "report", tables=("man-table2", "sam-family"))
    return root / "report"


@pytest.fixture(scope="module")
def fedalign_report(tmp_path_factory, reports_undrawn):
    """FedAlign Table 1 from two seeds of each method, with H_N / H_D (the server model); not drawn (as above)."""
    root = tmp_path_factory.mktemp("csv-fa")
    for k, t in enumerate(plan(Selection("fedalign-table1", "tiny", seeds=(0, 1)), runs_dir=root / "runs")):
        s = t.settings["seed"]
        _write_run(t, lam=5.0 + k + s, trace=40.0 + 3 * k - s, trace_se=1.0, acc=60 + k + s, model="server",
                   clients={"H_N": 30.0 + k + 2 * s, "H_N_stderr": 2.0, "H_D": 0.9 - s / 100, "H_D_stderr": 0.01})
    with reports_undrawn():
        build_report([root / "runs"], root / "report", tables=("fedalign-table1",))
    return root / "report"


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _same(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a == b
    return x == y or math.isclose(x, y, rel_tol=RTOL, abs_tol=0.0)


def _differences(original: Path, again: Path, key) -> list[str]:
    """Every cell of CSV ``again`` that is not ``original``'s (rows by ``key``, numbers within RTOL)."""
    a, b = _rows(original), _rows(again)
    if not a or list(a[0]) != list(b[0] if b else {}):
        return [f"{original.name}: other columns or no rows"]
    ka, kb = {key(r): r for r in a}, {key(r): r for r in b}
    if set(ka) != set(kb) or len(ka) != len(a):
        return [f"{original.name}: other rows"]
    return [f"{original.name} {k} {c}: {ka[k][c]!r} vs {kb[k][c]!r}" for k in ka for c in ka[k]
            if not _same(ka[k][c], kb[k][c])]


def _row_key(r):
    return r["method"], r["partition"]


def _check_key(r):
    return r["table"], r["partition"], r["reference"], r["compared"], r["metric"]


@pytest.mark.parametrize("which", ["man", "fedalign"])
def test_a_report_re_rendered_from_its_runs_csv_is_the_same_report(which, man_report, fedalign_report, tmp_path,
                                                                   pdf_pages):
    report = {"man": man_report, "fedalign": fedalign_report}[which]
    before = json.loads((report / "summary.json").read_text())
    tables = [a for k in before["tables"] for a in ("--table", k)]
    res = _invoke("report", report / "runs.csv", "--out", tmp_path / "again", *tables)
    assert res.exit_code == 0, res.output
    again = tmp_path / "again"
    after = json.loads((again / "summary.json").read_text())
    wrong = []
    for key in before["tables"]:
        wrong += _differences(report / f"{key}.csv", again / f"{key}.csv", _row_key)
    wrong += _differences(report / "directions.csv", again / "directions.csv", _check_key)
    wrong += _differences(report / "runs.csv", again / "runs.csv", lambda r: r["run"])
    assert not wrong, "\n".join(wrong[:10])
    assert after["directions"] == before["directions"] and after["tables"] == before["tables"]
    assert (again / "effects.png").stat().st_size > 0 and (again / "report.pdf").is_file()
    # the notice in summary.json, report.md and the PDF's title page; the training settings are not invented
    assert any(n.startswith(NOTICE) for n in after["notices"])
    assert NOTICE in (again / "report.md").read_text()
    title_page = " ".join(t.get_text() for fig in pdf_pages[-len(after["pages"]):][1:2] for t in fig.texts)
    assert NOTICE in " ".join(title_page.split()), title_page
    assert after["training"] is None and after["source"] == {"runs_csv": str(report / "runs.csv")}
    assert before["training"]  # the run folders' report has them
    # the per-run figures need the run folders: none in the re-rendered PDF
    assert not [p for p in after["pages"] if p.endswith((": accuracy", ": spectrum", ": surfaces"))]
    if which == "man":  # the dagger and the 'incomparable' pair survive (FedDyn+MAN's 512-sample Hessian)
        rows = {_row_key(r): r for r in _rows(again / "man-table2.csv")}
        assert rows[("FedDyn+MAN", "dirichlet-0.3")]["ours_top_eigenvalue_mark"] == "†"
        assert "512 samples" in rows[("FedDyn+MAN", "dirichlet-0.3")]["ours_top_eigenvalue_setting"]
        fam = {_row_key(r): r for r in _rows(again / "sam-family.csv")}
        assert float(fam[("FedAvg", "dirichlet-0.3")]["ours_eigenvalue_ratio"]) == (1.6 + 1.62) / 2
        assert rows[("FedAvg", "dirichlet-0.3")]["unfinished"].endswith("(3/2 rounds)")
        assert any("not finished" in m for m in after["missing"])


# ------------------------------------------------------------------------------------------------- hostile files
def _valid(tmp_path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and lines of a small valid runs.csv (the committed FedAlign report's first three runs)."""
    with open(REPORTS / "fedalign-table1-quick" / "runs.csv", newline="") as f:
        lines = list(csv.reader(f))
    return lines[0], lines[1:4]


def _write(path: Path, header, lines) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(lines)
    return path


def _set(header, lines, line: int, column: str, value: str):
    lines = [list(x) for x in lines]
    lines[line][header.index(column)] = value
    return header, lines


HOSTILE = {
    "not UTF-8": (lambda h, ls: None, "not UTF-8"),
    "empty": (lambda h, ls: ([], []), "is empty"),
    "header only": (lambda h, ls: (h, []), "a header and no runs"),
    "wrong header": (lambda h, ls: (["name", "value"], [["a", "1"]]), "not a flatfl runs.csv (no column run"),
    "negative seed": (lambda h, ls: _set(h, ls, 1, "seed", "-1"), "line 3, column seed: '-1' is not an integer"),
    "seed not a number": (lambda h, ls: _set(h, ls, 0, "seed", "zero"), "line 2, column seed"),
    "finished not a boolean": (lambda h, ls: _set(h, ls, 0, "finished", "maybe"),
                               "line 2, column finished: 'maybe' is not True or False"),
    "accuracy not finite": (lambda h, ls: _set(h, ls, 2, "test_acc", "nan"),
                            "line 4, column test_acc is not finite: 'nan'"),
    "accuracy over 100": (lambda h, ls: _set(h, ls, 0, "all_test_acc", "183"), "column all_test_acc: 183 is not"),
    "metric not a number": (lambda h, ls: _set(h, ls, 1, "top_eigenvalue", "large"),
                            "line 3, column top_eigenvalue is not a number: 'large'"),
    "negative error": (lambda h, ls: _set(h, ls, 1, "trace_stderr", "-2"), "column trace_stderr: -2 is negative"),
    "empty method": (lambda h, ls: _set(h, ls, 0, "method", " "), "line 2, column method: empty"),
    "unknown model": (lambda h, ls: _set(h, ls, 0, "hessian_model", "average"), "column hessian_model: 'average'"),
    "duplicate run": (lambda h, ls: _set(h, ls, 2, "run", ls[0][0]), "line 4, column run: "),
    "a field too many": (lambda h, ls: (h, [ls[0] + ["x"]] + ls[1:]), "line 2: "),
    "a field too few": (lambda h, ls: (h, [ls[0][:-2]] + ls[1:]), "line 2: "),
    "a column named twice": (lambda h, ls: (h + ["seed"], [x + ["0"] for x in ls]), "named twice"),
    "a NUL byte": (lambda h, ls: _set(h, ls, 1, "method", "Fed\x00Avg"), "line 3: a NUL byte"),
    "no rounds": (lambda h, ls: _set(h, ls, 0, "rounds", "0"), "line 2, column rounds: 0; every run has at least"),
    "no clients": (lambda h, ls: _set(h, ls, 0, "clients", "0"), "line 2, column clients: 0"),
    "smallest eigenvalue above the top one": (
        lambda h, ls: _set(*_set(h + ["smallest_eigenvalue"], [x + [""] for x in ls], 0, "top_eigenvalue", "2.5"),
                           0, "smallest_eigenvalue", "3.5"),
        "line 2, column smallest_eigenvalue: 3.5 is above the top eigenvalue 2.5"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_runs_csv_is_one_line_and_writes_nothing(case, tmp_path):
    header, lines = _valid(tmp_path)
    make, message = HOSTILE[case]
    path = tmp_path / "runs.csv"
    made = make(header, lines)
    if made is None:
        path.write_bytes(b"run,method\n\xff\xfe,x\n")
    else:
        _write(path, *made) if made[0] else path.write_text("")
    res = _invoke("report", path, "--out", tmp_path / "out")
    assert res.exit_code != 0, res.output
    assert message in res.output and str(path) in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_a_runs_csv_is_re_rendered_alone(man_report, tmp_path):
    """One source kind per report: a runs.csv beside a run folder, or with the options that need run folders, is
    refused in one line before anything is written."""
    runs = man_report / "runs.csv"
    for args, message in (([runs, man_report], "from one runs.csv alone"),
                          ([runs, "--compute-missing"], "need the run folders"),
                          ([runs, "--top", "5"], "need the run folders"),
                          ([runs, "--model", "server"], "numbers are of the all-clients average model"),
                          ([tmp_path / "nowhere.csv"], "runs.csv not found")):
        res = _invoke("report", *args, "--out", tmp_path / "out")
        assert res.exit_code != 0 and message in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
        assert not (tmp_path / "out").exists()


def test_rows_of_other_recorded_settings_are_not_averaged(man_report, tmp_path):
    """Two seeds of one row recorded with other data sets are not one experiment: refused, as for run folders."""
    rows = _rows(man_report / "runs.csv")
    first = next(k for k, r in enumerate(rows) if r["method"] == "FedAvg")
    rows[first]["dataset"] = "fashion-mnist"
    path = tmp_path / "runs.csv"
    _write(path, list(rows[0]), [list(r.values()) for r in rows])
    res = _invoke("report", path, "--out", tmp_path / "out")
    assert res.exit_code != 0 and "cannot be averaged as seeds" in res.output, res.output
    assert "dataset 'digits' vs 'fashion-mnist'" in res.output or "dataset 'fashion-mnist' vs 'digits'" in res.output


# ------------------------------------------------------------------------------------------- committed reports
@pytest.mark.parametrize("folder, tables", [("fedalign-table1-quick", ("fedalign-table1",)),
                                            ("man-tables-fmnist-cnn", ("man-table2", "man-table6"))])
def test_a_committed_report_re_renders_with_its_numbers(folder, tables, tmp_path, reports_undrawn):
    """Reports whose run folders are gone: every ours_* number of their tables as committed. Their runs.csv is read
    as an older flatfl wrote it (without the columns added since: top_eigenvalue_stderr, eigenvalue_ratio and each
    metric's settings): the top eigenvalue's standard error is then not recorded, so left empty."""
    committed = REPORTS / folder
    with open(committed / "runs.csv", newline="", encoding="utf-8") as f:
        lines = list(csv.DictReader(f))
    added = ("top_eigenvalue_stderr", "eigenvalue_ratio")
    old_columns = [c for c in lines[0] if c not in added and not c.endswith("_setting")]
    older = tmp_path / "runs.csv"
    with open(older, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=old_columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(lines)
    with reports_undrawn():  # the numbers (a re-render's pages: test_a_report_re_rendered_from_its_runs_csv_...)
        summary = build_report([older], tmp_path / "again")
    assert summary["tables"] == list(tables)
    for key in tables:
        ours = {_row_key(r): r for r in _rows(committed / f"{key}.csv")}
        again = {_row_key(r): r for r in _rows(tmp_path / "again" / f"{key}.csv")}
        assert set(ours) == set(again)
        compared = 0
        for k, row in ours.items():
            for col, v in row.items():
                if not col.startswith("ours_") or col.endswith(("_setting", "_mark", "_left_out")):
                    continue
                if col == "ours_top_eigenvalue_se":
                    assert again[k][col] == "", (k, col)  # not recorded in the old runs.csv: not invented
                    continue
                assert _same(v, again[k][col]), (key, k, col, v, again[k][col])
                compared += v != ""
        assert compared >= 10 * len(ours)  # mean, n, sd of each metric, the trace's se
    assert any(n.startswith(NOTICE) and str(older) in n for n in summary["notices"])
    assert any("top_eigenvalue_stderr" in n for n in summary["notices"])
