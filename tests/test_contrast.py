"""flatfl contrast: reports side by side, checked against hand-made reports whose changes and intervals are known,
against the committed reports, and against bad input."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.report.contrast import read_report, write_contrast

REPO = Path(__file__).resolve().parents[1]
HEADER = ("table,partition,reference,compared,metric,ours_reference,ours_compared,ours_change_pct,paper_change_pct,"
          "paired_ci_low,paired_ci_high,paired_seeds,verdict")


TABLE_HEADER = "table,method,partition,ours_trace,ours_trace_n,ours_trace_sd,paper_trace"


def make_report(folder: Path, rows: list[str], scale: str = "ours: test scale", values: list[str] = (),
                header: str = HEADER, **summary) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps({"ours_scale": scale, "tables": ["man-table2"], **summary}))
    (folder / "directions.csv").write_text("\n".join([header] + rows) + "\n")
    (folder / "man-table2.csv").write_text("\n".join([TABLE_HEADER] + list(values)) + "\n")
    return folder


# reference 10 -> 12 (+20%), paired interval of the difference [1, 3]: +10% .. +30% of the reference
A_ROWS = ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,10,12,20,-50,1,3,3,disagree",
          "man-table2,dirichlet-0.6,FedAvg,FedAvg+MAN,trace,10,9,-10,-48,-2,-0.5,3,agree",
          "man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,accuracy,80,81,1.25,27,-1,3,3,inconclusive"]
# reference 50 -> 40 (-20%), interval [-15, -5]: -30% .. -10%
B_ROWS = ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,50,40,-20,-50,-15,-5,3,agree",
          "man-table2,dirichlet-0.6,FedAvg,FedAvg+MAN,trace,50,45,-10,-48,-8,-2,3,agree",
          "man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,accuracy,70,72,2.857,27,,,1,too few seeds",
          "man-table2,dirichlet-0.3,FedSAM,FedSAM+MAN,trace,5,4,-20,-45,-2,-0.1,3,agree"]


def test_side_by_side_numbers_counts_and_directions(tmp_path):
    a = make_report(tmp_path / "mlp", A_ROWS, "ours: fashion-mnist, mlp",
                    ["man-table2,FedAvg,dirichlet-0.3,10,3,0.5,8744", "man-table2,FedDC,dirichlet-0.3,9,3,0.5,3578"])
    b = make_report(tmp_path / "cnn", B_ROWS, "ours: fashion-mnist, cifar-cnn",
                    ["man-table2,FedAvg,dirichlet-0.3,50,1,,8744"])
    out = tmp_path / "contrast"
    summary = write_contrast([a, b], out, ["MLP", "CNN"])
    assert summary["comparisons"] == 3  # FedSAM's row is in one report only
    rows = list(csv.DictReader((out / "contrast.csv").open()))
    got = {(r["report"], r["partition"], r["metric"]): r for r in rows}
    r = got[("MLP", "dirichlet-0.3", "trace")]
    assert float(r["ci_low_pct"]) == pytest.approx(10.0) and float(r["ci_high_pct"]) == pytest.approx(30.0)
    r = got[("CNN", "dirichlet-0.3", "trace")]
    assert float(r["ci_low_pct"]) == pytest.approx(-30.0) and float(r["ci_high_pct"]) == pytest.approx(-10.0)
    assert got[("CNN", "dirichlet-0.3", "accuracy")]["ci_low_pct"] == ""
    counts = summary["counts"]
    assert counts["MLP"]["trace"] == dict(counts["MLP"]["trace"], agree=1, disagree=1, inconclusive=0, compared=2)
    assert counts["CNN"]["accuracy"]["too few seeds"] == 1
    trace_line = next(s for s in summary["together"] if s.startswith("trace"))
    # dirichlet-0.3: MLP up, CNN down (opposite); dirichlet-0.6: both down (same)
    assert "MLP and CNN both resolve (95% paired interval excluding 0) 2 of 2 changes: 1 the same way, 1 opposite ways." in trace_line
    acc_line = next(s for s in summary["together"] if s.startswith("accuracy"))
    assert "CNN 0 agree, 0 disagree, 0 inconclusive, 1 without a verdict" in acc_line
    assert "excluding 0) 0 of 1 changes" in acc_line
    md = (out / "contrast.md").read_text()
    assert "ours: fashion-mnist, cifar-cnn" in md
    assert "| man-table2 | FedAvg+MAN vs FedAvg | dirichlet-0.3 | -50.0% | +20.0% [+10.0, +30.0] disagree | " \
           "-20.0% [-30.0, -10.0] agree |" in md
    # the values side by side: the rows both reports hold; one seed shows no spread
    assert "| method | partition | trace MLP | trace CNN | trace paper |" in md
    assert "| FedAvg | dirichlet-0.3 | 10.00 ±0.5 (n=3) | 50.00 | 8,744 |" in md and "FedDC" not in md
    assert json.loads((out / "contrast.json").read_text())["together"] == summary["together"]


def test_committed_reports_contrast_as_their_directions_say(tmp_path):
    mlp, cnn = REPO / "reports" / "man-tables-fmnist", REPO / "reports" / "man-tables-fmnist-cnn"
    res = CliRunner().invoke(main, ["contrast", str(mlp), str(cnn), "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1].startswith("36 comparisons in 2 reports -> ")
    rows = list(csv.DictReader((tmp_path / "c" / "contrast.csv").open()))
    for name, folder in (("man-tables-fmnist", mlp), ("man-tables-fmnist-cnn", cnn)):
        source = {(d["table"], d["partition"], d["reference"], d["metric"]): d
                  for d in csv.DictReader((folder / "directions.csv").open())}
        mine = [r for r in rows if r["report"] == name]
        assert len(mine) == 36
        for r in mine:
            d = source[(r["table"], r["partition"], r["reference"], r["metric"])]
            assert r["verdict"] == d["verdict"]
            if d["paired_ci_low"]:
                assert float(r["ci_low_pct"]) == pytest.approx(
                    100 * float(d["paired_ci_low"]) / abs(float(d["ours_reference"])))


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "summary.json").unlink(), "is not a flatfl report folder: it has no summary.json"),
    (lambda f: (f / "summary.json").write_text("{"), "summary.json: not JSON"),
    (lambda f: (f / "summary.json").write_text("[1]"), "not a flatfl report summary"),
    (lambda f: (f / "directions.csv").write_text("a,b\n1,2\n"), "not a flatfl directions table (no column"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0].replace(",10,12,", ",ten,12,") + "\n"),
     "line 2: ours_reference is not a number: 'ten'"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0].replace(",10,12,", ",nan,12,") + "\n"),
     "ours_reference is not finite"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0].replace("disagree", "maybe") + "\n"),
     "unknown verdict 'maybe'"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0] + "\n" + A_ROWS[0] + "\n"),
     "appears twice"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0].rsplit(",", 1)[0] + "\n"),
     "not as many fields as the header"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0].replace(",3,disagree", ",2.5,disagree")
                                                 + "\n"), "paired_seeds must be a count"),
    (lambda f: (f / "directions.csv").write_bytes(b"\xff\xfe" * 10), "not UTF-8 text"),
    (lambda f: (f / "man-table2.csv").unlink(), "it has no man-table2.csv"),
    (lambda f: (f / "man-table2.csv").write_text("a\n1\n"), "not a flatfl table"),
    (lambda f: (f / "man-table2.csv").write_text(TABLE_HEADER + "\nman-table2,FedAvg,dirichlet-0.3,x,3,1,2\n"),
     "ours_trace is not a number"),
    (lambda f: (f / "summary.json").write_text(json.dumps({"ours_scale": "s", "tables": ["../../etc/passwd"]})),
     "is not a table name"),
    (lambda f: (f / "directions.csv").write_text(HEADER + "\n" + A_ROWS[0].replace("man-table2", "x" * 200_000, 1)
                                                 + "\n"), "line 2: 'xxxxxxxxxx"),
    (lambda f: (f / "summary.json").write_text(json.dumps({"ours_scale": "s", "tables": ["man-table99"]})),
     "'man-table99' is not a table flatfl knows (damaged or not flatfl's)"),
    (lambda f: (f / "summary.json").write_text(json.dumps({"ours_scale": "s", "tables": ["man-table2"],
                                                           "training": {"man-table2": [{"method": "FedAvg"}]}})),
     "'training' is not each table's rows"),
])
def test_a_damaged_report_is_one_line_and_nothing_written(tmp_path, damage, message):
    a = make_report(tmp_path / "a", A_ROWS)
    b = make_report(tmp_path / "b", B_ROWS)
    damage(b)
    res = CliRunner().invoke(main, ["contrast", str(a), str(b), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert len(res.output) < 500  # a damaged field is named by its start, never copied whole
    assert not (tmp_path / "out").exists()


def test_bad_arguments(tmp_path):
    a = make_report(tmp_path / "a", A_ROWS)
    b = make_report(tmp_path / "b", B_ROWS)
    c = make_report(tmp_path / "c", ["man-table6,dirichlet-0.3,FedSpeed,FedSpeed+MAN,trace,1,2,100,-10,,,0,"
                                     "too few seeds"])
    with pytest.raises(ConfigError, match="two or more report folders"):
        write_contrast([a], tmp_path / "o")
    with pytest.raises(ConfigError, match="1 --label for 2 reports"):
        write_contrast([a, b], tmp_path / "o", ["x"])
    with pytest.raises(ConfigError, match="labels must be distinct"):
        write_contrast([a, b], tmp_path / "o", ["x", "x"])
    with pytest.raises(ConfigError, match="labels must be distinct"):
        write_contrast([a, b], tmp_path / "o", ["x", "a|b"])
    with pytest.raises(ConfigError, match="share no comparison"):
        write_contrast([a, c], tmp_path / "o")
    with pytest.raises(ConfigError, match="is not a folder"):
        read_report(tmp_path / "nowhere")
    assert not (tmp_path / "o").exists()


def test_a_users_file_in_the_output_folder_is_never_replaced(tmp_path):
    a = make_report(tmp_path / "a", A_ROWS)
    b = make_report(tmp_path / "b", B_ROWS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "contrast.md").write_text("my notes")
    res = CliRunner().invoke(main, ["contrast", str(a), str(b), "--out", str(out)])
    assert res.exit_code == 2 and "was not written by flatfl" in res.output
    assert (out / "contrast.md").read_text() == "my notes" and not (out / "contrast.csv").exists()
    # flatfl's own earlier output is replaced
    out2 = tmp_path / "out2"
    write_contrast([a, b], out2)
    write_contrast([b, a], out2)
    assert list(csv.DictReader((out2 / "contrast.csv").open()))[0]["report"] == "b"


def test_a_second_writer_of_one_output_folder_is_refused(tmp_path, hold_lock):
    """Another process holds --out's lock (a contrast or report writing there): one line, exit 2, nothing written."""
    a = make_report(tmp_path / "a", A_ROWS)
    b = make_report(tmp_path / "b", B_ROWS)
    out = tmp_path / "out"
    hold_lock(out)
    res = CliRunner().invoke(main, ["contrast", str(a), str(b), "--out", str(out)])
    assert res.exit_code == 2 and "another flatfl process" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (out / "contrast.md").exists()


# ------------------------------------------------------------------ what the reports were trained with, and seeds
def _training(**rows) -> dict:
    """summary.json's ``training`` of man-table2: 'FedAvg' / 'FedAvg+MAN' (dirichlet-0.3) -> their settings."""
    return {"man-table2": [{"method": m.replace("_MAN", "+MAN"), "partition": "dirichlet-0.3", "settings": s}
                           for m, s in rows.items()]}


BASE = {"dataset": "digits", "lr": "0.1", "batch_size": "50", "params.rho": "0.05", "algo": "fedavg"}


def test_contrast_names_the_training_settings_in_which_the_reports_differ(tmp_path):
    """A: every row lr 0.1; B: lr 0.05, and its FedAvg+MAN row rho 0.5 and batch size 32: the contrast names each
    with both reports' values (and the row, where not every row differs)."""
    a = make_report(tmp_path / "a", A_ROWS, training=_training(FedAvg=BASE, FedAvg_MAN=dict(BASE, reg="man")))
    b = make_report(tmp_path / "b", B_ROWS, training=_training(
        FedAvg=dict(BASE, lr="0.05"), FedAvg_MAN=dict(BASE, reg="man", lr="0.05", batch_size="32",
                                                      **{"params.rho": "0.5"})))
    res = CliRunner().invoke(main, ["contrast", str(a), str(b), "--label", "A", "--label", "B",
                                    "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    line = ("settings that differ: lr 0.1 (A) vs 0.05 (B); batch-size 50 (A) vs 32 (B) in FedAvg+MAN dirichlet-0.3; "
            "rho 0.05 (A) vs 0.5 (B) in FedAvg+MAN dirichlet-0.3")
    assert line in res.output.splitlines()
    assert f"- {line}" in (tmp_path / "c" / "contrast.md").read_text().splitlines()
    summary = json.loads((tmp_path / "c" / "contrast.json").read_text())
    assert summary["settings_that_differ"][0] == "lr 0.1 (A) vs 0.05 (B)"
    assert summary["settings_read_from"] == "training"
    # trained alike: said so, nothing named
    b2 = make_report(tmp_path / "b2", B_ROWS, training=_training(FedAvg=BASE, FedAvg_MAN=dict(BASE, reg="man")))
    assert write_contrast([a, b2], tmp_path / "c2")["settings_that_differ"] == []
    assert "settings that differ: none" in (tmp_path / "c2" / "contrast.md").read_text()


def test_reports_without_a_training_record_are_told_apart_by_their_differences_from_the_paper(tmp_path):
    """man-table2's paper setting has lr 0.1: a report naming no lr difference ran at 0.1."""
    a = make_report(tmp_path / "a", A_ROWS, differences_from_paper={
        "man-table2": "differs from the paper: dataset digits (paper cifar100); local epochs 2 (paper 5)"})
    b = make_report(tmp_path / "b", B_ROWS, differences_from_paper={
        "man-table2": "differs from the paper: dataset digits (paper cifar100); local epochs 1 (paper 5); "
                      "lr 0.05 (paper 0.1)"})
    summary = write_contrast([a, b], tmp_path / "c", ["A", "B"])
    assert summary["settings_that_differ"] == ["local epochs 2 (A) vs 1 (B)", "lr 0.1 (A) vs 0.05 (B)"]
    assert summary["settings_read_from"] == "differences_from_paper"
    # neither record: the reader is told the settings are not known
    c = make_report(tmp_path / "c0", B_ROWS)
    assert write_contrast([a, c], tmp_path / "c3")["settings_that_differ"] is None
    assert "settings that differ: not known" in (tmp_path / "c3" / "contrast.md").read_text()


def test_the_forest_plot_draws_each_reports_change_and_interval_in_the_comparisons_order(tmp_path):
    """effects.png: one panel per table, metric and report; each line the change and paired interval of the contrast
    rows (hand-computed above: MLP +20% [+10, +30], CNN -20% [-30, -10]), its effect from the interval, and the
    lines in the comparisons' order in every panel (not resolved-first), so a comparison sits at one height."""
    from flatfl.report.contrast import contrast_rows, read_report
    from flatfl.report.contrast_figure import contrast_items

    a, b = make_report(tmp_path / "a", A_ROWS), make_report(tmp_path / "b", B_ROWS)
    out = tmp_path / "c"
    summary = write_contrast([a, b], out, ["MLP", "CNN"])
    assert (out / "effects.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "effects.pdf").is_file()
    assert {"effects.png", "effects.pdf"} <= set(summary["files"])
    rows = contrast_rows([read_report(a), read_report(b)], ["MLP", "CNN"])
    mlp = contrast_items([r for r in rows if r["report"] == "MLP" and r["metric"] == "trace"], 2)
    cnn = contrast_items([r for r in rows if r["report"] == "CNN" and r["metric"] == "trace"], 2)
    assert [i["label"] for i in mlp] == [i["label"] for i in cnn] == ["FedAvg+MAN vs FedAvg (Dir 0.3)",
                                                                     "FedAvg+MAN vs FedAvg (Dir 0.6)"]
    assert (mlp[0]["change"], mlp[0]["low"], mlp[0]["high"]) == pytest.approx((20.0, 10.0, 30.0))
    assert (cnn[0]["change"], cnn[0]["low"], cnn[0]["high"]) == pytest.approx((-20.0, -30.0, -10.0))
    assert [i["effect"] for i in mlp] == ["higher", "lower"] and [i["effect"] for i in cnn] == ["lower", "lower"]
    assert mlp[0]["paper"] == pytest.approx(-50.0)
    acc = contrast_items([r for r in rows if r["report"] == "CNN" and r["metric"] == "accuracy"], 1)
    assert acc[0]["effect"] == "unresolved" and acc[0]["how"] == "none" and acc[0]["low"] is None  # one seed


def test_a_setting_a_report_does_not_record_is_not_taken_for_the_papers(tmp_path):
    """A report re-rendered from a runs.csv names the settings it cannot compare; the contrast neither takes them
    for the paper's (local epochs 5, the paper's Hessian) nor lists them as differences."""
    a = make_report(tmp_path / "a", A_ROWS, differences_from_paper={
        "man-table2": "differs from the paper: dataset digits (paper cifar100); local epochs 2 (paper 5); "
                      "Hessian method lanczos (paper power)"})
    b = make_report(tmp_path / "b", B_ROWS, differences_from_paper={
        "man-table2": "differs from the paper: dataset digits (paper cifar100); model mlp (paper cifar-cnn); "
                      "not recorded, so not compared: local epochs, lr, Hessian settings"})
    summary = write_contrast([a, b], tmp_path / "c", ["A", "B"])
    assert summary["settings_that_differ"] == [
        "model cifar-cnn (A) vs mlp (B)", "not compared, since B does not record them: local epochs, lr, "
        "Hessian settings"]


def test_each_reports_seeds_are_listed(tmp_path):
    a, b = make_report(tmp_path / "a", A_ROWS), make_report(tmp_path / "b", B_ROWS)
    for folder, seeds in ((a, (0, 1, 2, 10)), (b, (1, 2, 3))):
        (folder / "runs.csv").write_text("run,dataset,model,seed\n" + "".join(
            f"r{s},digits,digits-cnn,{s}\n" for s in reversed(seeds)))
    write_contrast([a, b], tmp_path / "c", ["A", "B"])
    md = (tmp_path / "c" / "contrast.md").read_text()
    assert "  - runs: data digits; network digits-cnn; seeds 0, 1, 2, 10" in md
    assert "  - runs: data digits; network digits-cnn; seeds 1, 2, 3" in md


def test_one_report_given_twice_is_refused(tmp_path):
    """The same folder with a trailing slash, through a symlink, or copied: one line naming both, nothing written."""
    import shutil

    a = make_report(tmp_path / "a", A_ROWS)
    (tmp_path / "link").symlink_to(a)
    shutil.copytree(a, tmp_path / "copy")
    same, copied = "are the same report", "are the same report (identical summary.json and directions.csv)"
    for second, says in ((f"{a}/", same), (tmp_path / "link", same), (tmp_path / "copy", copied)):
        res = CliRunner().invoke(main, ["contrast", str(a), str(second), "--out", str(tmp_path / "out")])
        assert res.exit_code == 2, res.output
        assert res.output.strip() == f"flatfl: error: {a} and {second} {says}: give each report once", res.output
        assert not (tmp_path / "out").exists()
    # a copy that differs in its numbers is another report
    b = make_report(tmp_path / "b", A_ROWS[:1])
    assert write_contrast([a, b], tmp_path / "out")["comparisons"] == 1


def test_an_incomparable_comparison_is_counted_with_its_reason(tmp_path):
    header = HEADER + ",incomparable_because"
    because = "trained differently: rho 0.05 vs 0.5"
    a = make_report(tmp_path / "a", [A_ROWS[0] + ",", A_ROWS[1] + ","], header=header)
    b = make_report(tmp_path / "b", [B_ROWS[0].replace(",agree", ",incomparable") + f",{because}",
                                     B_ROWS[1] + ","], header=header)
    summary = write_contrast([a, b], tmp_path / "c", ["A", "B"])
    trace = next(s for s in summary["together"] if s.startswith("trace"))
    assert f"B 1 agree, 0 disagree, 0 inconclusive, 1 incomparable ({because})." in trace
    assert "without a verdict" not in trace
    assert summary["counts"]["B"]["trace"]["incomparable"] == 1
    assert summary["counts"]["B"]["trace"]["incomparable_because"] == [because]
    rows = {(r["report"], r["partition"]): r for r in csv.DictReader((tmp_path / "c" / "contrast.csv").open())}
    assert rows[("B", "dirichlet-0.3")]["incomparable_because"] == because
    assert rows[("A", "dirichlet-0.3")]["incomparable_because"] == ""
    assert f"1 incomparable ({because})" in (tmp_path / "c" / "contrast.md").read_text()
