"""The report: tables that carry each run's hessian.json values exactly, direction checks computed by hand, a PDF
with the expected pages (read back from its bytes), missing analyses listed or computed."""
from __future__ import annotations

import csv
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.paper_tables import TABLES
from flatfl.report import build_report, pdf_page_count
from flatfl.report.layouts import paper_values
from flatfl.report.pipeline import AnalysesAsked
from flatfl.report.records import method_label
from flatfl.report.tables import build_table, incomparable_notes
from flatfl.report.verdicts import direction_checks
from flatfl.sweep import RunTask, run_tasks

TINY = dict(dataset="digits", clients=4, participation=1.0, local_epochs=1, batch_size=50, eval_every=1,
            checkpoint_every=1, rounds=2, partition="dirichlet", alpha=0.3)
SPECTRUM = dict(top=3, tol=1e-2, trace=True, trace_hvps=6, trace_rtol=None, density=True, density_steps=6,
                samples=64, batch_size=64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reports_undrawn):
    """FedAvg and FedAvg+MAN with Hessian results (top 3, trace, density); FedDyn trained but not analysed. The
    analyses' own figures are not drawn (the report reads hessian.json; tests/test_figures.py draws them)."""
    root = tmp_path_factory.mktemp("report-runs")
    tasks = [RunTask("fedavg", str(root / "fedavg"), dict(TINY, algo="fedavg"), hessian=SPECTRUM, threads=1,
                     model="clients-average"),
             RunTask("fedavg-man", str(root / "fedavg-man"), dict(TINY, algo="fedavg", reg="man"),
                     hessian=SPECTRUM, threads=1, model="clients-average"),
             RunTask("feddyn", str(root / "feddyn"), dict(TINY, algo="feddyn"), threads=1)]
    with reports_undrawn(analyses=True):
        records = run_tasks(tasks)
    assert all(r["error"] is None for r in records), records
    return root


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _hessian(run: Path, folder: str = "hessian-clients-average") -> dict:
    """The MAN tables measure the all-clients average: its analysis lives in hessian-clients-average/."""
    return json.loads((run / folder / "hessian.json").read_text())


def _page_objects(data: bytes) -> int:
    """Independent of pdf_page_count: count the page objects themselves (/Type /Page, not /Pages)."""
    return len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", data))


def test_csv_values_equal_each_runs_hessian_json(runs, tmp_path, reports_undrawn):
    src = tmp_path / "runs"
    shutil.copytree(runs, src)
    with reports_undrawn():  # the tables (the PDF: test_pdf_has_the_expected_pages)
        summary = build_report([src / "fedavg", src / "fedavg-man"], tmp_path / "rep")
    assert summary["tables"] == ["man-table2"]
    table = {(r["method"], r["partition"]): r for r in _rows(tmp_path / "rep" / "man-table2.csv")}
    for name, method in (("fedavg", "FedAvg"), ("fedavg-man", "FedAvg+MAN")):
        h = _hessian(src / name)
        row = table[(method, "dirichlet-0.3")]
        assert float(row["ours_top_eigenvalue"]) == h["top_eigenvalues"][0]
        assert float(row["ours_trace"]) == h["trace"]["estimate"]
        assert float(row["ours_trace_se"]) == h["trace"]["stderr"]
        assert row["n_runs"] == "1" and row["runs"] == name
        with (src / name / "metrics.csv").open() as f:
            last = list(csv.DictReader(f))[-1]
        assert math.isclose(float(row["ours_accuracy"]), 100 * float(last["all_test_acc"]), rel_tol=1e-12)
    # the paper's numbers sit beside ours
    assert float(table[("FedAvg", "dirichlet-0.3")]["paper_top_eigenvalue"]) == 51.49
    assert float(table[("FedAvg+MAN", "dirichlet-0.6")]["paper_trace"]) == 4747
    assert table[("FedSAM", "dirichlet-0.3")]["ours_top_eigenvalue"] == ""  # no run: blank, not zero
    per_run = {r["run"]: r for r in _rows(tmp_path / "rep" / "runs.csv")}
    assert float(per_run["fedavg"]["top_eigenvalue"]) == _hessian(src / "fedavg")["top_eigenvalues"][0]


def test_direction_checks_by_hand(runs, tmp_path, reports_undrawn):
    with reports_undrawn():
        summary = build_report([runs / "fedavg", runs / "fedavg-man"], tmp_path / "rep")
    checks = {(c["partition"], c["metric"]): c for c in _rows(tmp_path / "rep" / "directions.csv")}
    base, man = _hessian(runs / "fedavg"), _hessian(runs / "fedavg-man")
    ours_lower = man["top_eigenvalues"][0] < base["top_eigenvalues"][0]
    c = checks[("dirichlet-0.3", "top_eigenvalue")]
    assert c["paper_direction"] == "lower"  # 51.49 -> 43.80 in MAN Table 2
    assert c["ours_direction"] == ("lower" if ours_lower else "higher")
    assert c["agrees"] == str(ours_lower)
    assert ("dirichlet-0.6", "top_eigenvalue") not in checks  # no runs there: nothing to compare

    def err(h):  # one seed: the eigensolver's own error estimate, else its residual norm
        est = (h.get("error_estimates") or [None])[0]
        return abs(est if est is not None else h["residuals"][0])

    d = man["top_eigenvalues"][0] - base["top_eigenvalues"][0]
    u = math.hypot(err(man), err(base))
    # one seed a side: the only error bar is the eigensolver's own, not the spread between seeds: no verdict
    assert c["verdict"] == "too few seeds" and math.isclose(float(c["ours_uncertainty"]), u)
    assert float(c["ours_change"]) == d
    counts = summary["directions"]["man-table2"]["top_eigenvalue"]
    verdicts = {"agree": 0, "disagree": 0, "inconclusive": 0, "no paper value": 0, "incomparable": 0,
                "too few seeds": 1}
    assert counts == {"compared": 1, **verdicts, "effects": {"lower": 0, "higher": 0, "unresolved": 1}, "paired": 0,
                      "unpaired": verdicts}
    assert c["effect"] == "unresolved"  # no interval between seeds
    assert c["verdict_from"] == "none: 1 / 1 seeds, 2 a side needed" and c["unpaired_verdict"] == c["verdict"]
    assert c["seeds_needed"] == ""  # no spread between seeds anywhere: said as '>= 2' in the tables
    # trace: 'resolved' is |change| > 2 sqrt(se_a^2 + se_b^2)
    t = checks[("dirichlet-0.3", "trace")]
    change = man["trace"]["estimate"] - base["trace"]["estimate"]
    unc = math.hypot(man["trace"]["stderr"], base["trace"]["stderr"])
    assert math.isclose(float(t["ours_change"]), change) and math.isclose(float(t["ours_uncertainty"]), unc)
    assert t["resolved"] == str(abs(change) > 2 * unc)
    assert t["verdict"] == "too few seeds"


def test_direction_rules_on_made_up_rows():
    spec = TABLES["man-table2"]

    class Rec:  # the attributes build_table reads
        def __init__(self, method, partition, lam, tr, se, seed=0, samples=1437):
            self.method, self.partition, self.seed, self.name, self.dataset = method, partition, seed, method, "x"
            self.model = "clients-average"
            self._v = {"top_eigenvalue": lam, "trace": tr, "accuracy": None}
            self._se, self._samples = se, samples

        def value(self, metric, column=None):
            return self._v[metric]

        def stderr(self, metric):
            return self._se if metric == "trace" else None

        def setting(self, metric):
            return f"lanczos, {self._samples} samples"

    recs = [Rec("FedDyn", "dirichlet-0.6", 10.0, 100.0, 1.0), Rec("FedDyn+MAN", "dirichlet-0.6", 12.0, 96.0, 2.0),
            Rec("FedDyn", "dirichlet-0.3", 4.0, 50.0, 1.0, seed=0), Rec("FedDyn", "dirichlet-0.3", 6.0, 70.0, 1.0, seed=1),
            Rec("FedDyn+MAN", "dirichlet-0.3", 3.0, 40.0, 1.0)]
    rows = build_table(spec, recs, paper_values())
    by = {(r.method, r.partition): r for r in rows}
    two = by[("FedDyn", "dirichlet-0.3")]
    assert two.cells["top_eigenvalue"].mean == 5.0 and two.n_runs == 2
    assert math.isclose(two.cells["top_eigenvalue"].sd, math.sqrt(2.0))  # sample sd of 4 and 6
    assert math.isclose(two.cells["trace"].se, math.sqrt(2.0) / 2)  # mean of two estimates, se 1 each
    checks = {(c["partition"], c["metric"]): c for c in direction_checks(spec, rows)
              if c["reference"] == "FedDyn"}
    up = checks[("dirichlet-0.6", "top_eigenvalue")]  # ours 10 -> 12 (higher); paper 47.03 -> 38.44 (lower)
    assert up["ours_direction"] == "higher" and up["paper_direction"] == "lower" and up["agrees"] is False
    assert up["resolved"] is None and up["verdict"] == "too few seeds"  # one seed a side: not judged
    tr = checks[("dirichlet-0.6", "trace")]  # 100 -> 96: |-4| < 2 sqrt(1 + 4) = 4.47, not resolved
    assert tr["agrees"] is True and math.isclose(tr["ours_uncertainty"], math.sqrt(5)) and tr["resolved"] is False
    assert tr["verdict"] == tr["unpaired_verdict"] == "too few seeds" and tr["seeds_needed"] is None
    lam = checks[("dirichlet-0.3", "top_eigenvalue")]  # 5 (two seeds) -> 3 (one run): one side has one seed
    assert lam["agrees"] is True and lam["resolved"] is None and lam["verdict"] == "too few seeds"
    # trace, delta 0.3: 60 +- sd 14.14 over 2 seeds (se of the mean 10) -> 40 +- 1 (estimator): one seed on the
    # compared side, no verdict; the seeds a side that would resolve a change of the paper's relative size at our
    # reference 60, guessed from the reference's spread x sqrt(2) (= 20): the smallest n with
    # t(0.975, n-1) * 20 / sqrt(n) below it
    t3 = checks[("dirichlet-0.3", "trace")]
    assert math.isclose(t3["ours_uncertainty"], math.hypot(math.sqrt(200) / math.sqrt(2), 1.0))
    assert t3["verdict"] == "too few seeds"
    from scipy import stats

    target = abs(t3["paper_size_change"])
    assert math.isclose(target, abs(t3["paper_change"]) / t3["paper_reference"] * 60.0)
    need = t3["seeds_needed"]
    assert stats.t.ppf(0.975, need - 1) * 20 / math.sqrt(need) < target <= \
        stats.t.ppf(0.975, need - 2) * 20 / math.sqrt(need - 1)
    # a clear change over two seeds a side: FedDC 100, 101 -> 50, 51 (paper: lower) agrees
    recs2 = [Rec("FedDC", "dirichlet-0.3", 1.0, 100.0, 1.0), Rec("FedDC+MAN", "dirichlet-0.3", 1.0, 50.0, 1.0),
             Rec("FedDC", "dirichlet-0.3", 1.0, 101.0, 1.0, seed=1),
             Rec("FedDC+MAN", "dirichlet-0.3", 1.0, 51.0, 1.0, seed=1),
             Rec("FedDC", "dirichlet-0.6", 1.0, 50.0, 1.0), Rec("FedDC+MAN", "dirichlet-0.6", 1.0, 100.0, 1.0,
                                                                  samples=512)]
    rows2 = build_table(spec, recs2, paper_values())
    c2 = {(c["partition"], c["metric"]): c for c in direction_checks(spec, rows2)}
    assert c2[("dirichlet-0.3", "trace")]["verdict"] == "agree"
    # other samples on one side: marked, and not judged
    assert c2[("dirichlet-0.6", "trace")]["verdict"] == "incomparable"
    by2 = {(r.method, r.partition): r for r in rows2}
    assert by2[("FedDC+MAN", "dirichlet-0.6")].cells["trace"].mark == "†"
    assert by2[("FedDC+MAN", "dirichlet-0.3")].cells["trace"].mark == ""
    # seeds of one row with different settings are never averaged: the mean keeps the column's common setting
    # (1437 samples), the 512-sample seed is left out and named in a note
    recs3 = recs2[:2] + recs2[4:] + [Rec("FedDC", "dirichlet-0.3", 9.0, 300.0, 1.0, seed=1, samples=512)]
    recs3[0].name, recs3[-1].name = "feddc-s0", "feddc-s1"
    rows3 = build_table(spec, recs3, paper_values())
    r3 = {(r.method, r.partition): r for r in rows3}[("FedDC", "dirichlet-0.3")].cells["trace"]
    assert r3.mean == 100.0 and r3.n == 1 and r3.mark == ""
    assert r3.left_out == "feddc-s1 (lanczos, 512 samples)"
    assert any("left out" in n and "feddc-s1" in n for n in incomparable_notes(spec, rows3))


def test_pdf_has_the_expected_pages(runs, tmp_path):
    summary = build_report([runs], tmp_path / "rep")
    data = (tmp_path / "rep" / "report.pdf").read_bytes()
    expected = ["effects", "summary", "man-table2: table", "man-table2: directions",
                "man-table2: spectrum FedAvg dirichlet-0.3", "man-table2: accuracy", "runs"]  # FedDyn (no Hessian) is in the table and on the accuracy page
    assert summary["pages"] == expected
    assert pdf_page_count(data) == _page_objects(data) == len(expected)
    assert data.startswith(b"%PDF") and data.rstrip().endswith(b"%%EOF")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| FedAvg | dirichlet-0.3 |" in md and "paper: CIFAR-100" in md and "ours: digits" in md
    written = sorted(p.name for p in (tmp_path / "rep").iterdir() if p.name != ".flatfl-manifest.json")
    assert written == sorted(summary["files"])  # no temporaries


def test_missing_results_are_listed_then_computed(runs, tmp_path, reports_undrawn):
    src = tmp_path / "runs"
    shutil.copytree(runs, src)
    with reports_undrawn():
        summary = build_report([src], tmp_path / "rep")
    assert summary["tables"] == ["man-table2"]  # FedDyn matches the layout too
    assert any(m.startswith("feddyn: no Hessian results") for m in summary["missing"])
    assert any("--compute-missing" in m for m in summary["missing"])
    row = {r["run"]: r for r in _rows(tmp_path / "rep" / "runs.csv")}["feddyn"]
    assert row["top_eigenvalue"] == ""

    with reports_undrawn():
        res = CliRunner().invoke(main, ["report", str(src), "--out", str(tmp_path / "rep2"), "--compute-missing",
                                        "--samples", "64"])
    assert res.exit_code == 0, res.output
    h = _hessian(src / "feddyn")
    assert h["settings"]["samples"] == 64 and h["settings"]["top"] == 1
    row = {r["run"]: r for r in _rows(tmp_path / "rep2" / "runs.csv")}["feddyn"]
    assert float(row["top_eigenvalue"]) == h["top_eigenvalues"][0]
    assert json.loads((tmp_path / "rep2" / "summary.json").read_text())["missing"] == []
    assert "agree with the paper's direction" in res.output
    assert "computed for feddyn: the Hessian of the all-clients average model into hessian-clients-average/" \
        in res.output


def test_a_report_that_stops_midway_is_not_marked_whole(runs, tmp_path, reports_undrawn):
    """summary.json, written last, marks a whole report: a second report into the same folder that fails after its
    tables takes the first one's summary.json away (the folder is not taken for a whole report of either)."""
    from flatfl.report import pipeline

    with reports_undrawn():
        build_report([runs / "fedavg", runs / "fedavg-man"], tmp_path / "rep")
    assert (tmp_path / "rep" / "summary.json").is_file()

    def broken(*args, **kwargs):
        raise RuntimeError("a page could not be drawn")

    with reports_undrawn(), pytest.MonkeyPatch.context() as mp, pytest.raises(RuntimeError, match="could not be"):
        mp.setattr(pipeline, "forest_figure", broken)  # the figure drawn after the tables
        build_report([runs / "fedavg", runs / "fedavg-man", runs / "feddyn"], tmp_path / "rep")
    assert (tmp_path / "rep" / "report.md").is_file() and not (tmp_path / "rep" / "summary.json").exists()


def test_user_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="holds no flatfl run"):
        build_report([tmp_path], tmp_path / "out")
    with pytest.raises(ConfigError, match="run directory not found"):
        build_report([tmp_path / "nope"], tmp_path / "out")
    res = CliRunner().invoke(main, ["report", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and res.output.startswith("flatfl: error: run directory not found")


def test_unknown_table_is_refused(runs, tmp_path):
    with pytest.raises(ConfigError, match="unknown table 'table9'"):
        build_report([runs / "fedavg"], tmp_path / "rep", tables=["table9"])


def test_method_labels_follow_the_papers():
    assert method_label({"algo": "fedavg"}) == "FedAvg"
    assert method_label({"algo": "fedavg", "local_opt": "sam"}) == "FedSAM"
    assert method_label({"algo": "fedsam"}) == "FedSAM"
    assert method_label({"algo": "fedasam", "reg": "man"}) == "FedASAM+MAN"
    assert method_label({"algo": "feddyn", "local_opt": "sam", "reg": "man"}) == "FedDyn(SAM)+MAN"
    assert method_label({"algo": "fedavg", "reg": "gradaug"}) == "FedAvg+GradAug"


def test_shipped_paper_values_equal_the_shared_spec():
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "spec" / "paper_values.csv"
    if not shared.is_file():
        pytest.skip("shared/spec/paper_values.csv is not beside this checkout")
    with shared.open() as f:
        want = [dict(r, value=float(r["value"])) for r in csv.DictReader(f)]
    assert paper_values() == want


def test_fedalign_layout_reads_the_clients_section(runs, tmp_path, reports_undrawn):
    """A FedAvg run on the FedML Dirichlet 0.5 split fills FedAlign Table 1; H_N / H_D come from the 'clients'
    section that flatfl.analysis.commands.clients_command.run_client_metrics adds to hessian.json."""
    run = tmp_path / "fedavg-fedml"
    shutil.copytree(runs / "fedavg", run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["config"].update(partition="fedml-dirichlet", alpha=0.5)
    (run / "config.json").write_text(json.dumps(cfg))
    import torch

    for name in ("final.pt", "final-clients-average.pt"):  # the checkpoints say the same (the report checks it)
        payload = torch.load(run / name, weights_only=True)
        payload["config"].update(partition="fedml-dirichlet", alpha=0.5)
        torch.save(payload, run / name)
    h = _hessian(run)
    h["clients"] = {"protocol": "default", "H_N": 3.25, "H_N_stderr": 0.5, "H_D": 0.875, "H_D_stderr": 0.01}
    (run / "hessian-clients-average" / "hessian.json").write_text(json.dumps(h))
    with reports_undrawn():
        summary = build_report([run], tmp_path / "rep", model="clients-average")
    assert summary["tables"] == ["fedalign-table1"] and summary["missing"] == []
    row = {r["method"]: r for r in _rows(tmp_path / "rep" / "fedalign-table1.csv")}["FedAvg"]
    assert float(row["ours_hessian_norm_gap"]) == 3.25 and float(row["ours_hessian_norm_gap_se"]) == 0.5
    assert float(row["ours_hessian_direction"]) == 0.875 and float(row["ours_top_eigenvalue"]) == h["top_eigenvalues"][0]
    assert float(row["paper_hessian_norm_gap"]) == 11360 and float(row["paper_accuracy"]) == 52.9
    assert float(row["ours_accuracy"]) == 100 * float(list(csv.DictReader((run / "metrics.csv").open()))[-1]["test_acc"])
    del h["clients"]
    (run / "hessian-clients-average" / "hessian.json").write_text(json.dumps(h))
    with reports_undrawn():
        missing = build_report([run], tmp_path / "rep2", model="clients-average")["missing"]
        with_cm = build_report([run], tmp_path / "rep3", analyses=AnalysesAsked(compute_missing=True),
                               model="clients-average")["missing"]
    assert any("no H_N / H_D" in m for m in missing)
    assert any("train with --save-clients" in m for m in with_cm)  # the run kept no client models


def test_final_clients_average_checkpoint(runs):
    """final-clients-average.pt: final.pt's all-clients average as the model, in the same format (FedDyn's server
    model differs from it); the Hessian of a MAN table row is computed on it."""
    import torch

    from flatfl.checkpoint import load_checkpoint

    for name in ("feddyn", "fedavg"):
        final = torch.load(runs / name / "final.pt", weights_only=True)
        avg = torch.load(runs / name / "final-clients-average.pt", weights_only=True)
        assert avg["model_role"] == "clients-average" and avg["format"] == final["format"]
        assert all(torch.equal(avg["state_dict"][k], final["all_state_dict"][k]) for k in final["state_dict"])
        same = all(torch.equal(final["state_dict"][k], final["all_state_dict"][k]) for k in final["state_dict"])
        assert avg["equals_server"] == same
        if name == "feddyn":
            assert not same  # FedDyn's server model is not the clients' average
        ck = load_checkpoint(runs / name / "final-clients-average.pt")
        assert all(torch.equal(v, avg["state_dict"][k]) for k, v in ck.model.state_dict().items())
    assert _hessian(runs / "fedavg")["checkpoint"].endswith("final-clients-average.pt")


def test_asked_settings_are_computed_apart_and_said(runs, tmp_path, reports_undrawn):
    """An existing Hessian with other settings is neither overwritten nor silently used: the asked one goes into a
    folder of its own, the report says so and uses it; without --compute-missing the run is listed as missing."""
    src = tmp_path / "runs"
    shutil.copytree(runs / "fedavg", src / "fedavg")
    before = (src / "fedavg" / "hessian-clients-average" / "hessian.json").read_bytes()
    with reports_undrawn():
        summary = build_report([src], tmp_path / "rep0", analyses=AnalysesAsked({"top": 2, "samples": 32}))
    assert any(m.startswith("fedavg: no Hessian results of the all-clients average model with the asked settings")
               for m in summary["missing"])
    with reports_undrawn(analyses=True):  # the numbers: neither the report's figures nor the analysis' drawn
        res = CliRunner().invoke(main, ["report", str(src), "--out", str(tmp_path / "rep"), "--compute-missing",
                                        "--top", "2", "--samples", "32"])
    assert res.exit_code == 0, res.output
    new = src / "fedavg" / "hessian-clients-average-samples32-top2" / "hessian.json"
    assert new.is_file() and (src / "fedavg" / "hessian-clients-average" / "hessian.json").read_bytes() == before
    h = json.loads(new.read_text())
    assert h["settings"]["top"] == 2 and h["settings"]["samples"] == 32 and h["num_samples"] == 32
    assert "into hessian-clients-average-samples32-top2/ (the analysis in hessian-clients-average/ has other " \
           "settings and is kept)" in res.output
    row = {r["run"]: r for r in _rows(tmp_path / "rep" / "runs.csv")}["fedavg"]
    assert float(row["top_eigenvalue"]) == h["top_eigenvalues"][0] and row["hessian_samples"] == "32"
    assert row["hessian_dir"] == "hessian-clients-average-samples32-top2"
    table = {(r["method"], r["partition"]): r for r in _rows(tmp_path / "rep" / "man-table2.csv")}
    assert "32 samples" in table[("FedAvg", "dirichlet-0.3")]["ours_top_eigenvalue_setting"]
    # asking for more samples than the split holds: said, and the table shows what was used
    with reports_undrawn():
        res = CliRunner().invoke(main, ["report", str(src), "--out", str(tmp_path / "rep2"), "--compute-missing",
                                        "--samples", "100000"])
    assert res.exit_code == 0, res.output
    assert "notice: fedavg: 100,000 samples asked for the Hessian, the split has 1,442: all 1,442 used" in res.output


def test_one_seed_report_gives_no_verdict(runs, tmp_path, pdf_pages):
    """One seed a side: the only error bar is the estimator's own, not the spread between seeds, so neither
    directions.csv, report.md, the PDF's direction pages nor the summary lines give an agree / disagree verdict;
    each check says why and that two seeds a side are the least that could resolve it."""
    from matplotlib.table import Table

    res = CliRunner().invoke(main, ["report", str(runs / "fedavg"), str(runs / "fedavg-man"), "--out",
                                    str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    checks = _rows(tmp_path / "rep" / "directions.csv")
    assert {c["metric"] for c in checks} == {"accuracy", "top_eigenvalue", "trace"}
    for c in checks:
        assert c["verdict"] == c["unpaired_verdict"] == "too few seeds", c
        assert c["seeds_reference"] == c["seeds_compared"] == "1" and c["verdict_from"].startswith("none: 1 / 1")
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    for counts in summary["directions"]["man-table2"].values():
        assert counts["agree"] == counts["disagree"] == counts["inconclusive"] == 0
        assert counts["too few seeds"] == counts["compared"] == 1
    lines = [ln for ln in res.output.splitlines() if ln.startswith("man-table2: ")]
    assert len(lines) == 3 and all("0 agree with the paper's direction, 0 disagree" in ln and
                                   "1 without a verdict (fewer than 2 seeds a side" in ln for ln in lines), lines
    md = (tmp_path / "rep" / "report.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| FedAvg+MAN vs FedAvg |")]
    assert len(rows) == 3 and all(ln.split(" | ")[-3:] == ["too few seeds", "too few seeds", ">= 2 |"] for ln in rows)
    assert not re.search(r"\b(agree|disagree|DISAGREE) with the paper:", md)
    pages = dict(zip(summary["pages"], pdf_pages))
    cells = [c.get_text().get_text() for table in pages["man-table2: directions"].findobj(Table)
             for c in table.get_celld().values()]
    assert sum(t == "too few seeds\n(too few seeds)" for t in cells) == 3 and cells.count(">= 2") == 3
    assert not any(t.startswith(("agree", "disagree")) for t in cells)


def test_the_smallest_eigenvalue_is_a_column_where_asked(runs, tmp_path, reports_undrawn):
    """``--smallest 1`` asked of the report computes the most negative eigenvalue beside the top one, and the table
    and runs.csv get its column, equal to each run's hessian.json; a report of runs without it has no such column
    (the committed reports' columns stay as they are), and a runs.csv re-rendered keeps it."""
    src = tmp_path / "runs"
    for name in ("fedavg", "fedavg-man"):
        shutil.copytree(runs / name, src / name)
    with reports_undrawn():
        build_report([src], tmp_path / "plain")
    assert not any(k.startswith("smallest") for k in _rows(tmp_path / "plain" / "runs.csv")[0])
    with reports_undrawn(analyses=True):
        res = CliRunner().invoke(main, ["report", str(src), "--out", str(tmp_path / "rep"), "--compute-missing",
                                        "--smallest", "1", "--samples", "64"])
    assert res.exit_code == 0, res.output
    rows = {r["run"]: r for r in _rows(tmp_path / "rep" / "runs.csv")}
    for name in ("fedavg", "fedavg-man"):
        h = _hessian(src / name, "hessian-clients-average-samples64-smallest1")
        low = h["smallest_eigenvalues"]
        assert h["settings"]["smallest"] == 1 and low["values"][0] <= h["top_eigenvalues"][0]
        assert float(rows[name]["smallest_eigenvalue"]) == low["values"][0]
        assert float(rows[name]["smallest_eigenvalue_stderr"]) == low["error_estimates"][0]
        assert rows[name]["smallest_eigenvalue_setting"] == "all-clients average, lanczos (tol 0.001), 64 samples"
    table = {(r["method"], r["partition"]): r for r in _rows(tmp_path / "rep" / "man-table2.csv")}
    fedavg = table[("FedAvg", "dirichlet-0.3")]
    assert float(fedavg["ours_smallest_eigenvalue"]) == float(rows["fedavg"]["smallest_eigenvalue"])
    assert fedavg["paper_smallest_eigenvalue"] == ""
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| top eigenvalue ours | top eigenvalue paper | smallest eigenvalue ours |" in md
    with reports_undrawn():
        build_report([tmp_path / "rep" / "runs.csv"], tmp_path / "again")
    again = {(r["method"], r["partition"]): r for r in _rows(tmp_path / "again" / "man-table2.csv")}
    assert again[("FedAvg", "dirichlet-0.3")]["ours_smallest_eigenvalue"] == fedavg["ours_smallest_eigenvalue"]
    # only the most negative (--top 0): computed once, then found (not listed as missing again)
    only = ["report", str(src), "--compute-missing", "--top", "0", "--smallest", "1", "--samples", "64"]
    with reports_undrawn(analyses=True):
        first = CliRunner().invoke(main, [*only, "--out", str(tmp_path / "low1")])
        second = CliRunner().invoke(main, [*only, "--out", str(tmp_path / "low2")])
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    assert first.output.count("computed for ") == 2 and "computed for " not in second.output
    assert json.loads((tmp_path / "low2" / "summary.json").read_text())["missing"] == []


def test_the_smallest_eigenvalues_setting_ignores_the_order_of_the_top_ones():
    """``--which`` orders the top eigenvalues, not the smallest ones: two analyses differing only in it give the
    smallest-eigenvalue column one setting (averaged together), while another split does mark it."""
    from types import SimpleNamespace

    from flatfl.report.metrics import report_metric

    def rec(**settings):
        h = {"num_samples": 64, "settings": dict({"tol": 1e-3, "split": "train"}, **settings),
             "smallest_eigenvalues": {"values": [-0.5], "residuals": [1e-9], "error_estimates": [None],
                                      "method": "lanczos"}}
        return SimpleNamespace(hessian=h, model="server")

    metric = report_metric("smallest_eigenvalue")
    assert metric.setting(rec(which="magnitude")) == metric.setting(rec(which="largest")) \
        == "server, lanczos (tol 0.001), 64 samples"
    assert metric.setting(rec(split="test")).endswith(", test split")
    assert metric.value(rec()) == -0.5 and metric.error(rec()) == 1e-9  # no estimate: the residual


def test_every_run_pages_show_the_smallest_eigenvalue_where_runs_csv_has_it(monkeypatch):
    from flatfl.report import figure_pages, pages

    seen = []
    monkeypatch.setattr(figure_pages, "table_page", lambda title, header, cells: seen.append((header, cells[0])))
    row = {"run": "a", "method": "FedAvg", "partition": "dirichlet-0.3", "seed": 0, "rounds_done": 2, "rounds": 2,
           "test_acc": 90.0, "all_test_acc": 89.0, "hessian_model": "server", "hessian_samples": 64,
           "hessian_method": "lanczos", "trace_method": "hutchpp", "top_eigenvalue": 2.0, "trace": 3.0,
           "trace_stderr": 0.1, "hessian_norm_gap": None, "hessian_direction": None, "clients_protocol": None}
    list(pages.run_pages([row]))
    list(pages.run_pages([dict(row, smallest_eigenvalue=-0.5)]))
    (plain, plain_cells), (low, low_cells) = seen
    assert "λmin" not in plain and plain[plain.index("λmax") + 1] == "trace"
    assert low[low.index("λmax") + 1] == "λmin" and low_cells[low.index("λmin")] == -0.5
    assert len(low) == len(low_cells) == len(plain) + 1
