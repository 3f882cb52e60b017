"""A report folder and a contrast folder are told apart, and neither is written over the other: ``flatfl contrast
--out REPORT`` and ``flatfl report --out CONTRAST`` are one line and a non-zero exit, every file of the folder (its
manifest included) byte for byte as before; so for folders of an older flatfl whose manifest records no kind; each
command still replaces its own earlier output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.report import build_report
from flatfl.report.contrast import write_contrast
from flatfl.utils.manifest import MANIFEST, recorded_kind

REPORTS = Path(__file__).resolve().parent.parent / "reports"
RUNS_CSV = REPORTS / "fedalign-table1-quick" / "runs.csv"
CONTRASTED = [REPORTS / "man-tables-fmnist", REPORTS / "man-tables-fmnist-cnn"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, reports_undrawn):
    """A report (re-rendered from a committed runs.csv, figures not drawn) and a contrast of two committed
    reports, each written by flatfl."""
    root = tmp_path_factory.mktemp("apart")
    with reports_undrawn():
        build_report([RUNS_CSV], root / "report")
    write_contrast(CONTRASTED, root / "contrast", ["MLP", "CNN"])
    return root / "report", root / "contrast"


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, words: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert words in result.output, result.output


def test_each_folder_records_its_kind(folders):
    report, contrast = folders
    assert recorded_kind(report) == "report" and recorded_kind(contrast) == "contrast"
    assert {"effects.png", "effects.pdf"} <= set(snapshot(report)) & set(snapshot(contrast))  # the shared names


def test_a_contrast_is_never_written_over_a_report(folders, monkeypatch):
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    report, _ = folders
    before = snapshot(report)
    refused(invoke("contrast", *CONTRASTED, "--out", report), f"{report} holds a flatfl report")
    assert snapshot(report) == before
    with pytest.raises(ConfigError, match="holds a flatfl report"):
        write_contrast(CONTRASTED, report)
    assert snapshot(report) == before


def test_a_report_is_never_written_over_a_contrast(folders, monkeypatch):
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    _, contrast = folders
    before = snapshot(contrast)
    refused(invoke("report", RUNS_CSV, "--out", contrast), f"{contrast} holds a flatfl contrast")
    assert snapshot(contrast) == before


def test_neither_is_written_into_a_runs_folder(tmp_path, monkeypatch):
    """A run's folder is its own (``flatfl train --force`` clears it): a report or a contrast there is refused."""
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.csv").write_text("round\n")
    before = snapshot(run)
    refused(invoke("report", RUNS_CSV, "--out", run), f"{run} holds a flatfl run (config.json): a report is never")
    refused(invoke("contrast", *CONTRASTED, "--out", run), f"{run} holds a flatfl run (config.json): a contrast")
    assert snapshot(run) == before and sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.csv"]


def test_folders_of_an_older_flatfl_are_told_by_their_files(folders, tmp_path, monkeypatch):
    """A manifest without a kind (an older flatfl's): the report's summary.json and the contrast's contrast.json
    tell them apart."""
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    copies = []
    for folder in folders:
        copy = tmp_path / folder.name
        copy.mkdir()
        for name, data in snapshot(folder).items():
            (copy / name).write_bytes(data)
        manifest = json.loads((copy / MANIFEST).read_text())
        del manifest["kind"]
        (copy / MANIFEST).write_text(json.dumps(manifest))
        assert recorded_kind(copy) is None
        copies.append(copy)
    report, contrast = copies
    before = [snapshot(report), snapshot(contrast)]
    refused(invoke("contrast", *CONTRASTED, "--out", report), "holds a flatfl report (summary.json")
    refused(invoke("report", RUNS_CSV, "--out", contrast), "holds a flatfl contrast (contrast.json")
    assert [snapshot(report), snapshot(contrast)] == before


def test_each_command_replaces_its_own_output(folders, reports_undrawn):
    report, contrast = folders
    write_contrast(CONTRASTED, contrast, ["MLP", "CNN"])
    assert recorded_kind(contrast) == "contrast"
    with reports_undrawn():
        build_report([RUNS_CSV], report)
    assert recorded_kind(report) == "report"


def test_an_interrupted_report_says_what_it_left(tmp_path, monkeypatch):
    """Ctrl-C while the report's files are written: each file written is whole, the set may be short, and the line
    says so (not "nothing half-written was kept"); summary.json, written last, is absent."""
    from flatfl.report import pdf

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    monkeypatch.setattr(pdf, "write_pdf", interrupted)  # Ctrl-C while report.pdf is drawn
    out = tmp_path / "report"
    res = invoke("report", RUNS_CSV, "--out", out)
    assert res.exit_code == 130, res.output
    assert res.output.strip() == (f"flatfl: interrupted; {out} holds the report's files written so far, each whole, "
                                  "but perhaps not all of them (summary.json, written last, marks a whole report): "
                                  "run the same command again"), res.output
    assert (out / "runs.csv").is_file() and not (out / "summary.json").exists()
