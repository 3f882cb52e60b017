"""``flatfl reproduce``: the paper preset carries the papers' settings; the tiny preset runs end to end (training,
analyses, report) and a second call trains and analyses nothing again."""
from __future__ import annotations

import csv
import json
import re

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.train.config import build_config
from flatfl.errors import ConfigError
from flatfl.report import pdf_page_count
from flatfl.reproduce import RunOptions, Selection, plan


def _by_name(tasks):
    return {t.name: t for t in tasks}


def _cfg(task):
    return build_config({}, task.settings)


def test_paper_preset_man_settings_are_the_papers():
    tasks = _by_name(plan(Selection("man-tables", "paper"), runs_dir="/tmp/x"))
    assert len(tasks) == 24  # (4 + 2 algorithms) x (with, without MAN) x (delta 0.3, 0.6)
    for t in tasks.values():
        c = _cfg(t)
        # MAN Sec. 4 and supplementary Sec. 7: CIFAR-100, 100 clients, 10% participation, 500 rounds, lr 0.1 decayed
        # 0.998 per round, batch 50, 5 local epochs, clipping 10; weight decay 1e-3 (docs/update-rules.md §0)
        assert (c.dataset, c.model, c.clients, c.participation, c.sampling) == \
            ("cifar100", "cifar-cnn", 100, 0.1, "bernoulli")
        assert (c.rounds, c.lr, c.lr_decay, c.batch_size, c.local_epochs, c.clip, c.weight_decay) == \
            (500, 0.1, 0.998, 50, 5, 10.0, 1e-3)
        assert c.partition == "dirichlet" and c.alpha in (0.3, 0.6)
        assert t.hessian["method"] == "power" and t.hessian["samples"] is None  # PyHessian's protocol, all data
    p = {n: t.settings.get("params", {}) for n, t in tasks.items()}
    assert p["fedavg-man-dirichlet0.3-s0"]["zeta"] == 0.6  # supplementary Sec. 7: FedAvg+MAN
    assert p["feddyn-man-dirichlet0.6-s0"] == {"feddyn_alpha": 0.01, "zeta": 0.15}  # main paper: 0.15 on CIFAR-100
    # FedDC as the fedMAN code ran it: undecayed lr and the mean-size step count in the g_i update
    assert p["feddc-dirichlet0.3-s0"] == {"feddc_alpha": 0.01, "cv_lr": "initial", "steps_rule": "mean"}
    assert p["fedsam-dirichlet0.3-s0"] == {"rho": 0.05}
    assert p["fedasam-man-dirichlet0.3-s0"] == {"rho": 0.5, "eta": 0.2, "zeta": 0.15}
    assert p["fedspeed-dirichlet0.6-s0"] == {"rho": 0.1, "fedspeed_lambda": 0.01}
    assert "reg" not in tasks["fedspeed-dirichlet0.6-s0"].settings
    # MAN Fig. 4: top 200 eigenvalues and the density, for FedAvg and FedSAM with and without MAN
    with_spectrum = sorted(n for n, t in tasks.items() if t.spectrum)
    assert len(with_spectrum) == 8 and all(n.startswith(("fedavg", "fedsam")) for n in with_spectrum)
    assert tasks["fedavg-dirichlet0.3-s0"].spectrum["top"] == 200 and tasks["fedavg-dirichlet0.3-s0"].spectrum["density"]


def test_paper_preset_fedalign_settings_are_the_papers():
    tasks = _by_name(plan(Selection("fedalign-table1", "paper"), runs_dir="/tmp/x"))
    assert len(tasks) == 7
    for t in tasks.values():
        c = _cfg(t)
        # FedAlign Sec. 3.2 and docs/update-rules.md §18: ResNet-56, 16 clients all participating, Dirichlet 0.5, 25 rounds x 20
        # local epochs, lr 0.01, momentum 0.9 Nesterov, weight decay 1e-4, batch 64
        assert (c.dataset, c.model, c.clients, c.participation, c.partition, c.alpha) == \
            ("cifar100", "resnet56", 16, 1.0, "fedml-dirichlet", 0.5)
        assert (c.rounds, c.local_epochs, c.lr, c.lr_decay, c.momentum, c.nesterov, c.weight_decay, c.batch_size) == \
            (25, 20, 0.01, 1.0, 0.9, True, 1e-4, 64)
        assert c.save_clients and t.clients["protocol"] == "fedalign"
    p = {n: t.settings.get("params", {}) for n, t in tasks.items()}
    assert p["fedprox-fedml-dirichlet0.5-s0"] == {"mu": 1e-4}
    assert p["moon-fedml-dirichlet0.5-s0"] == {"moon_mu": 1.0, "moon_tau": 0.5}
    assert p["fedavg-gradaug-fedml-dirichlet0.5-s0"] == {"gradaug_mu": 1.75, "num_subnets": 2, "width": 0.8}
    assert p["fedavg-mixup-fedml-dirichlet0.5-s0"] == {"mixup_gamma": 0.1}
    assert p["fedavg-stochdepth-fedml-dirichlet0.5-s0"] == {"survival_last": 0.9}
    assert p["fedavg-fedalign-fedml-dirichlet0.5-s0"] == {"fedalign_mu": 0.45, "width": 0.25}
    assert tasks["fedavg-fedalign-fedml-dirichlet0.5-s0"].settings["clip"] == 10.0


def test_quick_preset_keeps_the_methods_and_their_hyper_parameters():
    paper = _by_name(plan(Selection("man-tables", "paper")))
    quick = _by_name(plan(Selection("man-tables", "quick", seeds=(0,))))
    assert sorted(paper) == sorted(quick)
    for name in paper:
        assert paper[name].settings.get("params") == quick[name].settings.get("params")
        assert _cfg(quick[name]).dataset == "digits"
    table2 = {t.run_dir for t in plan(Selection("man-table2", "quick", seeds=(0,)))}
    assert table2 < {t.run_dir for t in quick.values()}  # man-table2 and man-tables share their run folders


@pytest.mark.parametrize("preset", ["quick", "paper"])
def test_presets_follow_the_code_that_produced_the_man_tables(preset):
    """FedDC runs with the fedMAN/FedDC code's --cv-lr initial and --steps-rule mean, with and without
    MAN, at both deltas; FedDyn, FedSpeed and the rest carry no such switch; every method says what it follows."""
    from flatfl.reproduce import CODE_FOLLOWED

    tasks = _by_name(plan(Selection("man-tables", preset), runs_dir="/tmp/x"))
    feddc = [t for n, t in tasks.items() if n.startswith("feddc")]
    assert len(feddc) == 4 * (3 if preset == "quick" else 1)  # (with, without MAN) x 2 deltas x seeds
    for t in feddc:
        c = _cfg(t)
        assert c.algo == "feddc" and c.params["cv_lr"] == "initial" and c.params["steps_rule"] == "mean"
    for n, t in tasks.items():
        if not n.startswith("feddc"):
            assert not {"cv_lr", "steps_rule"} & set(t.settings.get("params", {})), n
    labels = {n.split("-dirichlet")[0] for n in tasks}
    for label in ("FedAvg", "FedSAM", "FedASAM", "FedDyn", "FedDC", "FedSpeed", "MAN"):
        assert label in CODE_FOLLOWED and any(label.lower() in x.split("-") for x in labels)
    assert "FedDC" in CODE_FOLLOWED and "initial" in CODE_FOLLOWED["FedDC"] and "mean" in CODE_FOLLOWED["FedDC"]


def test_quick_preset_defaults_to_three_seeds_and_pinned_threads():
    from flatfl.reproduce import REPRODUCE_THREADS

    quick = plan(Selection("man-tables", "quick"), runs_dir="/tmp/x")
    assert len(quick) == 72 and sorted({t.settings["seed"] for t in quick}) == [0, 1, 2]
    assert {t.name for t in plan(Selection("man-tables", "quick", seeds=(0,)), runs_dir="/tmp/x")} == \
        {t.name for t in quick if t.name.endswith("-s0")}
    assert len(plan(Selection("man-tables", "paper"), runs_dir="/tmp/x")) == 24  # one seed: GPU-days per run
    assert REPRODUCE_THREADS == 1
    # the Fig. 4 spectrum (top 50 + density) for the FedAvg and FedSAM pairs of the first seed only
    with_spectrum = sorted(t.name for t in quick if t.spectrum)
    assert len(with_spectrum) == 8 and all(n.endswith("-s0") and n.startswith(("fedavg", "fedsam"))
                                           for n in with_spectrum)
    assert all(t.hessian["top"] == 1 and t.hessian["trace"] for t in quick)
    later = [t for t in plan(Selection("man-table2", "quick", seeds=(2, 1)), runs_dir="/tmp/x") if t.spectrum]
    assert later and all(t.name.endswith("-s2") for t in later)  # 'first' is the first seed asked for
    assert all(t.spectrum for t in plan(Selection("man-table2", "paper", seeds=(0, 1)), runs_dir="/tmp/x")
               if t.name.startswith(("fedavg", "fedsam")))  # paper: every seed


def test_two_seeds_give_mean_sd_and_inconclusive_where_seeds_disagree(tmp_path, reports_undrawn):
    """The tiny preset's FedAvg and FedAvg+MAN rows over seeds 0 and 1 (both deltas): every table value
    is the mean over the two seeds' hessian.json / metrics.csv values with their sample sd, shown as '±sd (n=2)';
    every direction's verdicts (paired by seed, and unpaired) follow from the per-seed values computed here; where
    the two seeds' own changes point opposite ways both are 'inconclusive' (and such a case occurs)."""
    import math
    import statistics
    from pathlib import Path

    from flatfl.report import build_report
    from flatfl.sweep import run_tasks

    tasks = [t for t in plan(Selection("man-table2", "tiny", seeds=(0, 1)), RunOptions(threads=1),
                             runs_dir=tmp_path / "runs")
             if t.name.startswith(("fedavg-dirichlet", "fedavg-man-dirichlet"))]
    assert len(tasks) == 8
    with reports_undrawn(analyses=True):  # the numbers: no figure of the runs' analyses or of the report drawn
        assert all(r["error"] is None for r in run_tasks(tasks))
        build_report([t.run_dir for t in tasks], tmp_path / "rep", tables=("man-table2",))

    def values(name):
        run = tmp_path / "runs" / name
        h = json.loads((run / "hessian-clients-average" / "hessian.json").read_text())
        last = list(csv.DictReader((run / "metrics.csv").open()))[-1]
        return {"top_eigenvalue": h["top_eigenvalues"][0], "trace": h["trace"]["estimate"],
                "accuracy": 100 * float(last["all_test_acc"])}

    seeds = {}  # (method, partition) -> [seed 0 values, seed 1 values]
    for method, slug in (("FedAvg", "fedavg"), ("FedAvg+MAN", "fedavg-man")):
        for delta in ("0.3", "0.6"):
            seeds[(method, f"dirichlet-{delta}")] = [values(f"{slug}-dirichlet{delta}-s{s}") for s in (0, 1)]
    rows = {(r["method"], r["partition"]): r for r in csv.DictReader((tmp_path / "rep" / "man-table2.csv").open())}
    md = (tmp_path / "rep" / "report.md").read_text()
    for key, (v0, v1) in seeds.items():
        row = rows[key]
        assert row["n_runs"] == "2"
        for m in v0:
            assert math.isclose(float(row[f"ours_{m}"]), (v0[m] + v1[m]) / 2, rel_tol=1e-9)
            assert math.isclose(float(row[f"ours_{m}_sd"]), statistics.stdev([v0[m], v1[m]]), rel_tol=1e-9)
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {key[0]} | {key[1]} |"))
        assert line.count("(n=2)") == 3 and line.count("±") == 3, line
    disagreeing = 0
    for c in csv.DictReader((tmp_path / "rep" / "directions.csv").open()):
        (a0, a1), (b0, b1) = seeds[("FedAvg", c["partition"])], seeds[("FedAvg+MAN", c["partition"])]
        m = c["metric"]
        change = (b0[m] + b1[m]) / 2 - (a0[m] + a1[m]) / 2
        se = math.sqrt(statistics.stdev([a0[m], a1[m]]) ** 2 / 2 + statistics.stdev([b0[m], b1[m]]) ** 2 / 2)
        assert math.isclose(float(c["ours_change"]), change, rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(float(c["ours_uncertainty"]), se, rel_tol=1e-9)
        paper_lower = c["paper_direction"] == "lower"
        want = "inconclusive" if abs(change) <= 2 * se else ("agree" if (change < 0) == paper_lower else "disagree")
        assert c["unpaired_verdict"] == want, c
        # paired by seed, k = 2: d_s = b_s - a_s; se of the mean |d0 - d1| / 2; t(0.975, 1) = 12.7062
        d0, d1 = b0[m] - a0[m], b1[m] - a1[m]
        mean = (d0 + d1) / 2
        paired = "inconclusive" if abs(mean) <= 12.7062047 * abs(d0 - d1) / 2 else \
            ("agree" if (mean < 0) == paper_lower else "disagree")
        assert c["verdict"] == paired and c["verdict_from"] == "paired, k=2", c
        if d0 * d1 < 0:  # the seeds disagree on the direction
            disagreeing += 1
            assert c["verdict"] == c["unpaired_verdict"] == "inconclusive", c
    assert disagreeing >= 1


def test_bad_targets_presets_and_seeds():
    with pytest.raises(ConfigError, match="unknown reproduction target"):
        plan(Selection("man-table9"))
    with pytest.raises(ConfigError, match="unknown preset"):
        plan(Selection("man-table2", "huge"))
    with pytest.raises(ConfigError, match="--seeds"):
        plan(Selection("man-table2", "tiny", seeds=()))
    res = CliRunner().invoke(main, ["reproduce", "man-table6", "--preset", "tiny", "--seeds", "a,b"])
    assert res.exit_code == 2 and "flatfl: error: --seeds must be comma-separated integers" in res.output
    with pytest.raises(ConfigError, match="fedalign-table1 has no preset 'fmnist'"):
        plan(Selection("fedalign-table1", "fmnist"))


def test_fmnist_preset_plans_the_man_tables_on_fashion_mnist(tmp_path):
    """72 runs (12 methods x 2 deltas x seeds 0, 1, 2) on Fashion-MNIST; the Fig. 4 spectrum for seed 0 only."""
    tasks = plan(Selection("man-tables", "fmnist"), runs_dir=tmp_path)
    assert len(tasks) == 72 and {t.settings["seed"] for t in tasks} == {0, 1, 2}
    assert {t.settings["dataset"] for t in tasks} == {"fashion-mnist"}
    assert {t.settings["alpha"] for t in tasks} == {0.3, 0.6}
    assert all(t.hessian["samples"] == 2000 for t in tasks)
    assert {t.settings["seed"] for t in tasks if t.spectrum} == {0} and sum(bool(t.spectrum) for t in tasks) == 8


def test_fmnist_cnn_preset_is_the_fmnist_plan_with_the_papers_cnn_family(tmp_path):
    """fmnist-cnn differs from fmnist in the network only (the MAN CNN at LeNet-5 widths), so the two reports
    contrast an MLP and a CNN under one protocol."""
    cnn = plan(Selection("man-tables", "fmnist-cnn"), runs_dir=tmp_path)
    mlp = plan(Selection("man-tables", "fmnist"), runs_dir=tmp_path)
    assert len(cnn) == len(mlp) == 72
    for c, m in zip(cnn, mlp):
        assert c.settings["model"] == "cifar-cnn" and c.settings["model_args"] == {"channels": [6, 16],
                                                                                  "hidden": [120, 84]}
        assert {k: v for k, v in c.settings.items() if k not in ("model", "model_args", "out")} == \
            {k: v for k, v in m.settings.items() if k not in ("model", "model_args", "out")}
        assert c.hessian == m.hessian and c.spectrum == m.spectrum


def test_tiny_man_table6_end_to_end_then_nothing_twice(tmp_path, reports_undrawn):
    out, runs = tmp_path / "report", tmp_path / "runs"
    # one worker: the runs in this process (a pool of workers: tests/test_interrupts.py, test_reliability.py)
    args = ["reproduce", "man-table6", "--preset", "tiny", "--out", str(out), "--runs-dir", str(runs),
            "--threads", "1", "--workers", "1"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert res.output.count("train trained, hessian computed") == 8
    rows = list(csv.DictReader((out / "man-table6.csv").open()))
    assert len(rows) == 8 and all(r["n_runs"] == "1" for r in rows)
    for r in rows:
        # MAN reports the all-clients average: the Hessian is of final-clients-average.pt
        h = json.loads((runs / r["runs"] / "hessian-clients-average" / "hessian.json").read_text())
        assert h["checkpoint"].endswith("final-clients-average.pt") and r["model"] == "all-clients average"
        assert float(r["ours_top_eigenvalue"]) == h["top_eigenvalues"][0]
        assert float(r["ours_trace"]) == h["trace"]["estimate"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tables"] == ["man-table6"] and summary["missing"] == []
    assert summary["pages"] == ["effects", "summary", "man-table6: table", "man-table6: directions",
                                "man-table6: accuracy", "runs"]
    assert pdf_page_count((out / "report.pdf").read_bytes()) == 6
    counts = summary["directions"]["man-table6"]
    assert counts["top_eigenvalue"]["compared"] == counts["trace"]["compared"] == 4
    assert "top eigenvalue: " in res.output and "agree with the paper's direction" in res.output
    last = res.output.strip().splitlines()[-1]  # the one-line summary: counts and where the report is
    assert re.fullmatch(rf"man-table6 \(tiny\): 8 of 8 runs done, 1 tables in \d+ s -> {re.escape(str(out))}/report\.pdf",
                        last), last

    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file()}
    with reports_undrawn():  # the second call: what it trains and analyses (nothing); the report was checked above
        again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert again.output.count("train skipped, hessian skipped") == 8
    assert stamps == {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file()}  # nothing rewritten


def test_missing_cuda_is_one_line_not_one_per_run(tmp_path, monkeypatch):
    """The device (and the dataset) are checked once before any run starts: one error line, not one per run."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["reproduce", "man-table6", "--preset", "tiny", "--device", "cuda", "--workers",
                                    "1", "--out", str(tmp_path / "r"), "--runs-dir", str(tmp_path / "runs")])
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if "CUDA" in ln]
    assert errors == ["flatfl: error: device 'cuda' asked for, but CUDA is not available on this machine"]
    assert "FAILED" not in res.output and not (tmp_path / "runs").exists()


def test_reproduce_help_states_every_presets_default_seeds_and_keeps_target_names_whole():
    from flatfl.reproduce import DEFAULT_SEEDS, PRESETS, TARGETS

    for width in (60, 80, 120):
        out = CliRunner().invoke(main, ["reproduce", "--help"], terminal_width=width).output
        head = out.split("Options")[0]
        assert "TARGET" in head.splitlines()[0] or "TARGET" in head.splitlines()[1]  # the usage line
        for target in TARGETS:  # never broken across lines at a hyphen
            assert re.search(rf"(?<![\w-]){re.escape(target)}(?![\w-])", head), (width, target, head)
    text = " ".join(out.split())
    clause = re.search(r"comma-separated seeds, e\.g\. 0,1,2 \(default: (.*?)\)", text).group(1)
    stated = {}
    for seeds, presets in re.findall(r"(\d+(?:,\d+)*) for ([a-z][a-z-]*(?:(?:, | and )[a-z][a-z-]*)*)", clause):
        for preset in re.split(r", | and ", presets):
            stated[preset] = tuple(int(s) for s in seeds.split(","))
    assert stated == {p: DEFAULT_SEEDS[p] for p in PRESETS}


def test_methods_runs_only_the_named_rows(tmp_path, reports_undrawn):
    """--methods: the runs of the named rows only (names matched ignoring case), each planned exactly as in the full
    reproduction; an unknown name is one line listing the table's rows, before any run folder exists."""
    from flatfl.report.records import method_label

    every = plan(Selection("man-tables", "tiny"), runs_dir=tmp_path)
    some = plan(Selection("man-tables", "tiny", methods="fedavg, FedSpeed+MAN"), runs_dir=tmp_path)
    assert {method_label(_cfg(t).to_dict()) for t in some} == {"FedAvg", "FedSpeed+MAN"}
    assert len(some) == 4  # 2 rows x 2 deltas x seed 0
    full = _by_name(every)
    assert all(t.settings == full[t.name].settings and t.hessian == full[t.name].hessian for t in some)

    out, runs = tmp_path / "report", tmp_path / "runs"
    args = ["reproduce", "man-table6", "--preset", "tiny", "--out", str(out), "--runs-dir", str(runs), "--threads",
            "1", "--workers", "1"]
    bad = CliRunner().invoke(main, args + ["--methods", "FedAvg,fedspeed"])
    assert bad.exit_code == 2 and bad.output.strip() == (
        "flatfl: error: --methods: unknown method(s) 'FedAvg' for man-table6; choose from FedASAM, FedASAM+MAN, "
        "FedSpeed, FedSpeed+MAN")
    assert not runs.exists()
    with reports_undrawn():  # the runs and the table's rows
        res = CliRunner().invoke(main, args + ["--methods", "FedSpeed"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in runs.iterdir()) == ["fedspeed-dirichlet0.3-s0", "fedspeed-dirichlet0.6-s0"]
    rows = {(r["method"], r["partition"]): r["n_runs"] for r in csv.DictReader((out / "man-table6.csv").open())}
    assert {k for k, n in rows.items() if n != "0"} == {("FedSpeed", "dirichlet-0.3"), ("FedSpeed", "dirichlet-0.6")}
    # one line per run, with the time elapsed and the time left across the runs
    progress = [ln for ln in res.output.splitlines() if ln.startswith("[")]
    assert len(progress) == 2
    assert re.fullmatch(r"\[1/2\] fedspeed-dirichlet0\.\d-s0: train trained, hessian computed \(\d+\.\d s\) \| "
                        r"\d+ s elapsed, about \d+ s left", progress[0]), progress[0]
    assert progress[1].endswith("elapsed, no run left to train"), progress[1]


def test_progress_estimates_the_time_left_from_the_runs_trained(tmp_path):
    """The estimate: wall time per run trained so far x runs left to train; a run finished before the start
    (skipped) counts in neither."""
    import flatfl.reproduce as rep
    from flatfl.sweep import RunTask

    tasks = [RunTask(f"r{k}", str(tmp_path / f"r{k}"), {}) for k in range(4)]
    (tmp_path / "r0").mkdir()  # r0 finished before: skipped
    (tmp_path / "r0" / "config.json").write_text(json.dumps({"flatfl_version": "0.1.0", "config": {}}))
    (tmp_path / "r0" / "final.pt").write_bytes(b"")
    clock = iter([100.0, 101.0, 111.0, 131.0, 161.0])
    lines = []
    progress = rep.Progress(tasks, lines.append, clock=lambda: next(clock))
    for t in tasks:
        progress.done(t, {}, f"{t.name}: done")
    assert lines == ["r0: done | 1 s elapsed, time left known after the first run trained",
                     "r1: done | 11 s elapsed, about 22 s left",  # 11 s for 1 run trained, 2 left
                     "r2: done | 31 s elapsed, about 16 s left",  # 31 / 2 x 1 = 15.5
                     "r3: done | 61 s elapsed, no run left to train"]


def _fake_full_report(folder, names):
    """A report folder as build_report leaves it, for the runs ``names`` (summary.json, runs.csv, report.md)."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"runs": len(names), "tables": ["man-table2", "man-table6"]}))
    (folder / "runs.csv").write_text("run,method\n" + "".join(f"{n},x\n" for n in names))
    (folder / "report.md").write_text("# the full report\n")


def test_a_restricted_reproduction_never_replaces_a_fuller_report(tmp_path, monkeypatch, reports_undrawn):
    """--methods / --seeds other than the preset's: the report goes to a folder of its own (named after the
    selection) and shows only the tables of the rows asked for; an explicit --out holding a report of runs this
    reproduction does not run is refused in one line naming --out, before any run trains."""
    import flatfl.reproduce as rep

    monkeypatch.setattr(rep, "REPORTS_DIR", tmp_path / "reports")
    full = tmp_path / "reports" / "man-tables-tiny"
    _fake_full_report(full, [t.name for t in plan(Selection("man-tables", "tiny"), runs_dir=tmp_path / "runs")])
    before = {p.name: p.read_bytes() for p in full.iterdir()}
    runs = tmp_path / "runs"
    args = ["reproduce", "man-tables", "--preset", "tiny", "--runs-dir", str(runs), "--threads", "1", "--workers", "1",
            "--methods", "fedspeed"]

    bad = CliRunner().invoke(main, args + ["--out", str(full)])
    assert bad.exit_code == 2, bad.output
    assert bad.stderr.strip().splitlines() == [
        f"flatfl: error: --out {full} holds a report of 24 runs, 22 of them not in this reproduction (e.g. "
        "fedasam-dirichlet0.3-s0); a report of fewer runs would replace it: choose another --out (a reproduction "
        "restricted by --methods or --seeds has one of its own when --out is not given)"]
    assert not runs.exists() and {p.name: p.read_bytes() for p in full.iterdir()} == before

    with reports_undrawn():  # where the report goes and what it holds (its tables), not its figures
        res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    own = tmp_path / "reports" / "man-tables-tiny-fedspeed"
    assert rep.default_out("man-tables", "tiny", "FedSpeed") == own
    assert res.output.strip().splitlines()[-1].endswith(f"-> {own}/report.pdf"), res.output
    assert {p.name: p.read_bytes() for p in full.iterdir()} == before  # the full report untouched
    summary = json.loads((own / "summary.json").read_text())
    assert summary["tables"] == ["man-table6"] and summary["runs"] == 2  # FedSpeed is a row of Table 6 only
    with (own / "man-table6.csv").open() as f:  # and the table shows only the row asked for, no empty ones
        assert {row["method"] for row in csv.DictReader(f)} == {"FedSpeed"}
    # the same selection again replaces its own report; other seeds than the preset's get another folder
    with reports_undrawn():
        assert CliRunner().invoke(main, args).exit_code == 0
    assert rep.default_out("man-tables", "tiny", "FedSpeed", (0, 1)).name == "man-tables-tiny-fedspeed-s0-1"
    assert rep.default_out("man-tables", "tiny", None, (0,)) == full  # the preset's seeds: the full report
    long = rep.default_out("man-tables", "tiny", ",".join(rep.methods_of("man-tables")[:-1]))
    assert long.name.startswith("man-tables-tiny-subset-") and len(long.name) < 40


@pytest.mark.parametrize("where", ["a report.md of the user's in --out", "a folder of the user's in a run's place"])
def test_what_would_stop_a_reproduction_is_refused_before_any_run_trains(tmp_path, where):
    """A file of the user's under a name the report writes, or a folder in a run's place that is not that run
    (one with a config.json of its own): one line before anything trains, the user's files untouched."""
    runs, out = tmp_path / "runs", tmp_path / "rep"
    names = [t.name for t in plan(Selection("man-tables", "tiny", methods="FedAvg"), runs_dir=runs)]
    if where.startswith("a report.md"):
        out.mkdir()
        (out / "report.md").write_text("my notes\n")
        fragment, mine = "report.md exists and was not written by flatfl", out / "report.md"
    else:
        (runs / names[-1]).mkdir(parents=True)
        (runs / names[-1] / "config.json").write_text('{"mine": true}\n')
        fragment, mine = "is not a flatfl run (its config.json is not flatfl's)", runs / names[-1] / "config.json"
    before = mine.read_bytes()
    r = CliRunner().invoke(main, ["reproduce", "man-tables", "--preset", "tiny", "--runs-dir", str(runs), "--out",
                                  str(out), "--threads", "1", "--workers", "1", "--methods", "FedAvg"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and fragment in lines[0], r.output
    assert mine.read_bytes() == before
    assert not any((runs / n / "config.json").is_file() for n in names[:-1])  # nothing trained
