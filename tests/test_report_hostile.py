"""The report's and contrast's promises against hostile or mixed input: a user's file in the output folder is never
replaced; a row, a pair and a contrast cell are one experiment in every respect that can change a number (the
network and data of the user's, the analysis split); contrast shows a change over the seeds of its interval and lists
what it drops; CSV fields and JSON nesting are bounded. Tiny real runs (one round) and hand-made records."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.paper_tables import TABLES
from flatfl.report import build_report
from flatfl.report.records import RunRecord
from flatfl.report.tables import build_table
from flatfl.report.verdicts import direction_checks
from flatfl.train.identity import experiment_settings

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(dataset="digits", clients=4, participation=1.0, local_epochs=1, batch_size=50, eval_every=1,
            checkpoint_every=1, rounds=1, partition="dirichlet", alpha=0.3, parallel_clients=1)


def _own_run(folder: Path, hidden: int, seed: int) -> Path:
    """A run trained from Python on data and a network of the user's (``hidden`` units)."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) > 0).long()
    cfg = RunConfig(clients=4, rounds=1, batch_size=40, seed=seed, participation=1.0, local_epochs=1).validate()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    Trainer(cfg, str(folder), dataset=TensorDataset(x[:160], y[:160]), test_dataset=TensorDataset(x[160:], y[160:]),
            model=net, quiet=True).run()
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FedAvg on digits, seeds 0 and 1; own-network runs: 8 hidden units seeds 0, 1 and 16 hidden units seed 1."""
    from flatfl.sweep import RunTask, run_tasks

    root = tmp_path_factory.mktemp("hostile")
    tasks = [RunTask(f"fedavg-s{s}", str(root / "digits" / f"fedavg-s{s}"), dict(TINY, seed=s), threads=1)
             for s in (0, 1)]
    assert all(r["error"] is None for r in run_tasks(tasks))
    for name, hidden, seed in (("own8-s0", 8, 0), ("own8-s1", 8, 1), ("own16-s1", 16, 1)):
        _own_run(root / "own" / name, hidden, seed)
    return root


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(res, message: str) -> None:
    assert res.exit_code == 2, res.output
    assert message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output, res.output


# ------------------------------------------------------------------------------ 1. nothing a user wrote is replaced
@pytest.mark.parametrize("name", ["report.md", "runs.csv", "summary.json", "report.pdf", "effects.png", "effects.pdf"])
def test_a_users_file_in_the_report_folder_is_kept(runs, tmp_path, name):
    out = tmp_path / "rep"
    out.mkdir()
    (out / name).write_text("my own notes\n")
    res = _invoke("report", runs / "digits", "--out", out, "--threads", "1")
    _one_line_error(res, f"{out / name} exists and was not written by flatfl")
    assert (out / name).read_text() == "my own notes\n"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [name]


def test_a_users_table_csv_is_kept_and_flatfls_own_report_is_replaced(runs, tmp_path):
    out = tmp_path / "rep"
    assert build_report([runs / "digits"], out, tables=["man-table2"])["runs"] == 2
    first = (out / "report.md").read_text()
    res = _invoke("report", runs / "digits", "--out", out, "--table", "man-table2", "--threads", "1")
    assert res.exit_code == 0, res.output  # a rerun over flatfl's own earlier report
    assert (out / "report.md").read_text() == first
    other = tmp_path / "rep2"
    other.mkdir()
    (other / "man-table2.csv").write_text("mine\n")
    res = _invoke("report", runs / "digits", "--out", other, "--table", "man-table2", "--threads", "1")
    _one_line_error(res, "man-table2.csv exists and was not written by flatfl")
    assert (other / "man-table2.csv").read_text() == "mine\n" and not (other / "runs.csv").exists()


def test_summary_records_how_each_rows_runs_were_trained(runs, tmp_path):
    """summary.json's ``training`` (what ``flatfl contrast`` compares between reports): the FedAvg row's settings are
    the ones its runs were trained with (TINY, lr and rho at their defaults)."""
    build_report([runs / "digits"], tmp_path / "rep", tables=["man-table2"])
    training = json.loads((tmp_path / "rep" / "summary.json").read_text())["training"]["man-table2"]
    assert [(r["method"], r["partition"]) for r in training] == [("FedAvg", "dirichlet-0.3")]
    got = training[0]["settings"]
    assert {k: got[k] for k in ("dataset", "clients", "batch_size", "rounds", "local_epochs", "lr", "algo")} == {
        "dataset": "digits", "clients": "4", "batch_size": "50", "rounds": "1", "local_epochs": "1", "lr": "0.1",
        "algo": "fedavg"}
    assert "seed" not in got and "threads" not in got  # neither decides an experiment's numbers


# ------------------------------------------------------------------------------ 2. one experiment in every respect
def test_own_networks_of_another_structure_are_not_averaged_as_seeds(runs, tmp_path):
    """Trained from Python, all three record 'dataset: digits, model: None'; the report reads the network and
    data they record instead: 8 and 16 hidden units are not two seeds of one experiment."""
    own = runs / "own"
    assert json.loads((own / "own8-s0" / "config.json").read_text())["config"]["model"] is None
    res = _invoke("report", own / "own8-s0", own / "own16-s1", "--out", tmp_path / "r", "--threads", "1")
    _one_line_error(res, "cannot be averaged as seeds")
    assert "model_structure" in res.output and not (tmp_path / "r" / "runs.csv").exists()
    summary = build_report([own / "own8-s0", own / "own8-s1"], tmp_path / "same")  # one network: two seeds
    assert summary["runs"] == 2 and "custom, custom torch.nn.modules.container.Sequential" in summary["ours_scale"]
    rows = list(csv.DictReader((tmp_path / "same" / "runs.csv").open()))
    assert {(r["dataset"], r["model"]) for r in rows} == {("custom", "custom torch.nn.modules.container.Sequential")}


def test_the_identity_of_own_networks_and_data():
    net = {"name": "custom", "custom": True, "class": "m.Net", "factory": None, "structure": {"modules": [1]}}
    data = {"name": "custom", "custom": True, "file": "data.pt"}
    cfg = {"dataset": "digits", "model": None, "rounds": 1}
    plain = experiment_settings(cfg)
    mine = experiment_settings(cfg, network=net, data=data, data_digest="ab" * 32)
    assert plain["model"] == "digits-cnn" and plain["dataset"] == "digits"
    assert mine["model"] == "custom m.Net" and mine["dataset"] == "custom" and mine["data_sha256"] == "ab" * 32
    assert mine != experiment_settings(cfg, network=dict(net, structure={"modules": [2]}), data=data,
                                       data_digest="ab" * 32)
    assert mine != experiment_settings(cfg, network=net, data=data, data_digest="cd" * 32)
    assert mine != experiment_settings(cfg, network=dict(net, factory="m:net"), data=data, data_digest="ab" * 32)
    # a registry network's record changes nothing: its settings name it
    assert experiment_settings(cfg, network={"name": "digits-cnn", "kwargs": {}}) == plain


def test_an_edited_network_record_is_refused(runs, tmp_path):
    run = tmp_path / "own8-s0"
    shutil.copytree(runs / "own" / "own8-s0", run)
    info = json.loads((run / "config.json").read_text())
    info["model"]["structure"]["modules"][2][2] = "in_features=64, out_features=9, bias=True"
    (run / "config.json").write_text(json.dumps(info))
    res = _invoke("report", run, "--out", tmp_path / "r", "--threads", "1")
    _one_line_error(res, "does not describe the network of final.pt (model_structure")


def test_an_edited_data_record_is_refused(runs, tmp_path):
    """config.json's record of the user's data made to name another data set (as when another run's data.pt and
    its record are copied in): the report checks it against final.pt's record, as it does the network's."""
    run = tmp_path / "own8-s0"
    shutil.copytree(runs / "own" / "own8-s0", run)
    info = json.loads((run / "config.json").read_text())
    recorded = info["dataset"]["sha256"]
    info["dataset"]["sha256"] = "cd" * 32
    (run / "config.json").write_text(json.dumps(info))
    res = _invoke("report", run, "--out", tmp_path / "r", "--threads", "1")
    _one_line_error(res, f"does not describe the data of final.pt (data_sha256 cdcdcdcdcdcd (final.pt: "
                         f"{recorded[:12]}))")


def _record(tmp_path: Path, method: str, seed: int, value: float, *, split: str = "train", network=None,
            config=None, settings=None) -> RunRecord:
    """A finished run's record (an empty final.pt marks it finished) with a Hessian of the all-clients average."""
    d = tmp_path / f"{method}-s{seed}-{split}-{value}"
    d.mkdir(exist_ok=True)
    (d / "final.pt").write_bytes(b"")
    cfg = dict(dict(dataset="digits", rounds=1, clients=4, algo="fedavg"), seed=seed, **(config or {}))
    if method.endswith("+MAN"):
        cfg.update(reg="man", params={"zeta": 0.6})
    h = {"checkpoint": str(d / "final-clients-average.pt"), "top_eigenvalues": [value], "num_samples": 100,
         "trace": {"estimate": 10 * value}, "settings": {"method": "lanczos", "trace_method": "hutchpp",
                                                         "split": split, **(settings or {})}}
    rec = RunRecord(run_dir=d, config=cfg, method=method, partition="dirichlet-0.3", dataset="digits", seed=seed,
                    rounds_done=1, analyses={"hessian-clients-average": h}, network=network)
    return rec.select("clients-average")


def test_a_hessian_of_the_test_split_is_not_averaged_with_training_split_ones(tmp_path):
    spec = TABLES["man-table2"]
    recs = [_record(tmp_path, "FedAvg", s, 10.0 + s) for s in (0, 1)] + [_record(tmp_path, "FedAvg", 2, 99.0,
                                                                                  split="test")]
    recs += [_record(tmp_path, "FedAvg+MAN", s, 5.0 + s) for s in (0, 1, 2)]
    rows = {r.method: r for r in build_table(spec, recs, []) if r.partition == "dirichlet-0.3"}
    cell = rows["FedAvg"].cells["top_eigenvalue"]
    assert cell.n == 2 and cell.mean == pytest.approx(10.5)
    assert "test split" in cell.left_out and "FedAvg-s2-test" in cell.left_out
    # a whole row of test-split values beside one of the training split: marked, and the pair incomparable
    test_rows = [_record(tmp_path, "FedAvg", s, 10.0 + s, split="test") for s in (0, 1, 2)]
    rows = build_table(spec, test_rows + recs[3:], [])
    check = next(c for c in direction_checks(spec, rows) if c["metric"] == "top_eigenvalue"
                 and c["partition"] == "dirichlet-0.3" and c["reference"] == "FedAvg")
    assert check["verdict"] == "incomparable" and "test split" in check["incomparable_because"]
    assert any(r.cells["top_eigenvalue"].mark == "†" for r in rows)


def test_a_looser_estimate_is_not_averaged_with_tighter_ones(tmp_path):
    """A Hessian estimated with a loose Lanczos tolerance or a small trace budget is another setting: left out of
    the row's mean of the others by name, with what differs (a 57% low top eigenvalue measured with --tol 0.9 and
    3 trace products went into a mean unmarked)."""
    spec = TABLES["man-table2"]
    tight = dict(tol=1e-3, trace_hvps=100, trace_rtol=0.01)
    recs = [_record(tmp_path, "FedAvg", s, 10.0 + s, settings=tight) for s in (0, 2)]
    recs.append(_record(tmp_path, "FedAvg", 1, 1.0, settings=dict(tol=0.9, trace_hvps=3, trace_rtol=0.01)))
    recs += [_record(tmp_path, "FedAvg+MAN", s, 5.0 + s, settings=tight) for s in (0, 1, 2)]
    rows = {r.method: r for r in build_table(spec, recs, []) if r.partition == "dirichlet-0.3"}
    top, trace = rows["FedAvg"].cells["top_eigenvalue"], rows["FedAvg"].cells["trace"]
    assert top.n == 2 and top.mean == pytest.approx(11.0) and "FedAvg-s1" in top.left_out and "tol 0.9" in top.left_out
    assert trace.n == 2 and trace.mean == pytest.approx(110.0) and "<= 3 HVPs" in trace.left_out
    assert "tol 0.001" in top.setting and "<= 100 HVPs, rtol 0.01" in trace.setting
    # the tolerance alone: the trace of the same analysis is averaged with the others
    recs[2] = _record(tmp_path, "FedAvg", 1, 1.0, settings=dict(tight, tol=0.9))
    rows = {r.method: r for r in build_table(spec, recs, []) if r.partition == "dirichlet-0.3"}
    assert rows["FedAvg"].cells["top_eigenvalue"].n == 2 and rows["FedAvg"].cells["trace"].n == 3


def test_a_report_asking_for_settings_never_takes_a_test_split_hessian(tmp_path):
    from flatfl.report.missing import settings_ok

    ok = settings_ok({"top": 1})
    assert ok({"settings": {"top": 1, "split": "train"}}) and not ok({"settings": {"top": 1, "split": "test"}})
    assert all(p[s].get("split") == "train" for t in __import__("flatfl.paper_tables", fromlist=["REPRODUCED"])
               .REPRODUCED.values() for p in t.presets.values() for s in ("hessian", "spectrum") if s in p)


def test_an_analysis_with_other_settings_is_never_reused_for_the_default(tmp_path):
    """A result file records what ran; a sweep, reproduce or ``report --compute-missing`` that asks for the
    defaults (None: cross-entropy, the whole split, no relative stop, the method's own trace estimator) must not
    skip computing it because a hessian.json made with ``--loss``, ``--samples``, ``--trace-rtol`` or
    ``--trace-method`` is there."""
    import dataclasses

    from flatfl.analysis.commands.hessian_command import settings_record
    from flatfl.run_layout import settings_match
    from flatfl.analysis.commands.hessian_settings import HessianSettings

    asked = dataclasses.asdict(HessianSettings())
    assert asked["loss"] is None and asked["samples"] is None and asked["trace_method"] is None
    assert settings_match(settings_record(HessianSettings(), "cpu"), asked)
    assert settings_match(settings_record(HessianSettings(device="cuda", data_dir="elsewhere"), "cuda:0"), asked)
    for other in (dict(loss="my_losses:smooth"), dict(samples=512), dict(trace_rtol=None), dict(trace_rtol=0.1),
                  dict(trace_method="hutchinson"), dict(split="test"), dict(method="power")):
        assert not settings_match(settings_record(HessianSettings(**other), "cpu"), asked), other
    # None asks for the method's own trace estimator: PyHessian's with power iteration
    power = dataclasses.asdict(HessianSettings(method="power"))
    assert settings_match(settings_record(HessianSettings(method="power"), "cpu"), power)
    assert not settings_match(settings_record(HessianSettings(method="power", trace_method="hutchpp"), "cpu"), power)
    # a file of an older flatfl that recorded no loss measured cross-entropy
    old = {k: v for k, v in settings_record(HessianSettings(), "cpu").items() if k != "loss"}
    assert settings_match(old, asked)


def test_a_pair_differing_in_a_shared_setting_or_network_is_incomparable(tmp_path):
    spec = TABLES["man-table2"]

    def check(ref_cfg=None, cmp_cfg=None, ref_net=None, cmp_net=None):
        recs = [_record(tmp_path, "FedAvg", s, 10.0 + s, config=ref_cfg, network=ref_net) for s in (0, 1, 2)]
        recs += [_record(tmp_path, "FedAvg+MAN", s, 5.0 + s, config=cmp_cfg, network=cmp_net) for s in (0, 1, 2)]
        return next(c for c in direction_checks(spec, build_table(spec, recs, []))
                    if c["metric"] == "top_eigenvalue" and c["partition"] == "dirichlet-0.3")

    assert check()["verdict"] != "incomparable"
    lr = check({"lr": 0.1}, {"lr": 0.05})
    assert lr["verdict"] == "incomparable" and lr["incomparable_because"] == "trained differently: lr 0.1 vs 0.05"
    net = {"name": "custom", "custom": True, "class": "m.Net", "factory": None, "structure": {"modules": [1]}}
    other = check(ref_net=net, cmp_net=dict(net, structure={"modules": [2]}))
    assert other["verdict"] == "incomparable" and "model-structure" in other["incomparable_because"]


# ------------------------------------------------------------------------------ 3. contrast
HEADER = ("table,partition,reference,compared,metric,ours_reference,ours_compared,ours_change_pct,paper_change_pct,"
          "paired_ci_low,paired_ci_high,paired_seeds,verdict,paired_change")


def _report(folder: Path, rows, *, setting="all-clients average, lanczos, 100 samples", runs_field="a;b") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps({"ours_scale": f"ours: {folder.name}", "tables": ["man-table2"],
                                                     "models": {"man-table2": "clients-average"}}))
    (folder / "directions.csv").write_text("\n".join([HEADER] + rows) + "\n")
    (folder / "man-table2.csv").write_text(
        "table,method,partition,runs,ours_trace,ours_trace_n,ours_trace_sd,ours_trace_setting,paper_trace\n"
        f'man-table2,FedAvg,dirichlet-0.3,{runs_field},10,3,0.5,"{setting}",8744\n')
    return folder


def test_contrast_shows_the_change_over_the_seeds_of_its_interval(tmp_path):
    """Report A: over all seeds the means rise 5%, over the 2 seeds both rows share the per-seed difference is -2
    (interval -3 .. -1): the change shown beside that interval is -20%, the all-seeds +5% kept beside it."""
    a = _report(tmp_path / "a", ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,10,10.5,5,-50,-3,-1,2,agree,-2",
                                 "man-table2,dirichlet-0.6,FedAvg,FedAvg+MAN,trace,10,9,-10,-48,,,1,too few seeds,"])
    b = _report(tmp_path / "b", ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,50,40,-20,-50,-15,-5,3,agree,-10",
                                 "man-table2,dirichlet-0.3,FedSAM,FedSAM+MAN,trace,5,4,-20,-45,-2,-0.1,3,agree,-1"],
                setting="all-clients average, lanczos, 100 samples, test split")
    out = tmp_path / "c"
    res = _invoke("contrast", a, b, "--label", "A", "--label", "B", "--out", out)
    assert res.exit_code == 0, res.output
    assert "notice: 2 comparisons not held by every report are left out" in res.output
    got = {(r["report"], r["partition"]): r for r in csv.DictReader((out / "contrast.csv").open())}
    r = got[("A", "dirichlet-0.3")]
    assert float(r["ours_change_pct"]) == pytest.approx(-20.0) and float(r["all_seeds_change_pct"]) == 5.0
    assert float(r["ci_low_pct"]) <= float(r["ours_change_pct"]) <= float(r["ci_high_pct"])
    assert r["change_over"] == "2 shared seeds"
    md = (out / "contrast.md").read_text()
    assert "-20.0% [-30.0, -10.0] agree (all seeds +5.0%)" in md
    assert "trace: all-clients average, lanczos, 100 samples, test split" in md  # each report's settings
    assert "model: man-table2 clients-average" in md
    summary = json.loads((out / "contrast.json").read_text())
    dropped = {(d["partition"], d["reference"]): d["held_by"] for d in summary["dropped"]}
    assert dropped == {("dirichlet-0.6", "FedAvg"): ["A"], ("dirichlet-0.3", "FedSAM"): ["B"]}
    assert "## Comparisons not in every report (dropped)" in md and "| FedSAM+MAN vs FedSAM |" in md


def test_contrast_of_a_report_without_paired_change_uses_its_intervals_centre(tmp_path):
    from flatfl.report.contrast import contrast_rows, read_report

    rows = ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,10,12,20,-50,-3,-1,2,agree,"]
    a, b = _report(tmp_path / "a", rows), _report(tmp_path / "b", rows)
    out = contrast_rows([read_report(a), read_report(b)], ["a", "b"])
    assert out[0]["ours_change_pct"] == pytest.approx(-20.0) and out[0]["all_seeds_change_pct"] == 20.0


# ------------------------------------------------------------------------------ 4. bounded readers
def test_long_fields_flatfl_writes_are_read(tmp_path):
    rows = ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,10,12,20,-50,1,3,3,disagree,2"]
    long_runs = ";".join(f"run-{i:06d}" for i in range(20_000))  # 220,000 characters: over csv's default limit
    a, b = _report(tmp_path / "a", rows, runs_field=long_runs), _report(tmp_path / "b", rows)
    before = csv.field_size_limit()
    res = _invoke("contrast", a, b, "--out", tmp_path / "c")
    assert res.exit_code == 0, res.output
    assert csv.field_size_limit() == before  # the process's limit is restored


def test_an_absurd_field_is_one_line(tmp_path, monkeypatch):
    import flatfl.report.bounded as bounded

    monkeypatch.setattr(bounded, "MAX_FIELD_CHARS", 1000)
    rows = ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,10,12,20,-50,1,3,3,disagree,2"]
    a, b = _report(tmp_path / "a", rows, runs_field="x" * 5000), _report(tmp_path / "b", rows)
    res = _invoke("contrast", a, b, "--out", tmp_path / "c")
    _one_line_error(res, "man-table2.csv line 2: a field over 1,000 characters")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("depth", [100, 200_000])
def test_a_deeply_nested_summary_is_one_line(tmp_path, depth):
    rows = ["man-table2,dirichlet-0.3,FedAvg,FedAvg+MAN,trace,10,12,20,-50,1,3,3,disagree,2"]
    a, b = _report(tmp_path / "a", rows), _report(tmp_path / "b", rows)
    (b / "summary.json").write_text("[" * depth + "]" * depth)
    res = _invoke("contrast", a, b, "--out", tmp_path / "c")
    _one_line_error(res, "summary.json: JSON nested more than 64 levels deep")


def test_report_reads_long_metrics_fields_and_refuses_absurd_ones(runs, tmp_path, monkeypatch):
    import flatfl.report.bounded as bounded

    run = tmp_path / "fedavg-s0"
    shutil.copytree(runs / "digits" / "fedavg-s0", run)
    lines = (run / "metrics.csv").read_text().splitlines()
    (run / "metrics.csv").write_text("\n".join([lines[0] + ",note"] + [x + "," + "n" * 200_000 for x in lines[1:]])
                                     + "\n")
    assert build_report([run], tmp_path / "r")["runs"] == 1
    monkeypatch.setattr(bounded, "MAX_FIELD_CHARS", 1000)
    res = _invoke("report", run, "--out", tmp_path / "r2", "--threads", "1")
    _one_line_error(res, "metrics.csv line 2: a field over 1,000 characters")


@pytest.mark.parametrize("depth", [100, 200_000])
def test_report_refuses_a_deeply_nested_config_in_one_line(runs, tmp_path, depth):
    run = tmp_path / "fedavg-s0"
    shutil.copytree(runs / "digits" / "fedavg-s0", run)
    info = (run / "config.json").read_text()
    (run / "config.json").write_text(info.replace('"resolved":', '"deep": ' + "[" * depth + "]" * depth
                                                  + ', "resolved":', 1))
    res = _invoke("report", run, "--out", tmp_path / "r", "--threads", "1")
    _one_line_error(res, "config.json")
    assert "nested" in res.output
    assert not (tmp_path / "r" / "runs.csv").exists()


def test_bounded_loads_and_rows():
    from flatfl.report.bounded import check_depth, csv_rows, loads

    assert loads('{"a": [1, 2]}', "x.json") == {"a": [1, 2]}
    with pytest.raises(ConfigError, match="x.json: not JSON"):
        loads("{", "x.json")
    with pytest.raises(ConfigError, match="nested more than 3 levels"):
        check_depth([[[[1]]]], "x.json", 3)
    fields, rows = csv_rows("a,b\n1,2\n", "x.csv")
    assert fields == ["a", "b"] and rows == [(2, {"a": "1", "b": "2"})]


def test_a_report_file_the_user_rewrote_is_kept(runs, tmp_path):
    """report.md that flatfl wrote and the user then replaced with notes of their own counts as the user's (the
    manifest records the content's digest, not the name alone): the next report refuses, the notes are kept; the
    report.md flatfl wrote, untouched, is replaced as before."""
    out = tmp_path / "rep"
    build_report([runs / "digits"], out, tables=["man-table2"])
    assert _invoke("report", runs / "digits", "--out", out, "--table", "man-table2").exit_code == 0
    (out / "report.md").write_text("my notes on this report\n")
    res = _invoke("report", runs / "digits", "--out", out, "--table", "man-table2")
    _one_line_error(res, "report.md exists and was changed since flatfl wrote it")
    assert (out / "report.md").read_text() == "my notes on this report\n"


def test_an_earlier_reports_table_of_another_layout_is_removed(runs, tmp_path):
    """A report written into the folder of an earlier flatfl report of another layout: the earlier table's CSV is
    removed (it would sit beside the new report as if part of it); a CSV of the user's is never touched."""
    out = tmp_path / "rep"
    build_report([runs / "digits"], out, tables=["man-table2"])
    assert (out / "man-table2.csv").is_file()
    (out / "notes.csv").write_text("mine\n")
    summary = build_report([runs / "digits"], out, tables=["man-table6"])
    assert not (out / "man-table2.csv").exists() and (out / "man-table6.csv").is_file()
    assert "man-table2.csv" not in summary["files"] and (out / "notes.csv").read_text() == "mine\n"


@pytest.mark.parametrize("flags, fragment", [(["--top", "-1"], "--top must be a non-negative integer"),
                                             (["--method", "bogus"], "unknown eigenvalue method 'bogus'"),
                                             (["--samples", "0"], "--samples must be a positive integer")])
def test_hessian_settings_asked_of_a_report_are_checked_without_compute_missing(runs, tmp_path, flags, fragment):
    """Settings no analysis could have been made with are refused in one line, not a report of empty cells; a
    method name in other case is the method."""
    _one_line_error(_invoke("report", runs / "digits", "--out", tmp_path / "r", *flags), fragment)
    assert not (tmp_path / "r").exists()
    res = _invoke("report", runs / "digits", "--out", tmp_path / "ok", "--method", "Lanczos")
    assert res.exit_code == 0 and "method lanczos" in res.output, res.output
