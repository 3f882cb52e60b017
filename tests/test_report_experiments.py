"""What the report treats as one experiment: rows average finished runs of distinct seeds trained alike; a second run
of a seed (another client-cohort count) counts once, a run killed before its last round is in no column, curvature
tracking does not split a row, and a pair trained differently in anything but the method gets no verdict. Real
short training runs on digits (no Hessian: the accuracy column carries the verdicts)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from flatfl.paper_tables import TABLES
from flatfl.report import build_report
from flatfl.report.experiments import training_settings
from flatfl.report.layouts import paper_values
from flatfl.report.records import collect_runs
from flatfl.report.tables import build_table, incomparable_notes
from flatfl.report.verdicts import direction_checks
from flatfl.sweep import RunTask, run_tasks

TINY = dict(dataset="digits", clients=4, participation=1.0, local_epochs=1, batch_size=50, eval_every=1,
            checkpoint_every=1, rounds=2, partition="dirichlet", alpha=0.3, parallel_clients=1)
MAN = dict(reg="man", params={"zeta": 0.6})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FedAvg seeds 0, 1; seed 0 again with 4 clients at once; seed 2 with curvature tracking; seed 3 killed in its
    second (last) round. FedAvg+MAN seeds 0, 1 with 2 rounds, and seeds 0, 1 with 3 rounds."""
    from flatfl.train import engine

    root = tmp_path_factory.mktemp("experiments")
    tracked = dict(TINY, seed=2, track_hessian=1, track_hessian_settings={"samples": 64, "trace_hvps": 4})
    tasks = [RunTask("fedavg-s0", str(root / "fedavg-s0"), dict(TINY, seed=0), threads=1),
             RunTask("fedavg-s0-p4", str(root / "fedavg-s0-p4"), dict(TINY, seed=0, parallel_clients=4), threads=1),
             RunTask("fedavg-s1", str(root / "fedavg-s1"), dict(TINY, seed=1), threads=1),
             RunTask("fedavg-s2-tracked", str(root / "fedavg-s2-tracked"), tracked, threads=1),
             RunTask("man-s0", str(root / "man-s0"), dict(TINY, seed=0, **MAN), threads=1),
             RunTask("man-s1", str(root / "man-s1"), dict(TINY, seed=1, **MAN), threads=1),
             RunTask("man3-s0", str(root / "man3-s0"), dict(TINY, seed=0, rounds=3, **MAN), threads=1),
             RunTask("man3-s1", str(root / "man3-s1"), dict(TINY, seed=1, rounds=3, **MAN), threads=1)]
    assert all(r["error"] is None for r in run_tasks(tasks))
    original = engine.Trainer.run_round

    def killed_in_round_2(self, r):  # as a process killed while training its last round
        if r == 1:
            raise RuntimeError("simulated kill")
        return original(self, r)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.Trainer, "run_round", killed_in_round_2)
        out = run_tasks([RunTask("fedavg-s3-killed", str(root / "fedavg-s3-killed"), dict(TINY, seed=3),
                                 threads=1)])
    assert out[0]["error"] and not (root / "fedavg-s3-killed" / "final.pt").exists()
    return root


def _final_accuracy(run: Path) -> float:
    """The all-clients average's last accuracy in metrics.csv, in percent (what the MAN tables show)."""
    with (run / "metrics.csv").open() as f:
        return 100 * float(list(csv.DictReader(f))[-1]["all_test_acc"])


def _tables(root: Path, names) -> tuple[dict, dict, list[str]]:
    """The MAN Table 2 rows and checks of delta 0.3 (as the report builds them, without drawing the PDF), and the
    table's notes."""
    spec = TABLES["man-table2"]
    rows = build_table(spec, collect_runs([root / n for n in names], model="clients-average"), paper_values())
    checks = {c["metric"]: c for c in direction_checks(spec, rows) if c["partition"] == "dirichlet-0.3"}
    return {r.method: r for r in rows if r.partition == "dirichlet-0.3"}, checks, incomparable_notes(spec, rows)


def _report(root: Path, names, out: Path) -> tuple[dict, dict, dict]:
    summary = build_report([root / n for n in names], out, tables=["man-table2"])
    with (out / "man-table2.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f) if r["partition"] == "dirichlet-0.3"}
    with (out / "directions.csv").open() as f:
        checks = {c["metric"]: c for c in csv.DictReader(f) if c["partition"] == "dirichlet-0.3"}
    return summary, rows, checks


def test_a_seed_trained_twice_counts_once(runs):
    """Seed 0 trained with 1 and with 4 clients at once: the weights differ in their last digits, so they are no
    copy, but they are one seed: the row has one value (seed 0's), and the pair one seed a side: no verdict."""
    from flatfl.utils.provenance import state_digest
    import torch

    digests = {n: state_digest(torch.load(runs / n / "final.pt", weights_only=True)["state_dict"])
               for n in ("fedavg-s0", "fedavg-s0-p4")}
    assert len(set(digests.values())) == 2  # not bit-identical: the copy check alone would take both
    rows, checks, notes = _tables(runs, ["fedavg-s0", "fedavg-s0-p4", "man-s0"])
    fa = rows["FedAvg"]
    assert fa.n_runs == 1 and fa.cells["accuracy"].n == 1 and fa.runs == "fedavg-s0"
    assert fa.cells["accuracy"].mean == pytest.approx(_final_accuracy(runs / "fedavg-s0"), rel=1e-12)
    assert fa.same_seed_left_out == "fedavg-s0-p4 (seed 0, as fedavg-s0)"
    assert checks["accuracy"]["verdict"] == checks["accuracy"]["unpaired_verdict"] == "too few seeds"
    assert any("a seed trained more than once counts once" in n and "fedavg-s0-p4 (seed 0, as fedavg-s0)" in n
               for n in notes)


def test_a_seed_trained_again_with_settings_that_change_no_number_is_no_copy(runs, tmp_path):
    """Seed 0 trained again with its client models saved and checkpoints every round: the same final weights, bit
    for bit, yet no copy but a second run of the seed, left out of the row by name with the settings that differ
    (not refused as 'a copy of the other'). A copy under another seed is still refused."""
    import shutil

    import torch

    from flatfl.errors import ConfigError
    from flatfl.utils.provenance import state_digest

    again = tmp_path / "fedavg-s0-clients"
    assert run_tasks([RunTask(again.name, str(again), dict(TINY, seed=0, save_clients=True, checkpoint_every=2),
                              threads=1)])[0]["error"] is None
    digests = {state_digest(torch.load(p / "final.pt", weights_only=True)["state_dict"]) for p in (runs / "fedavg-s0",
                                                                                                   again)}
    assert len(digests) == 1  # bit-identical: what the copy check used to refuse
    spec = TABLES["man-table2"]
    rows = {r.method: r for r in build_table(spec, collect_runs([runs / "fedavg-s0", again, runs / "man-s0"],
                                                                 model="clients-average"), paper_values())
            if r.partition == "dirichlet-0.3"}
    assert rows["FedAvg"].n_runs == 1 and rows["FedAvg"].runs == "fedavg-s0"
    assert rows["FedAvg"].same_seed_left_out == "fedavg-s0-clients (seed 0, as fedavg-s0)"
    summary = build_report([runs / "fedavg-s0", again, runs / "man-s0"], tmp_path / "rep", tables=["man-table2"])
    assert summary["runs"] == 3
    copy = tmp_path / "copy-s1"  # seed 0's folder passed off as seed 1: config.json and final.pt both edited
    shutil.copytree(runs / "fedavg-s0", copy)
    for name in ("final.pt",):
        payload = torch.load(copy / name, weights_only=True)
        payload["config"] = dict(payload["config"], seed=1)
        torch.save(payload, copy / name)
    record = json.loads((copy / "config.json").read_text())
    record["config"]["seed"] = 1
    (copy / "config.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="one is a copy of the other"):
        build_report([runs / "fedavg-s0", copy, runs / "man-s0"], tmp_path / "rep2", tables=["man-table2"])


def test_an_unfinished_run_is_in_no_column(runs, tmp_path):
    """Seed 3 stopped in round 2 of 2: listed as not finished, left out of the accuracy column (and so of the pair)."""
    summary, rows, checks = _report(runs, ["fedavg-s0", "fedavg-s1", "fedavg-s3-killed", "man-s0", "man-s1"],
                                    tmp_path / "rep")
    fa = rows["FedAvg"]
    want = [_final_accuracy(runs / f"fedavg-s{s}") for s in (0, 1)]
    assert fa["ours_accuracy_n"] == "2" and "fedavg-s3-killed" not in fa["runs"]
    assert float(fa["ours_accuracy"]) == pytest.approx(sum(want) / 2, rel=1e-12)
    assert float(fa["ours_accuracy_sd"]) == pytest.approx(abs(want[0] - want[1]) / math.sqrt(2), rel=1e-9)
    assert fa["unfinished"] == "fedavg-s3-killed (1/2 rounds)"
    assert any(m.startswith("fedavg-s3-killed: not finished (1/2 rounds): left out of every table column")
               for m in summary["missing"])
    assert checks["accuracy"]["verdict_from"] == "paired, k=2"  # seeds 0 and 1 only
    runs_csv = {r["run"]: r for r in csv.DictReader((tmp_path / "rep" / "runs.csv").open())}
    assert runs_csv["fedavg-s3-killed"]["finished"] == "False"


def test_curvature_tracking_does_not_split_a_row(runs):
    """A run with --track-hessian trains bit-identically (its weights equal an untracked run of its seed), so it is
    averaged with untracked seeds; the difference is shown."""
    rows, checks, notes = _tables(runs, ["fedavg-s0", "fedavg-s2-tracked", "man-s0", "man-s1"])
    fa = rows["FedAvg"]
    want = [_final_accuracy(runs / n) for n in ("fedavg-s0", "fedavg-s2-tracked")]
    assert fa.n_runs == 2 and fa.cells["accuracy"].mean == pytest.approx(sum(want) / 2, rel=1e-12)
    assert "track-hessian 0 / 1" in fa.settings_not_changing_numbers
    assert checks["accuracy"]["verdict"] in ("agree", "disagree", "inconclusive")  # two seeds a side: judged
    assert any("track-hessian 0 / 1" in n for n in notes)
    assert json.loads((runs / "fedavg-s2-tracked" / "config.json").read_text())["config"]["track_hessian"] == 1


def test_a_pair_trained_differently_is_incomparable(runs):
    """FedAvg with 2 rounds against FedAvg+MAN with 3: two seeds a side would be judged; they are not the same
    experiment, so the verdict is 'incomparable' and says why."""
    rows, checks, notes = _tables(runs, ["fedavg-s0", "fedavg-s1", "man3-s0", "man3-s1"])
    c = checks["accuracy"]
    assert rows["FedAvg"].cells["accuracy"].n == rows["FedAvg+MAN"].cells["accuracy"].n == 2
    assert c["verdict"] == c["unpaired_verdict"] == "incomparable" and c["verdict_from"] == "paired, k=2"
    assert c["incomparable_because"] == "trained differently: rounds 2 vs 3"
    assert any(n.startswith("FedAvg+MAN vs FedAvg dirichlet-0.3: trained differently (rounds 2 vs 3)") for n in notes)


class FakeRun:
    """What build_table reads of a run, with the config it was trained with."""

    def __init__(self, method, seed, value, config):
        self.method, self.seed, self.partition, self.value_ = method, seed, "dirichlet-0.3", value
        self.name, self.model, self.dataset = f"{method}-s{seed}", "clients-average", config.get("dataset", "digits")
        self.config = dict(config, seed=seed)

    def value(self, metric, column=None):
        return self.value_ if metric == "top_eigenvalue" else None

    def stderr(self, metric):
        return None

    def setting(self, metric):
        return "same"


def _check(table, ref_cfg, cmp_cfg, ref="FedAvg", cmp_="FedAvg+MAN"):
    spec = TABLES[table]
    part = spec.partitions[0]
    recs = [FakeRun(ref, s, 10.0 + s, ref_cfg) for s in (0, 1, 2)] + \
        [FakeRun(cmp_, s, 5.0 + s / 10, cmp_cfg) for s in (0, 1, 2)]
    for r in recs:
        r.partition = part
    rows = build_table(spec, recs, [])
    return next(c for c in direction_checks(spec, rows) if c["reference"] == ref and c["compared"] == cmp_
                and c["metric"] == "top_eigenvalue" and c["partition"] == part)


def test_pairs_differing_in_anything_but_the_method():
    """Another dataset, or another value of a hyper-parameter both methods read, makes a pair incomparable; the
    method's own settings (MAN's zeta, FedAlign's clipping, as its table plans them) and where the runs ran do not."""
    base = dict(dataset="digits", rounds=2, clients=4, algo="fedavg")
    # no paper values given: judged comparable, the verdict says there is no paper direction; 10, 11, 12 -> 5, 5.1,
    # 5.2 is resolved lower
    man = _check("man-table2", base, dict(base, reg="man", params={"zeta": 0.6}))
    assert man["verdict"] == "no paper value" and man["effect"] == "lower"
    other = _check("man-table2", base, dict(base, dataset="fashion-mnist", reg="man", params={"zeta": 0.6}))
    assert other["verdict"] == "incomparable" and other["incomparable_because"] == \
        "trained differently: dataset digits vs fashion-mnist, model digits-cnn vs emnist-cnn"
    dyn = dict(base, algo="feddyn", params={"feddyn_alpha": 0.01})
    same = _check("man-table2", dyn, dict(dyn, reg="man", params={"feddyn_alpha": 0.01, "zeta": 0.15}), "FedDyn",
                  "FedDyn+MAN")
    assert same["verdict"] == "no paper value"
    differs = _check("man-table2", dyn, dict(dyn, reg="man", params={"feddyn_alpha": 0.1, "zeta": 0.15}), "FedDyn",
                     "FedDyn+MAN")
    assert differs["verdict"] == "incomparable" and differs["incomparable_because"] == \
        "trained differently: feddyn-alpha 0.01 vs 0.1"
    # a recorded setting that no piece of either run reads changes no number
    unread = _check("man-table2", dyn, dict(dyn, reg="man", params={"feddyn_alpha": 0.01, "zeta": 0.15, "mu": 9.0}),
                    "FedDyn", "FedDyn+MAN")
    assert unread["verdict"] == "no paper value"
    moved = _check("man-table2", dict(base, threads=1, parallel_clients=1, device="cpu"),
                   dict(base, threads=2, parallel_clients=4, device="cuda", reg="man", params={"zeta": 0.6}))
    assert moved["verdict"] == "no paper value"
    fa = dict(base, partition="fedml-dirichlet", alpha=0.5, clip=0.0)
    clipped = _check("fedalign-table1", fa, dict(fa, reg="fedalign", clip=10.0,
                                                 params={"fedalign_mu": 0.45, "width": 0.25}), "FedAvg",
                     "FedAvg+FedAlign")
    assert clipped["verdict"] == "no paper value"  # FedAlign's table clips FedAlign only: part of the method
    assert training_settings(dict(base, model="digits-cnn")) == training_settings(base)  # the default, named
