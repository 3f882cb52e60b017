"""``flatfl train --track-hessian K``: curvature columns of metrics.csv, equal to ``flatfl hessian`` on the same
checkpoint with the same settings; resume continues the series; bad settings are one line."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.analysis.commands.hessian_settings import tracking_settings

TRAIN = ["train", "--dataset", "digits", "--model", "tiny", "--clients", "3", "--local-epochs", "1",
         "--batch-size", "64", "--eval-every", "3", "--quiet", "--threads", "1"]
TRACK = ["--track-hessian", "2", "--track-top", "2", "--track-samples", "64"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def train(*args):
    return CliRunner().invoke(main, [*TRAIN, *args], catch_exceptions=False)


def rows(run):
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def without_time(table):
    return [{k: v for k, v in r.items() if k not in ("seconds", "observer_seconds")} for r in table]


def test_a_tracked_quantity_equals_flatfl_hessian_measure_on_final_pt(tmp_path):
    """--track-measure frobenius: its columns hold, at the last round, what flatfl hessian --measure frobenius gives
    on final.pt with the recorded settings."""
    run = tmp_path / "run"
    r = train("--rounds", "1", "--track-hessian", "1", "--track-top", "0", "--track-samples", "64",
              "--track-measure", "frobenius", "--out", str(run))
    assert r.exit_code == 0, r.output
    settings = json.loads((run / "config.json").read_text())["tracking"]
    assert settings["measure"] == "frobenius" and settings["top"] == 0
    (last,) = rows(run)
    args = ["hessian", str(run / "final.pt"), "--out", str(tmp_path / "h"), "--quiet", "--threads", "1",
            "--top", "0", "--samples", "64", "--batch-size", str(settings["batch_size"]), "--measure", "frobenius",
            "--trace-hvps", str(settings["trace_hvps"]), "--trace-method", settings["trace_method"],
            "--trace-rtol", str(settings["trace_rtol"]), "--seed", str(settings["seed"])]
    h = CliRunner().invoke(main, args, catch_exceptions=False)
    assert h.exit_code == 0, h.output
    record = json.loads((tmp_path / "h" / "hessian.json").read_text())["quantities"]["frobenius"]
    assert float(last["hessian_frobenius"]) == record["estimate"] > 0
    assert float(last["hessian_frobenius_se"]) == record["stderr"]
    # the report's curvature page draws it: its value, +-2 standard errors (read back through config.json)
    from matplotlib.container import ErrorbarContainer

    from flatfl.report.curvature import TRACE_INTERVAL_SE, curvature_page, has_curvature
    from flatfl.report.records import load_run

    rec = load_run(run)
    assert has_curvature([rec])  # no top eigenvalue, no trace: the quantity alone
    fig = curvature_page("t", [rec], [rec.method])
    (axis,) = [ax for ax in fig.axes if ax.get_ylabel().replace("\n", " ") == "squared Frobenius norm of the Hessian"]
    (drawn,) = [ln for ln in axis.lines if ln.get_label().startswith(rec.method)]
    assert list(drawn.get_ydata()) == [record["estimate"]]
    (bars,) = [c for c in axis.containers if isinstance(c, ErrorbarContainer)]
    (segment,) = bars.lines[2][0].get_segments()
    assert abs(segment[1][1] - segment[0][1]) / 2 == pytest.approx(TRACE_INTERVAL_SE * record["stderr"])
    r = train("--rounds", "1", "--track-hessian", "1", "--track-measure", "frobnius", "--out", str(tmp_path / "x"))
    assert r.exit_code == 2 and "unknown quantity 'frobnius'" in r.output and not (tmp_path / "x").exists()


def test_a_tracked_quantity_without_a_standard_error_is_a_point_not_a_failure(tmp_path):
    """A quantity that states no standard error (None) leaves its _se cell blank; the point is ok, not failed."""
    from flatfl.analysis.estimators.quantities import Quantity, register_quantity, unregister_quantity

    def first_probe(op, settings, seed):
        v = torch.ones(op.dim, 1, dtype=op.dtype, device=op.device)
        return {"estimate": float((v * op.matmat(v)).sum()), "stderr": None, "hvps": 1}

    register_quantity(Quantity("one_probe", "one probe", "z^T H z of the ones vector", first_probe, lambda s, d: 1))
    try:
        r = train("--rounds", "1", "--track-hessian", "1", "--track-top", "0", "--track-samples", "32",
                  "--track-measure", "one_probe", "--out", str(tmp_path / "run"))
    finally:
        unregister_quantity("one_probe")
    assert r.exit_code == 0, r.output
    (last,) = rows(tmp_path / "run")
    assert last["hessian_status"] == "ok" and float(last["hessian_one_probe"]) != 0
    assert last["hessian_one_probe_se"] == ""


def test_last_row_equals_flatfl_hessian_on_final_pt(tmp_path):
    run = tmp_path / "run"
    r = train("--rounds", "5", *TRACK, "--out", str(run))
    assert r.exit_code == 0, r.output
    table = rows(run)
    # tracked rounds 2, 4 and the last (5), evaluated rounds 3 and 5: every tracked round has its row
    assert [t["round"] for t in table] == ["2", "3", "4", "5"]
    assert table[1]["hessian_top"] == "" and all(table[i]["hessian_top"] for i in (0, 2, 3))
    config = json.loads((run / "config.json").read_text())
    settings = config["tracking"]
    assert config["config"]["track_hessian"] == 2 and settings["every"] == 2
    assert settings["top"] == 2 and settings["samples"] == 64 and settings["tol"] == tracking_settings().tol
    assert "measure" not in settings and "curvature" not in settings  # the record of the defaults: as it always was
    # the same numbers from `flatfl hessian final.pt` with the recorded settings
    args = ["hessian", str(run / "final.pt"), "--out", str(tmp_path / "h"), "--quiet", "--threads", "1",
            "--top", "2", "--samples", "64", "--batch-size", str(settings["batch_size"]), "--tol", str(settings["tol"]),
            "--trace-hvps", str(settings["trace_hvps"]), "--trace-method", settings["trace_method"],
            "--trace-rtol", str(settings["trace_rtol"]), "--seed", str(settings["seed"])]
    h = CliRunner().invoke(main, args, catch_exceptions=False)
    assert h.exit_code == 0, h.output
    report = json.loads((tmp_path / "h" / "hessian.json").read_text())
    # the summary says which "top" it printed; hessian.json says what is known of repeated values
    assert "top eigenvalues of the Hessian (largest algebraic): " in h.output
    assert report["eigen"]["multiplicity"]["status"] in ("none seen", "checked")
    last = table[-1]
    assert float(last["hessian_top"]) == report["top_eigenvalues"][0]
    assert float(last["hessian_eig2"]) == report["top_eigenvalues"][1]
    assert float(last["hessian_trace"]) == report["trace"]["estimate"]
    assert float(last["hessian_trace_se"]) == report["trace"]["stderr"]
    assert float(last["hessian_loss"]) == report["loss"]
    assert int(last["hessian_hvps"]) == report["hvps_total"]
    # the all-clients average's loss is the loss of all_clients.pt's model on the same sample
    from flatfl.analysis import HessianOperator
    from flatfl.checkpoint import load_checkpoint

    average = load_checkpoint(run / "final.pt", which="all")
    op = HessianOperator(average.model, average.eval_batches("train", samples=64, batch_size=settings["batch_size"]))
    assert float(last["hessian_all_loss"]) == pytest.approx(op.loss(), rel=1e-6)
    # the series is not constant: training changes the curvature and the loss
    assert float(table[0]["hessian_loss"]) != float(last["hessian_loss"])
    # training is not changed by the tracking: the same rows (rounds 3 and 5 are evaluated in both) and weights
    plain = tmp_path / "plain"
    assert train("--rounds", "5", "--out", str(plain)).exit_code == 0
    tracked = {t["round"]: {k: t[k] for k in rows(plain)[0] if k != "seconds"} for t in table}
    assert all(tracked[t["round"]] == {k: v for k, v in t.items() if k != "seconds"} for t in rows(plain))
    from flatfl.checkpoint import read_checkpoint

    a, b = (read_checkpoint(d / "final.pt")["state_dict"] for d in (run, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_continues_the_series(tmp_path, crash_in_round):
    ref = tmp_path / "ref"
    assert train("--rounds", "4", "--checkpoint-every", "2", *TRACK, "--out", str(ref)).exit_code == 0
    crashed = tmp_path / "crashed"
    with crash_in_round(2):
        assert train("--rounds", "4", "--checkpoint-every", "2", *TRACK, "--out", str(crashed)).exit_code == 1
    r = CliRunner().invoke(main, ["train", "--resume", str(crashed), "--quiet", "--threads", "1"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert without_time(rows(ref)) == without_time(rows(crashed))
    assert [t["round"] for t in rows(crashed) if t["hessian_top"]] == ["2", "4"]
    assert float(rows(crashed)[-1]["observer_seconds"]) > float(rows(crashed)[0]["observer_seconds"])


@pytest.mark.parametrize("args, message", [
    (["--track-hessian", "-1"], "--track-hessian must be an integer >= 0"),
    (["--track-hessian", "2", "--track-samples", "0"], "--track-samples must be a positive integer"),
    (["--track-hessian", "2", "--track-top", "-1"], "--track-top must be a non-negative integer"),
    (["--track-hessian", "1", "--track-top", "100000"], "--track-top 100000 is larger than the number of parameters"),
    (["--track-top", "2"], "curvature-tracking settings given without --track-hessian"),
])
def test_bad_tracking_settings_are_one_line(tmp_path, args, message):
    r = CliRunner().invoke(main, [*TRAIN, "--rounds", "1", *args, "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()


def test_tracking_settings_checked_where_they_enter():
    with pytest.raises(ConfigError, match="unknown curvature-tracking setting 'density'"):
        tracking_settings({"density": True})
    with pytest.raises(ConfigError, match="--trace-hvps must be an integer"):
        tracking_settings({"trace_hvps": "many"})
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    cfg = RunConfig(dataset="digits", model="tiny", clients=2, rounds=1, track_hessian=1).validate()
    with pytest.raises(ConfigError, match="needs the observer"):
        Trainer(cfg, "/nonexistent-run-dir", quiet=True)
    # training records the tracking settings without reading them (train/ does not import analysis/): the
    # observer, which the analysis makes and every caller builds before a run folder, checks them
    from flatfl.analysis.commands.tracking import curvature_observer

    recorded = RunConfig(dataset="digits", model="tiny", clients=2, rounds=1, track_hessian=1,
                         track_hessian_settings={"top": -1}).validate()
    with pytest.raises(ConfigError, match="--track-top must be a non-negative integer, got -1"):
        curvature_observer(recorded)


def test_sweep_tasks_track_and_the_report_draws_the_series(tmp_path):
    # two seeds of FedAvg and FedAvg+MAN through the sweep's task runner (the path flatfl sweep and reproduce take)
    from flatfl.report import build_report
    from flatfl.report.curvature import curvature_page
    from flatfl.report.records import load_run
    from flatfl.sweep import RunTask, run_tasks

    tiny = dict(dataset="digits", model="tiny", clients=3, participation=1.0, local_epochs=1, batch_size=64,
                eval_every=2, checkpoint_every=2, rounds=2, partition="dirichlet", alpha=0.3, track_hessian=1,
                track_hessian_settings={"samples": 64})
    tasks = [RunTask(f"{name}-s{seed}", str(tmp_path / "runs" / f"{name}-s{seed}"),
                     dict(tiny, algo="fedavg", seed=seed, **extra), threads=1)
             for name, extra in (("fedavg", {}), ("fedavg-man", {"reg": "man"})) for seed in (0, 1)]
    records = run_tasks(tasks)
    assert all(r["error"] is None for r in records), records
    for t in tasks:  # round 1 is tracked although only round 2 is evaluated by eval_every
        assert [r["round"] for r in rows(Path(t.run_dir))] == ["1", "2"]
    summary = build_report([tmp_path / "runs"], tmp_path / "rep")
    assert "man-table2: curvature FedAvg" in summary["pages"]
    # the drawn lines are the means over seeds of metrics.csv's columns, bands their range
    runs = [load_run(t.run_dir) for t in tasks]
    fig = curvature_page("t", runs, ["FedAvg", "FedAvg+MAN"])
    top_axis, trace_axis = fig.axes[0], fig.axes[1]
    for method in ("FedAvg", "FedAvg+MAN"):
        for column, axis in (("hessian_top", top_axis), ("hessian_trace", trace_axis)):
            values = [[float(r[column]) for r in rows(Path(t.run_dir))] for t in tasks
                      if load_run(t.run_dir).method == method]
            drawn = next(ln for ln in axis.lines if ln.get_label().startswith(f"{method} ("))
            assert list(drawn.get_xdata()) == [1, 2]
            assert drawn.get_ydata() == pytest.approx([sum(v) / 2 for v in zip(*values)], rel=1e-12)


def test_reproduce_passes_the_tracking_through():
    from flatfl.reproduce import RunOptions, Selection, plan

    quick = plan(Selection("man-table2", "quick", seeds=(0,)), runs_dir="/tmp/x")
    assert {t.settings["track_hessian"] for t in quick} == {10}
    assert {t.settings["track_hessian"] for t in plan(Selection("man-table2", "quick", seeds=(0,)),
                                                      RunOptions(track_hessian=0), runs_dir="/tmp/x")} == {0}
    with pytest.raises(ConfigError, match="--track-hessian must be an integer >= 0"):
        plan(Selection("man-table2", "quick", seeds=(0,)), RunOptions(track_hessian=-2), runs_dir="/tmp/x")


def test_tracked_trace_meets_its_target_or_is_marked_unresolved(tmp_path):
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer
    from flatfl.analysis.commands.tracking import curvature_observer

    def run(name, **tracking):
        cfg = RunConfig(dataset="digits", model="tiny", clients=3, local_epochs=1, batch_size=64, rounds=2,
                        eval_every=2, track_hessian=1, threads=1,
                        track_hessian_settings={"samples": 64, "top": 1, **tracking}).validate()
        Trainer(cfg, tmp_path / name, quiet=True, observer=curvature_observer(cfg)).run()
        return rows(tmp_path / name), json.loads((tmp_path / name / "config.json").read_text())["tracking"]

    table, settings = run("default")
    assert settings["trace_rtol"] == 0.1 and settings["trace_hvps"] == 300  # the defaults, recorded
    for row in table:
        trace, se = float(row["hessian_trace"]), float(row["hessian_trace_se"])
        assert float(row["hessian_trace_target"]) == 0.1 and int(row["hessian_trace_budget"]) == 300
        assert (row["hessian_status"] == "ok") == (se <= 0.1 * abs(trace))
        assert row["hessian_status"] in ("ok", "unresolved")
    assert any(r["hessian_status"] == "ok" for r in table)  # the defaults resolve this small network's trace
    # a target the budget cannot reach: every point is marked unresolved, its interval recorded
    table, settings = run("strict", trace_rtol=1e-4, trace_hvps=12)
    assert settings["trace_rtol"] == 1e-4 and settings["trace_hvps"] == 12
    for row in table:
        assert row["hessian_status"] == "unresolved"
        assert float(row["hessian_trace_se"]) > 1e-4 * abs(float(row["hessian_trace"]))
        assert int(row["hessian_hvps"]) >= 12


def test_track_top_is_checked_before_the_first_round(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, [*TRAIN, "--rounds", "3", "--track-hessian", "2", "--track-top", "100000",
                                  "--out", str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--track-top 100000" in lines[0] and "--top " not in lines[0]
    assert not out.exists()  # nothing trained, nothing left behind: the same command can simply be run again


def test_a_tracking_failure_is_named_and_training_goes_on(tmp_path, monkeypatch):
    import numpy as np

    import flatfl.analysis.commands.tracking as tracking

    real, calls = tracking.compute, []

    def failing_at_round_2(op, settings, **kw):  # what the eigen solver does on non-finite products
        calls.append(1)
        if len(calls) == 2:
            raise np.linalg.LinAlgError("Eigenvalues did not converge")
        return real(op, settings, **kw)

    monkeypatch.setattr(tracking, "compute", failing_at_round_2)
    run = tmp_path / "run"
    r = CliRunner().invoke(main, [*TRAIN, "--rounds", "3", "--track-hessian", "1", "--track-top", "1",
                                  "--track-samples", "64", "--out", str(run)])
    assert r.exit_code == 0, r.output
    notice = [ln for ln in r.output.splitlines() if "curvature tracking failed" in ln]
    assert len(notice) == 1 and "round 2" in notice[0] and "Eigenvalues did not converge" in notice[0]
    table = rows(run)
    assert [t["round"] for t in table] == ["1", "2", "3"] and (run / "final.pt").is_file()
    assert table[1]["hessian_status"] == "failed"
    assert table[0]["hessian_status"] in ("ok", "unresolved") and table[2]["hessian_status"] in ("ok", "unresolved")
    assert table[1]["hessian_top"] == "" and table[1]["hessian_trace"] == ""
    assert table[0]["hessian_top"] and table[2]["hessian_top"]
    # the training is the untracked run's
    plain = tmp_path / "plain"
    assert train("--rounds", "3", "--out", str(plain)).exit_code == 0
    from flatfl.checkpoint import read_checkpoint

    a, b = (read_checkpoint(d / "final.pt")["state_dict"] for d in (run, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_curvature_page_draws_each_tracked_quantity_by_its_title_or_name():
    """A row per quantity a run tracked (config.json's tracking ``measure``), between the trace and the loss:
    a registered one by its title, one not installed here by its name, bars only where a standard error was
    stated; a ``measure`` that is not a string of names (another person's file) draws nothing more."""
    from types import SimpleNamespace

    from matplotlib.container import ErrorbarContainer

    from flatfl.report.curvature import curvature_page

    def record(measure, **columns):
        curve = [{"round": float(r), "hessian_top": 1.0 + r, "hessian_loss": 1.0 / r,
                  **{k: v[i] for k, v in columns.items()}} for i, r in enumerate((5, 10))]
        return SimpleNamespace(method="FedAvg", partition="iid", seed=0, curve=curve, tracking={"measure": measure})

    rec = record("frobenius,sharpness", hessian_frobenius=[3.0, 4.0], hessian_frobenius_se=[0.5, 0.25],
                 hessian_sharpness=[7.0, 8.0], hessian_sharpness_se=[None, None])
    fig = curvature_page("t", [rec], ["FedAvg"])
    assert [ax.get_ylabel().replace("\n", " ") for ax in fig.axes] == [
        "top Hessian eigenvalue", "squared Frobenius norm of the Hessian", "sharpness of the Hessian",
        "training loss (evaluation sample)"]
    assert [c for c in fig.axes[1].containers if isinstance(c, ErrorbarContainer)]
    assert not [c for c in fig.axes[2].containers if isinstance(c, ErrorbarContainer)]  # no standard error
    assert not [ln for ax in fig.axes for ln in ax.lines if ln.get_label() == "_unresolved"]
    assert "measured quantities: bars +-2 standard errors" in " ".join(t.get_text() for t in fig.texts)
    # the page's note names only what carries bars: no trace drawn, a quantity without standard errors
    fig = curvature_page("t", [record("sharpness", hessian_sharpness=[7.0, 8.0])], ["FedAvg"])
    assert "bars" not in " ".join(t.get_text() for t in fig.texts)
    for hostile in (["frobenius"], "../x,Frobenius", 7, "loss,top,eig2,trace"):  # the last: tracking's own columns
        fig = curvature_page("t", [record(hostile, hessian_frobenius=[3.0, 4.0])], ["FedAvg"])
        assert [ax.get_ylabel().replace("\n", " ") for ax in fig.axes] == ["top Hessian eigenvalue",
                                                                          "training loss (evaluation sample)"]


def test_a_quantity_named_like_trackings_own_columns_is_refused_before_training(tmp_path):
    """A quantity whose metrics.csv column would be one of tracking's own (hessian_loss, hessian_eig2...) cannot be
    tracked: one line, exit 2, nothing written; flatfl hessian --measure still takes it."""
    from flatfl.analysis.estimators.quantities import Quantity, register_quantity, unregister_quantity

    def ones(op, settings, seed):
        v = torch.ones(op.dim, 1, dtype=op.dtype, device=op.device)
        return {"estimate": float((v * op.matmat(v)).sum()), "stderr": None, "hvps": 1}

    for name in ("loss", "eig2"):
        register_quantity(Quantity(name, name, "z^T H z of the ones vector", ones, lambda s, d: 1))
        try:
            r = train("--rounds", "1", "--track-hessian", "1", "--track-measure", name, "--out", str(tmp_path / name))
        finally:
            unregister_quantity(name)
        assert r.exit_code == 2 and f"column hessian_{name} is curvature tracking's own" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / name).exists()


def test_a_tracked_quantity_above_its_target_marks_the_round_and_one_that_cannot_run_is_refused(tmp_path):
    """A quantity stopped by its budget above its target (trace_rtol) makes the round unresolved, as a trace does;
    settings under which a quantity spends no product (a config file's trace_hvps 1 for the diagonal's pairs) are
    refused before training, in one line naming --track-measure."""
    r = train("--rounds", "1", "--track-hessian", "1", "--track-top", "0", "--track-samples", "32",
              "--track-measure", "diagonal", "--out", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    (last,) = rows(tmp_path / "run")
    value, se = float(last["hessian_diagonal"]), float(last["hessian_diagonal_se"])
    assert last["hessian_status"] == ("unresolved" if se > 0.1 * abs(value) else "ok")
    assert last["hessian_status"] == "unresolved"  # 32 samples, 300 products: above 10% (seed 0)
    config = tmp_path / "c.toml"
    config.write_text('rounds = 1\ntrack_hessian = 1\n[track_hessian_settings]\ntrace_hvps = 1\nmeasure = "diagonal"\n')
    r = train("--config", str(config), "--out", str(tmp_path / "x"))
    assert r.exit_code == 2 and "--track-measure diagonal: the quantity spends no product" in r.output, r.output
    assert not (tmp_path / "x").exists()


def test_an_observer_whose_columns_are_metrics_own_is_refused_before_training(tmp_path):
    """An observer handed to the Trainer (the Python API) may not name a column metrics.csv has, or one twice: the
    report would read one column as the other."""
    from types import SimpleNamespace

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    cfg = RunConfig(dataset="digits", model="tiny", clients=2, rounds=1)
    for columns, bad in ((["test_acc"], "test_acc"), (["x", "x"], "x"), (["observer_seconds"], "observer_seconds")):
        observer = SimpleNamespace(columns=columns, name="mine")
        with pytest.raises(ConfigError, match=f"the observer's column '{bad}' is metrics.csv's own or named twice"):
            Trainer(cfg, tmp_path / "run", quiet=True, observer=observer)
    with pytest.raises(ConfigError, match="has no list of column names"):
        Trainer(cfg, tmp_path / "run", quiet=True, observer=SimpleNamespace(name="mine"))
    assert not (tmp_path / "run").exists()


def test_a_metrics_file_whose_round_is_not_a_round_number_is_named(tmp_path):
    from flatfl.report.records import load_run

    run = tmp_path / "run"
    assert train("--rounds", "2", "--eval-every", "1", "--out", str(run)).exit_code == 0
    lines = (run / "metrics.csv").read_text().splitlines()
    assert len(lines) == 3
    for bad in ("nan", "inf", "1.5", "-1"):
        (run / "metrics.csv").write_text("\n".join([lines[0], bad + lines[1][lines[1].index(","):], lines[2]]) + "\n")
        with pytest.raises(ConfigError, match=f"metrics.csv line 2: the round '{bad}' is not a round number"):
            load_run(run)


def test_the_curvature_page_reads_a_quantity_only_from_the_runs_that_tracked_it():
    """A run's hessian_<name> column counts only where its tracking measured <name>; a second run of a seed counts
    once (as in the tables); a quantity above the run's target is circled; a standard error that is no standard
    error (negative, infinite) draws no bar."""
    from types import SimpleNamespace

    from matplotlib.container import ErrorbarContainer

    from flatfl.report.curvature import curvature_page

    def record(method, seed, measure, values, ses, name="r"):
        curve = [{"round": float(r), "hessian_top": 2.0, "hessian_frobenius": v, "hessian_frobenius_se": e,
                  "hessian_status": "ok"} for r, v, e in zip((1, 2), values, ses)]
        return SimpleNamespace(method=method, partition="iid", seed=seed, curve=curve, name=name,
                               tracking={"measure": measure, "trace_rtol": 0.1})

    runs = [record("FedAvg", 0, "frobenius", [10.0, 20.0], [0.5, 5.0], "a"),
            record("FedAvg", 0, "frobenius", [99.0, 99.0], [0.1, 0.1], "b"),  # seed 0 again: counts once
            record("FedAvg+MAN", 0, "other", [7.0, 7.0], [0.1, 0.1])]  # a column of a quantity it did not track
    fig = curvature_page("t", runs, ["FedAvg", "FedAvg+MAN"])
    axis = next(ax for ax in fig.axes if ax.get_ylabel().startswith("squared Frobenius"))
    drawn = [ln for ln in axis.lines if not ln.get_label().startswith("_")]
    assert [(ln.get_label(), list(ln.get_ydata())) for ln in drawn] == [("FedAvg (n=1)", [10.0, 20.0])]
    (ring,) = [ln for ln in axis.lines if ln.get_label() == "_unresolved"]  # 5 > 10% of 20
    assert list(ring.get_xdata()) == [2]
    assert "a seed's second run drawn once: b (as a)" in " ".join(t.get_text() for t in fig.texts)
    other = record("FedAvg", 0, "frobenius", [99.0, 99.0], [0.1, 0.1], "c")  # seed 0 of another experiment
    runs[0].config, other.config = {"lr": 0.1}, {"lr": 0.01}
    fig = curvature_page("t", [runs[0], other], ["FedAvg"])
    axis = next(ax for ax in fig.axes if ax.get_ylabel().startswith("squared Frobenius"))
    assert [ln.get_label() for ln in axis.lines if not ln.get_label().startswith("_")] == ["FedAvg (n=2)"]
    # a quantity without a standard error of its own is not ringed for the trace's miss in its round
    row = dict(runs[0].curve[0], hessian_trace=10.0, hessian_trace_se=5.0, hessian_frobenius_se=None,
               hessian_status="unresolved")
    lone = record("FedAvg", 1, "frobenius", [1.0], [None])
    lone.curve = [row]
    fig = curvature_page("t", [lone], ["FedAvg"])
    rings = {ax.get_ylabel().replace("\n", " "): [ln for ln in ax.lines if ln.get_label() == "_unresolved"]
             for ax in fig.axes}
    assert rings["Hessian trace"] and not rings["squared Frobenius norm of the Hessian"]
    fig = curvature_page("t", [record("FedAvg", 0, "frobenius", [10.0, 20.0], [-1.0, float("inf")])], ["FedAvg"])
    axis = next(ax for ax in fig.axes if ax.get_ylabel().startswith("squared Frobenius"))
    assert not [c for c in axis.containers if isinstance(c, ErrorbarContainer)]


@pytest.mark.parametrize("change,message", [
    (lambda h, r: (h, ",".join(r.split(",")[:1] + ["1e308"] + r.split(",")[2:])), "is beyond what flatfl writes"),
    (lambda h, r: (h + ",round", r + ",1"), "column round named twice in the header"),
])
def test_a_metrics_file_with_an_impossible_value_or_a_column_twice_is_named(tmp_path, change, message):
    from flatfl.report.records import load_run

    run = tmp_path / "run"
    assert train("--rounds", "1", "--out", str(run)).exit_code == 0
    header, row = change(*(run / "metrics.csv").read_text().splitlines()[:2])
    (run / "metrics.csv").write_text(header + "\n" + row + "\n")
    with pytest.raises(ConfigError, match=message):
        load_run(run)


def test_the_curvature_page_draws_the_trace_interval_and_marks_unresolved_points():
    from types import SimpleNamespace

    from matplotlib.container import ErrorbarContainer

    from flatfl.report.curvature import TRACE_INTERVAL_SE, curvature_page

    def record(seed, traces, ses):
        curve = [{"round": float(r), "hessian_top": 1.0 + r, "hessian_trace": t, "hessian_trace_se": e,
                  "hessian_trace_target": 0.1, "hessian_loss": 1.0 / r} for r, t, e in zip((5, 10, 15), traces, ses)]
        return SimpleNamespace(method="FedAvg", partition="iid", seed=seed, curve=curve, tracking={"trace_rtol": 0.1})

    # round 10: se 6 > 10% of 40 (unresolved); rounds 5 and 15 resolved
    fig = curvature_page("t", [record(0, [20.0, 40.0, 50.0], [1.0, 6.0, 2.0])], ["FedAvg"])
    trace_axis = fig.axes[1]
    bars = [c for c in trace_axis.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1
    segments = bars[0].lines[2][0].get_segments()
    half = [abs(seg[1][1] - seg[0][1]) / 2 for seg in segments]
    assert half == pytest.approx([TRACE_INTERVAL_SE * e for e in (1.0, 6.0, 2.0)])
    rings = [ln for ln in trace_axis.lines if ln.get_label() == "_unresolved"]
    assert len(rings) == 1 and list(rings[0].get_xdata()) == [10] and list(rings[0].get_ydata()) == [40.0]
    assert rings[0].get_markerfacecolor() == "none"
    # every point resolved: bars, no ring
    fig = curvature_page("t", [record(0, [20.0, 40.0, 50.0], [1.0, 2.0, 2.0])], ["FedAvg"])
    assert not [ln for ln in fig.axes[1].lines if ln.get_label() == "_unresolved"]
    assert [c for c in fig.axes[1].containers if isinstance(c, ErrorbarContainer)]
