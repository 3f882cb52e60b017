"""Hostile inputs and faults through the command line (issue 15).

Each case prepares a bad input (a flag value, a config or grid file, a damaged run folder, a held lock, a full disk)
in a fresh work folder, runs one ``flatfl`` command through click's runner (the real exit status), and asserts:
exactly one line on stderr, no traceback, a non-zero exit, the expected problem named, and no file created,
changed or deleted in the work folder or in the shared trained run. A few faults that need a real process
(Ctrl-C during start-up, a second process holding the lock) use subprocesses.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from locks import start_lock_holder

FAST = ["--model", "tiny", "--clients", "4", "--participation", "1", "--local-epochs", "1", "--batch-size", "64",
        "--quiet"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One tiny trained run (2 rounds, client models saved) and eigenvectors of its round-1 model, built once."""
    root = tmp_path_factory.mktemp("hostile-base")
    run = root / "run"
    r = CliRunner().invoke(main, ["train", *FAST, "--rounds", "2", "--checkpoint-every", "1", "--save-clients",
                                  "--out", str(run)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["hessian", str(run / "checkpoints" / "round_0001.pt"), "--top", "2", "--no-trace",
                                  "--samples", "64", "--save-eigenvectors", "--quiet", "--out", str(root / "eig1")])
    assert r.exit_code == 0, r.output
    # issue 29: another run (other lr and seed, same shapes and round count) and a Hessian of each final model
    r = CliRunner().invoke(main, ["train", *FAST, "--rounds", "2", "--save-clients", "--lr", "0.05", "--seed", "1",
                                  "--out", str(root / "other")])
    assert r.exit_code == 0, r.output
    for name, src in (("hess-final", run), ("hess-other", root / "other")):
        r = CliRunner().invoke(main, ["hessian", str(src / "final.pt"), "--top", "1", "--no-trace", "--samples", "64",
                                      "--quiet", "--out", str(root / name)])
        assert r.exit_code == 0, r.output
    return root


def snapshot(folder: Path) -> dict:
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        key = str(p.relative_to(folder))
        if p.is_file() and not p.is_symlink():
            out[key] = (hashlib.sha1(p.read_bytes()).hexdigest(), st.st_mode)
        else:
            out[key] = ("dir" if p.is_dir() else "other", st.st_mode)
    return out


class Ctx:
    def __init__(self, base: Path, ws: Path, monkeypatch):
        self.base, self.ws, self.monkeypatch = base, ws, monkeypatch
        self.run = base / "run"
        self._later = []

    def copy_run(self, name="run") -> Path:
        dst = self.ws / name
        shutil.copytree(self.run, dst)
        return dst

    def write(self, name: str, text: str | bytes) -> Path:
        p = self.ws / name
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
        return p

    def later(self, fn):
        self._later.append(fn)

    def hold_lock(self, folder: Path) -> None:
        """Another process holds ``folder``'s lock (as a running flatfl writer does)."""
        folder.mkdir(parents=True, exist_ok=True)
        proc = start_lock_holder(folder)
        self.later(lambda: (proc.kill(), proc.wait()))

    def disk_full(self, after: int = 0) -> None:
        """Simulate ENOSPC: every fsync of a file flatfl writes fails once ``after`` of them succeeded."""
        import flatfl.utils.io as fio

        calls = {"n": 0}
        real = os.fsync

        def fsync(fd):
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd)

        self.monkeypatch.setattr(fio.os, "fsync", fsync)


def malicious_pickle(path: Path, marker: Path, header: dict) -> None:
    """A torch file whose unpickling would create ``marker`` (code execution through __reduce__)."""

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save(dict(header, payload=Evil()), path)


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def edit_checkpoint(path: Path, fn) -> None:
    payload = torch.load(path, weights_only=True)
    fn(payload)
    torch.save(payload, path)


# --------------------------------------------------------------------------------------------------- the cases
# name -> (setup(ctx) -> argv, a fragment the error line must contain)
def _train(*extra):
    return lambda c: ["train", *FAST, "--rounds", "1", "--out", str(c.ws / "new"), *extra]


def _cfg(name, text, *extra):
    def setup(c):
        f = c.write(name, text)
        return ["train", "--config", str(f), "--quiet", "--out", str(c.ws / "new"), *extra]

    return setup


def _resume(prepare):
    def setup(c):
        run = c.copy_run()
        prepare(c, run)
        return ["train", "--resume", str(run), "--quiet"]

    return setup


def _on_run(command, *extra, prepare=None, target="final.pt"):
    def setup(c):
        run = c.copy_run() if prepare else c.run
        if prepare:
            prepare(c, run)
        return [command, str(run / target) if target else str(run), "--quiet", "--out", str(c.ws / "out"), *extra]

    return setup


def _grid(text):
    def setup(c):
        f = c.write("grid.toml", text.replace("OUT", str(c.ws / "runs")))
        return ["sweep", str(f), "--workers", "1"]

    return setup


GOOD_GRID = '[fixed]\nmodel = "tiny"\nclients = 4\nrounds = 1\nlocal_epochs = 1\n[grid]\nalgo = ["fedavg"]\n'
TOML_BASE = 'model = "tiny"\nclients = 4\nrounds = 1\nlocal_epochs = 1\n'


def _marker_resume(c, run):
    malicious_pickle(run / "resume.pt", c.ws / "PWNED", {"format": "flatfl-resume", "format_version": 2})


def _marker_checkpoint(c, run):
    malicious_pickle(run / "final.pt", c.ws / "PWNED", {"format": "flatfl-checkpoint", "format_version": 1})


def _nan_weights(c, run):
    def f(p):
        k = next(iter(p["state_dict"]))
        p["state_dict"][k] = p["state_dict"][k].float().fill_(float("nan"))

    edit_checkpoint(run / "final.pt", f)


def _force_with_user_file(c):
    run = c.copy_run()
    (run / "thesis.pdf").write_bytes(b"%PDF-1.4 years of work")
    return ["train", *FAST, "--rounds", "1", "--force", "--out", str(run)]


def _force_foreign(c):
    d = c.ws / "thesis"
    d.mkdir()
    (d / "config.json").write_text('{"latex": true}')
    (d / "chapter1.tex").write_text("\\section{Intro}")
    return ["train", *FAST, "--rounds", "1", "--force", "--out", str(d)]


def _second_writer(c):
    c.hold_lock(c.ws / "busy")
    return ["train", *FAST, "--rounds", "1", "--out", str(c.ws / "busy")]


def _second_hessian_writer(c):
    c.hold_lock(c.ws / "out")
    return ["hessian", str(c.run / "final.pt"), "--samples", "32", "--quiet", "--out", str(c.ws / "out")]


def _report_second_writer(c):
    c.hold_lock(c.ws / "rep")
    return ["report", str(c.run), "--out", str(c.ws / "rep")]


def _sweep_second_writer(c):
    c.hold_lock(c.ws / "runs")
    grid = c.write("g.toml", f'out = "{c.ws / "runs"}"\n' + GOOD_GRID)
    return ["sweep", str(grid), "--workers", "1"]


def _resume_locked(c):
    run = c.copy_run()
    c.hold_lock(run)
    return ["train", "--resume", str(run), "--quiet"]


def _enospc_train(c):
    c.disk_full()
    return ["train", *FAST, "--rounds", "1", "--out", str(c.ws / "new")]


def _enospc_hessian(after):
    def setup(c):
        c.disk_full(after)
        return ["hessian", str(c.run / "final.pt"), "--top", "2", "--samples", "32", "--quiet",
                "--out", str(c.ws / "out")]

    return setup


def _enospc_clients(c):
    c.disk_full(1)
    return ["hessian-clients", str(c.run / "final.pt"), "--probes", "4", "--groups", "2", "--samples", "16", "--quiet",
            "--out", str(c.ws / "out")]


def _enospc_surface(c):
    c.disk_full()
    return ["surface", str(c.run / "final.pt"), "--grid", "3", "--samples", "16", "--quiet", "--out", str(c.ws / "out")]


def _user_file_named_like_output(c):
    # a user's eigenvalues.png beside a hessian run that fails: untouched (and the command fails on its --tol)
    c.write("out/eigenvalues.png", b"my own figure")
    return ["hessian", str(c.run / "final.pt"), "--tol", "nan", "--quiet", "--out", str(c.ws / "out")]


def _user_file_replaced(command, name, *extra):
    """A user's file in --out that shares an output's name: refused before any work, the file kept."""
    def setup(c):
        c.write(f"out/{name}", b"the user's own " + name.encode())
        return [command, str(c.run / "final.pt"), "--samples", "16", "--quiet", "--out", str(c.ws / "out"), *extra]

    return setup


def _eigvec_other_checkpoint(c):
    return ["surface", str(c.run / "final.pt"), "--directions", "hessian", "--eigenvectors",
            str(c.base / "eig1" / "eigenvectors.pt"), "--grid", "3", "--samples", "16", "--quiet",
            "--out", str(c.ws / "out")]


def _garbage_eigvec(c):
    f = c.write("vec.pt", b"not a torch file")
    return ["surface", str(c.run / "final.pt"), "--directions", "hessian", "--eigenvectors", str(f), "--grid", "3",
            "--quiet", "--out", str(c.ws / "out")]


def _report_bad_metrics(c):
    run = c.copy_run()
    (run / "metrics.csv").write_bytes(b"round,test_acc\n1,\xff\xfe\x00bad\n")
    return ["report", str(run), "--out", str(c.ws / "rep")]


def _report_bad_hessian(c):
    run = c.copy_run()
    (run / "hessian").mkdir()
    (run / "hessian" / "hessian.json").write_text("{not json")
    return ["report", str(run), "--out", str(c.ws / "rep")]


def _partition_corrupt(c):
    run = c.copy_run()
    (run / "partition.json").write_text('{"method": "dirichlet", "client_indices": 7}')
    return ["partition", "--run", str(run)]


# ---- issue 29: data loss
def _lock_link(kind):
    """``--out``'s .flatfl.lock is a symbolic or hard link to a file outside: that file must not get a PID."""
    def setup(c):
        victim = c.write("victim.txt", "the user's precious file\n")
        (c.ws / "out").mkdir()
        (os.symlink if kind == "symlink" else os.link)(victim, c.ws / "out" / ".flatfl.lock")
        return ["hessian", str(c.run / "final.pt"), "--samples", "16", "--top", "1", "--no-trace", "--quiet",
                "--out", str(c.ws / "out")]

    return setup


def _force_user_hidden_tmp(c):
    run = c.copy_run()
    (run / ".notes.tmp").write_text("my notes, hidden")
    return ["train", *FAST, "--rounds", "1", "--force", "--out", str(run)]


def _force_sub_folder_locked(c):
    run = c.copy_run()
    c.hold_lock(run / "hessian")  # a running `hessian --out RUN/hessian`
    return ["train", *FAST, "--rounds", "1", "--force", "--out", str(run)]


# ---- issue 29: results from other weights, runs that do not belong together
def _report_with(prepare, *runs):
    """A report on copies of the base run (and others) after ``prepare(c, first_copy)``."""
    def setup(c):
        (c.ws / "runs").mkdir()
        first = c.copy_run("runs/a")
        for k, src in enumerate(runs):
            shutil.copytree(c.base / src, c.ws / "runs" / f"b{k}")
        prepare(c, first)
        return ["report", str(c.ws / "runs"), "--out", str(c.ws / "rep")]

    return setup


def _hessian_of_other_run(c, run):
    shutil.copytree(c.base / "hess-other", run / "hessian")  # round 2 as well, but of the other run's weights


def _passed_off_as_seed_5(c, run):
    """A copy of a run whose config.json and final.pt both say seed 5: the same weights as seed 0 (a copy of one
    run of a seed is no second seed; two runs of one seed with equal settings are, and count once)."""
    edit_json(run / "config.json", lambda d: d["config"].update(seed=5))
    edit_checkpoint(run / "final.pt", lambda p: p["config"].update(seed=5))


def _clients_average_of_other_run(c, run):
    from flatfl.run_layout import model_checkpoint

    shutil.copy(model_checkpoint(c.base / "other", "clients-average"), run / "final-clients-average.pt")


def _clients_pt_more_clients(c, run):
    state = torch.load(run / "clients.pt", weights_only=True)
    state["params"] = torch.cat([state["params"], state["params"]])  # 8 client models in a 4-client run
    state["buffers"] = {k: torch.cat([v, v]) for k, v in state.get("buffers", {}).items()}
    state.pop("run_settings_sha256", None)  # as an older flatfl wrote it: the count alone gives it away
    torch.save(state, run / "clients.pt")


def _spec_other_architecture(also_config):
    def prepare(c, run):
        def f(p):
            # 'mlp' with 32 hidden units has tiny's parameter shapes (relu instead of tanh)
            p["model_spec"] = {"name": "mlp", "kwargs": dict(p["model_spec"]["kwargs"], hidden=[32])}
            if also_config:
                p["config"]["model"] = "mlp"  # the spec's digest still gives it away
            else:
                p.pop("model_spec_sha256")  # as an older flatfl wrote it: the run's config gives it away

        edit_checkpoint(run / "final.pt", f)

    return prepare


def _clients_pt(prepare):
    return _on_run("hessian-clients", "--probes", "4", "--groups", "2", "--samples", "16", prepare=prepare)


# ---- issue 29: sizes bounded before allocation, named failures
def _huge_spec(c, run):
    def f(p):
        p["model_spec"] = {"name": "tiny", "kwargs": dict(p["model_spec"]["kwargs"], hidden=[100000, 100000])}
        p.pop("model_spec_sha256", None)  # as an older flatfl wrote it: the size alone must refuse it

    edit_checkpoint(run / "final.pt", f)


def _custom_data_run(c, name="own") -> Path:
    """A run on your own data (a registry network), its data saved as data.pt."""
    from torch.utils.data import TensorDataset

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(60, 1, 8, 8, generator=g), torch.arange(60) % 3
    cfg = RunConfig(model="tiny", rounds=1, clients=2, batch_size=20, threads=1).validate()
    Trainer(cfg, c.ws / name, dataset=TensorDataset(x, y), quiet=True).run()
    return c.ws / name


def _data_pt_label_out_of_range(c):
    run = _custom_data_run(c)
    payload = torch.load(run / "data.pt", weights_only=True)
    payload["train_y"][0] = 50  # 3 classes
    torch.save(payload, run / "data.pt")
    return ["hessian", str(run / "final.pt"), "--top", "1", "--no-trace", "--quiet", "--out", str(c.ws / "out")]


def _factory_syntax_error(c):
    c.write("bad_factory.py", "def net(:\n    pass\n")
    return ["hessian", str(c.run / "final.pt"), "--model-factory", "bad_factory:net", "--top", "1", "--no-trace",
            "--quiet", "--out", str(c.ws / "out")]


def _factory_exits(command, module, code, at_import=False, *extra):
    """A --model-factory whose module or function calls sys.exit(code): an error, never flatfl's exit status."""
    def setup(c):
        c.monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ in the work folder
        body = f"import sys\nsys.exit({code})\n" if at_import else f"import sys\n\ndef net():\n    sys.exit({code})\n"
        c.write(f"{module}.py", body)
        return [command, str(c.run / "final.pt"), "--model-factory", f"{module}:net", "--samples", "16", "--quiet",
                "--out", str(c.ws / "out"), *extra]

    return setup


def _big_grid(c):
    lrs = ", ".join(f"{0.001 * (k + 1):g}" for k in range(200))
    return ["sweep", str(c.write("g.toml", GOOD_GRID + f"lr = [{lrs}]\nseed = {list(range(600))}\n")), "--dry-run"]


def _report_nested_json(c):
    run = c.copy_run()
    (run / "hessian").mkdir()
    (run / "hessian" / "hessian.json").write_text("[" * 100000 + "]" * 100000)
    return ["report", str(run), "--out", str(c.ws / "rep")]


def _fuller_report(c, extra=("--methods", "FedSpeed")):
    """A report of every run of MAN Table 6 (tiny preset) in the folder a restricted reproduction is pointed at."""
    from flatfl.reproduce import Selection, plan

    names = [t.name for t in plan(Selection("man-table6", "tiny", seeds=(0, 1)), runs_dir=c.ws / "r")]
    c.write("full/summary.json", json.dumps({"runs": len(names), "tables": ["man-table6"]}))
    c.write("full/runs.csv", "run,method\n" + "".join(f"{n},x\n" for n in names))
    return ["reproduce", "man-table6", "--preset", "tiny", "--runs-dir", str(c.ws / "r"), "--out",
            str(c.ws / "full"), *extra]


def _fuller_report_seeds(c):
    return _fuller_report(c, ("--seeds", "1"))


# ---- a list shared by reference at every level (a few hundred bytes; 2^25 values once expanded), in each torch file
def shared_bomb(levels: int = 24):
    a = [0]
    for _ in range(levels):
        a = [a, a]
    return a


def _bomb_in_checkpoint(where):
    def prepare(c, run):
        def f(p):
            if where == "config":
                p["config"] = dict(p["config"], params={"x": shared_bomb()})
            else:
                p["model_spec"] = dict(p["model_spec"], kwargs={"x": shared_bomb()})

        edit_checkpoint(run / "final.pt", f)

    return prepare


def _bomb_in_resume(c, run):
    edit_checkpoint(run / "resume.pt", lambda p: p.update(metrics=shared_bomb()))


def _bomb_in_clients_pt(c, run):
    edit_checkpoint(run / "clients.pt", lambda p: p.update(round=shared_bomb()))


def _bomb_in_eigenvectors(c):
    f = c.ws / "vec.pt"
    shutil.copy(c.base / "eig1" / "eigenvectors.pt", f)
    edit_checkpoint(f, lambda p: p.update(param_names=shared_bomb()))
    return ["surface", str(c.run / "final.pt"), "--directions", "hessian", "--eigenvectors", str(f), "--grid", "3",
            "--samples", "16", "--quiet", "--out", str(c.ws / "out")]


def _bomb_in_data_pt(c):
    run = _custom_data_run(c)
    edit_checkpoint(run / "data.pt", lambda p: p.update(mean=shared_bomb()))
    return ["hessian", str(run), "--top", "1", "--no-trace", "--quiet", "--out", str(c.ws / "out")]


def _plain_pickle(c, run, name="final.pt"):
    import pickle

    (run / name).write_bytes(pickle.dumps({"format": "flatfl-checkpoint", "format_version": 2}, protocol=4))


def _plain_pickle_data_pt(c):
    run = _custom_data_run(c)
    _plain_pickle(c, run, "data.pt")
    return ["hessian", str(run), "--top", "1", "--no-trace", "--quiet", "--out", str(c.ws / "out")]


def _nan_loss(c):
    c.monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ in the work folder
    c.write("nan_loss_of_hostile.py", "import torch.nn.functional as F\n\n\ndef f(model, batch):\n"
            "    return F.cross_entropy(model(batch[0]), batch[1]) * float('nan')\n")
    return ["hessian", str(c.run / "final.pt"), "--loss", "nan_loss_of_hostile:f", "--top", "1", "--no-trace",
            "--samples", "16", "--quiet", "--out", str(c.ws / "out")]


CASES = {
    # ---- issue 29: sizes bounded before allocation (the limit named), failures named instead of 'internal error'
    "sweep-grid-120000-points": (_big_grid, "at most 10,000"),
    "hessian-density-starts-huge": (_on_run("hessian", "--density", "--density-starts", "10000000"),
                                    "--density-starts must be at most 1000"),
    "hessian-density-steps-huge": (_on_run("hessian", "--density", "--density-steps", "10000000"),
                                   "--density-steps must be at most 10000"),
    "clients-probes-huge": (_on_run("hessian-clients", "--probes", "1000000000"), "--probes must be at most"),
    "clients-groups-huge": (_on_run("hessian-clients", "--probes", "8", "--groups", "100000"),
                            "--groups must be at most 1000"),
    "surface-grid-huge": (_on_run("surface", "--grid", "100000"), "--grid must be at most 1001"),
    "surface-range-1e300": (_on_run("surface", "--range", "1e300"), "--range must be at most"),
    "checkpoint-spec-huge-layers": (_on_run("hessian", "--top", "1", "--no-trace", prepare=_huge_spec),
                                    "refused before building"),
    "checkpoint-format-version-string": (_on_run("hessian", prepare=lambda c, r: edit_checkpoint(
        r / "final.pt", lambda p: p.update(format_version="2"))), "format_version"),
    "factory-syntax-error": (_factory_syntax_error, "syntax error"),
    # ---- a factory that exits, an abbreviated data set name
    "factory-exits-0-hessian": (_factory_exits("hessian", "exit_i41a", 0, False, "--top", "1", "--no-trace"),
                                "net() called sys.exit(0) instead of returning a network"),
    "factory-exits-3-clients": (_factory_exits("hessian-clients", "exit_i41b", 3, False, "--probes", "4"),
                                "net() called sys.exit(3)"),
    "factory-exits-0-surface": (_factory_exits("surface", "exit_i41c", 0, False, "--grid", "3"),
                                "net() called sys.exit(0)"),
    "factory-exits-on-import": (_factory_exits("hessian", "exit_i41d", 0, True, "--top", "1"),
                                "importing 'exit_i41d' called sys.exit(0)"),
    "dataset-abbreviated": (_train("--dataset", "fmnist"), "unknown dataset 'fmnist'. Did you mean 'fashion-mnist'?"),
    "data-pt-label-out-of-range": (_data_pt_label_out_of_range, "outside the data set's 3 classes"),
    "report-hessian-json-nested": (_report_nested_json, "hessian.json"),
    # ---- issue 29: results from other weights, runs that do not belong together
    "report-hessian-of-other-weights": (_report_with(_hessian_of_other_run), "belongs to another run"),
    "report-copy-passed-off-as-another-seed": (_report_with(_passed_off_as_seed_5, "run"), "same final weights"),
    "hessian-clients-average-of-another-run": (_on_run("hessian", "--top", "1", "--no-trace", "--samples", "16",
                                                       prepare=_clients_average_of_other_run,
                                                       target="final-clients-average.pt"),
                                               "is not the all-clients average of"),
    "report-other-settings-same-row": (_report_with(lambda c, r: None, "other"), "other settings (lr"),
    "report-config-edited-algo": (_report_with(lambda c, r: edit_json(
        r / "config.json", lambda d: d["config"].update(algo="fedprox"))), "algo 'fedprox'"),
    "report-metrics-row-longer-than-header": (_report_with(lambda c, r: (r / "metrics.csv").write_text(
        (r / "metrics.csv").read_text().rstrip("\n") + ",extra\n")), "not as many fields as the header"),
    "report-truncated-metrics": (_report_with(lambda c, r: (
        shutil.copytree(c.base / "hess-final", r / "hessian"),
        (r / "metrics.csv").write_text("\n".join((r / "metrics.csv").read_text().splitlines()[:2]) + "\n"))),
        "metrics.csv stops at round 1"),
    "clients-pt-of-other-run": (_clients_pt(lambda c, r: shutil.copy(c.base / "other" / "clients.pt", r / "clients.pt")),
                                "another run"),
    "clients-pt-more-clients": (_clients_pt(_clients_pt_more_clients), "8 client models"),
    "checkpoint-spec-other-architecture": (_on_run("hessian", "--top", "1", "--no-trace", "--samples", "16",
                                                   prepare=_spec_other_architecture(False)), "names 'mlp'"),
    "checkpoint-spec-and-config-edited": (_on_run("hessian", "--top", "1", "--no-trace", "--samples", "16",
                                                  prepare=_spec_other_architecture(True)), "changed after training"),
    "checkpoint-weights-edited": (_on_run("hessian", "--top", "1", "--no-trace", "--samples", "16",
                                          prepare=lambda c, r: edit_checkpoint(r / "final.pt", lambda p: p["state_dict"][
                                              next(iter(p["state_dict"]))].mul_(2))), "weights were changed"),
    "resume-with-other-flags": (lambda c: ["train", "--resume", str(c.copy_run()), "--lr", "5", "--rounds", "3",
                                           "--quiet"], "--lr, --rounds"),
    # ---- issue 29: data loss (locks through links, --force on a user's temporaries or a folder being written)
    "lock-symlink-outside": (_lock_link("symlink"), "symbolic link"),
    "lock-hardlink-outside": (_lock_link("hardlink"), "hard link"),
    "force-user-hidden-tmp": (_force_user_hidden_tmp, ".notes.tmp"),
    "force-sub-folder-locked": (_force_sub_folder_locked, "another flatfl process"),
    # ---- train: flag values that parse but are out of range
    "seed-negative": (_train("--seed", "-1"), "--seed"),
    "seed-2^32": (_train("--seed", str(2**32)), "--seed"),
    "seed-huge": (_train("--seed", str(10**30)), "--seed"),
    "rounds-zero": (_train("--rounds", "0"), "--rounds"),
    "rounds-huge": (_train("--rounds", "100000000"), "--rounds"),
    "participation-1e-9": (_train("--participation", "1e-9"), "participation"),
    "participation-zero": (_train("--participation", "0"), "--participation"),
    "participation-above-1": (_train("--participation", "1.5"), "--participation"),
    "lr-nan": (_train("--lr", "nan"), "--lr"),
    "lr-inf": (_train("--lr", "inf"), "--lr"),
    "lr-negative": (_train("--lr", "-1"), "--lr"),
    "momentum-one": (_train("--momentum", "1"), "--momentum"),
    "clients-zero": (_train("--clients", "0"), "--clients"),
    "alpha-zero": (_train("--alpha", "0", "--partition", "dirichlet"), "--alpha"),
    "batch-size-zero": (_train("--batch-size", "0"), "--batch-size"),
    "device-bogus": (_train("--device", "bogus"), "bogus"),
    "algo-unknown": (_train("--algo", "fedmagic"), "fedmagic"),
    "reg-unknown": (_train("--reg", "sharp"), "sharp"),
    "local-opt-unknown": (_train("--local-opt", "adamw9"), "adamw9"),
    "dataset-unknown": (_train("--dataset", "imagenet22k"), "imagenet22k"),
    "model-unknown": (_train("--model", "gpt5"), "gpt5"),
    "hparam-nan": (_train("--algo", "fedprox", "--mu", "nan"), "--mu"),
    "clients-more-than-samples": (_train("--clients", "100000"), "clients"),
    # ---- train: config files
    "cfg-augment-no": (_cfg("c.toml", TOML_BASE + 'augment = "no"\n'), "--augment"),
    "cfg-save-clients-no": (_cfg("c.toml", TOML_BASE + 'save_clients = "no"\n'), "--save-clients"),
    "cfg-nesterov-int": (_cfg("c.toml", TOML_BASE + "nesterov = 1\n"), "--nesterov"),
    "cfg-rounds-float": (_cfg("c.toml", 'model = "tiny"\nrounds = 2.5\n'), "--rounds"),
    "cfg-rounds-string": (_cfg("c.toml", 'model = "tiny"\nrounds = "3"\n'), "--rounds"),
    "cfg-clients-bool": (_cfg("c.toml", 'model = "tiny"\nclients = true\n'), "--clients"),
    "cfg-seed-negative": (_cfg("c.toml", TOML_BASE + "seed = -5\n"), "--seed"),
    "cfg-lr-word": (_cfg("c.yaml", "model: tiny\nlr: fast\n"), "--lr"),
    "cfg-lr-inf-string": (_cfg("c.yaml", "model: tiny\nlr: .inf\n"), "--lr"),
    "cfg-hparam-string": (_cfg("c.toml", TOML_BASE + 'algo = "fedprox"\nmu = "big"\n'), "--mu"),
    "cfg-hparam-bool": (_cfg("c.toml", TOML_BASE + 'reg = "man"\nzeta = true\n'), "--zeta"),
    "cfg-model-args-scalar": (_cfg("c.toml", TOML_BASE + "model_args = 5\n"), "model-args"),
    "cfg-params-scalar": (_cfg("c.toml", TOML_BASE + "params = 3\n"), "params"),
    "cfg-unknown-key": (_cfg("c.toml", TOML_BASE + "learning_rate = 0.1\n"), "learning_rate"),
    "cfg-unparseable-toml": (_cfg("c.toml", "rounds = = 3\n"), "cannot parse"),
    "cfg-not-utf8": (_cfg("c.toml", b"rounds = 1\n# \xff\xfe caf\xe9\n"), "UTF-8"),
    "cfg-yaml-list": (_cfg("c.yaml", "- 1\n- 2\n"), "table"),
    "cfg-wrong-suffix": (_cfg("c.json", "{}"), ".toml"),
    "cfg-missing": (lambda c: ["train", "--config", str(c.ws / "nope.toml"), "--out", str(c.ws / "new")], "not found"),
    # ---- train: folders
    "out-is-a-file": (lambda c: ["train", *FAST, "--out", str(c.write("f.txt", "x"))], "is a file"),
    "out-exists-no-force": (lambda c: ["train", *FAST, "--out", str(c.copy_run())], "already exists"),
    "force-foreign-folder": (_force_foreign, "not a flatfl run"),
    "force-run-with-user-file": (_force_with_user_file, "did not write"),
    "second-writer": (_second_writer, "another flatfl process"),
    "resume-while-locked": (_resume_locked, "another flatfl process"),
    "report-second-writer": (_report_second_writer, "another flatfl process"),
    "sweep-second-writer": (_sweep_second_writer, "another flatfl process"),
    "enospc-train": (_enospc_train, "no space left"),
    # ---- train --resume
    "resume-missing": (lambda c: ["train", "--resume", str(c.ws / "nope")], "not a directory"),
    "resume-empty-dir": (lambda c: ["train", "--resume", str(c.write("e/.keep", "").parent)], "not a flatfl run"),
    "resume-malicious-pickle": (_resume(_marker_resume), "will not load"),
    "resume-truncated": (_resume(lambda c, r: (r / "resume.pt").write_bytes((r / "resume.pt").read_bytes()[:300])),
                         "corrupt"),
    "resume-text-file": (_resume(lambda c, r: (r / "resume.pt").write_text("hello")), "resume.pt"),
    "resume-foreign-torch-file": (_resume(lambda c, r: torch.save({"a": torch.zeros(2)}, r / "resume.pt")),
                                  "not a flatfl resume"),
    "resume-edited-lr": (_resume(lambda c, r: edit_json(r / "config.json", lambda d: d["config"].update(lr=0.05))),
                         "lr"),
    "resume-edited-algo": (_resume(lambda c, r: edit_json(r / "config.json",
                                                          lambda d: d["config"].update(algo="fedprox"))), "algo"),
    "resume-edited-clients": (_resume(lambda c, r: edit_json(r / "config.json",
                                                             lambda d: d["config"].update(clients=3))), "clients"),
    "resume-config-bad-type": (_resume(lambda c, r: edit_json(r / "config.json",
                                                              lambda d: d["config"].update(augment="no"))),
                               "--augment"),
    "resume-config-not-json": (_resume(lambda c, r: (r / "config.json").write_text("{oops")), "corrupt"),
    "resume-partition-corrupt": (_resume(lambda c, r: (r / "partition.json").write_text("[1, 2")), "partition.json"),
    # ---- hessian
    "hessian-missing-checkpoint": (lambda c: ["hessian", str(c.ws / "nope.pt"), "--out", str(c.ws / "out")],
                                   "not found"),
    "hessian-text-file": (lambda c: ["hessian", str(c.write("x.pt", "hello")), "--out", str(c.ws / "out")],
                          "not a readable"),
    "hessian-truncated": (_on_run("hessian", prepare=lambda c, r: (r / "final.pt").write_bytes(
        (r / "final.pt").read_bytes()[:1000])), "not a readable"),
    "hessian-missing-key": (_on_run("hessian", prepare=lambda c, r: edit_checkpoint(
        r / "final.pt", lambda p: p.pop("state_dict"))), "state_dict"),
    "hessian-nan-weights": (_on_run("hessian", prepare=lambda c, r: _nan_weights(c, r)), "non-finite"),
    "hessian-malicious-pickle": (_on_run("hessian", prepare=_marker_checkpoint), "will not load"),
    "hessian-fifo-checkpoint": (lambda c: (os.mkfifo(c.ws / "f.pt"), ["hessian", str(c.ws / "f.pt"), "--out",
                                                                      str(c.ws / "out")])[1], "not a regular file"),
    "hessian-dev-zero": (lambda c: ["hessian", "/dev/zero", "--out", str(c.ws / "out")], "not a regular file"),
    "hessian-tol-inf": (_on_run("hessian", "--tol", "inf"), "--tol"),
    "hessian-tol-zero": (_on_run("hessian", "--tol", "0"), "--tol"),
    "hessian-tol-two": (_on_run("hessian", "--tol", "2"), "--tol"),
    "hessian-top-negative": (_on_run("hessian", "--top", "-1"), "--top"),
    "hessian-samples-zero": (_on_run("hessian", "--samples", "0"), "samples"),
    "hessian-device-bogus": (_on_run("hessian", "--device", "bogus"), "bogus"),
    "hessian-method-unknown": (_on_run("hessian", "--method", "qr"), "qr"),
    "hessian-split-unknown": (_on_run("hessian", "--split", "val"), "val"),
    "hessian-out-is-file": (lambda c: ["hessian", str(c.run / "final.pt"), "--out", str(c.write("o", "x"))],
                            "not a directory"),
    "hessian-second-writer": (_second_hessian_writer, "another flatfl process"),
    "hessian-keeps-user-file": (_user_file_named_like_output, "--tol"),
    "enospc-hessian-first-file": (_enospc_hessian(0), "no space left"),
    "enospc-hessian-last-file": (_enospc_hessian(3), "no space left"),
    "enospc-hessian-manifest": (_enospc_hessian(4), "no space left"),  # every output staged, the manifest fails
    "hessian-user-file-same-name": (_user_file_replaced("hessian", "eigenvalues.csv", "--top", "2"),
                                    "not written by flatfl"),
    "hessian-user-json-same-name": (_user_file_replaced("hessian", "hessian.json", "--top", "1"),
                                    "not written by flatfl"),
    # ---- hessian-clients
    "clients-round1-latest-models": (_on_run("hessian-clients", "--probes", "4", "--groups", "2",
                                             target="checkpoints/round_0001.pt"), "round 2"),
    "clients-protocol-unknown": (_on_run("hessian-clients", "--protocol", "magic"), "magic"),
    "clients-probes-one": (_on_run("hessian-clients", "--probes", "1"), "--probes"),
    "clients-tol-inf": (_on_run("hessian-clients", "--tol", "inf"), "--tol"),
    "clients-corrupt-clients-pt": (_on_run("hessian-clients", "--probes", "4", "--groups", "2",
                                           prepare=lambda c, r: (r / "clients.pt").write_bytes(b"garbage")),
                                   "clients.pt"),
    "clients-no-saved-clients": (_on_run("hessian-clients", "--probes", "4", "--groups", "2",
                                         prepare=lambda c, r: (r / "clients.pt").unlink()), "--save-clients"),
    "enospc-hessian-clients": (_enospc_clients, "no space left"),
    "clients-user-file-same-name": (_user_file_replaced("hessian-clients", "clients_heatmap-default.png", "--probes", "4",
                                                        "--groups", "2"), "not written by flatfl"),
    # ---- surface
    "surface-grid-one": (_on_run("surface", "--grid", "1"), "grid"),
    "surface-range-negative": (_on_run("surface", "--range", "-1"), "range"),
    "surface-tol-nan": (_on_run("surface", "--directions", "hessian", "--tol", "nan"), "--tol"),
    "surface-workers-zero": (_on_run("surface", "--workers", "0"), "--workers"),
    "surface-eigenvectors-other-checkpoint": (_eigvec_other_checkpoint, "another checkpoint"),
    "surface-eigenvectors-garbage": (_garbage_eigvec, "not a readable eigenvector"),
    "enospc-surface": (_enospc_surface, "no space left"),
    "surface-user-file-same-name": (_user_file_replaced("surface", "surface.npz", "--grid", "3"),
                                    "not written by flatfl"),
    # ---- report, partition
    "report-not-a-run": (lambda c: ["report", str(c.write("d/x.txt", "x").parent), "--out", str(c.ws / "rep")],
                         "holds no flatfl run"),
    "report-metrics-not-utf8": (_report_bad_metrics, "UTF-8"),
    "report-hessian-json-corrupt": (_report_bad_hessian, "hessian.json"),
    "partition-run-corrupt": (_partition_corrupt, "partition.json"),
    "partition-clients-zero": (lambda c: ["partition", "--clients", "0"], "clients"),
    "partition-alpha-negative": (lambda c: ["partition", "--alpha", "-1"], "alpha"),
    "partition-seed-negative": (lambda c: ["partition", "--seed", "-3"], "seed"),
    # ---- sweep, reproduce (the grid is checked before any training)
    "grid-hessian-typo": (_grid(GOOD_GRID + "[hessian]\ntopp = 1\n"), "topp"),
    "grid-hessian-type": (_grid(GOOD_GRID + '[hessian]\ntop = "one"\n'), "top"),
    "grid-hessian-tol-range": (_grid(GOOD_GRID + "[hessian]\ntol = 5.0\n"), "tol"),
    "grid-clients-typo": (_grid(GOOD_GRID + "[clients]\nprobe = 4\n"), "probe"),
    "grid-surface-type": (_grid(GOOD_GRID + "[surface]\ngrid = 2.5\n"), "grid"),
    "grid-fixed-augment-no": (_grid(GOOD_GRID.replace("rounds = 1", 'rounds = 1\naugment = "no"')), "--augment"),
    "grid-lr-word": (_grid(GOOD_GRID + 'lr = ["x"]\n'), "--lr"),
    "grid-not-utf8": (lambda c: ["sweep", str(c.write("g.toml", b"[fixed]\n# \xff\n"))], "UTF-8"),
    "sweep-workers-zero": (lambda c: ["sweep", str(c.write("g.toml", GOOD_GRID)), "--workers", "0"], "--workers"),
    "reproduce-threads-negative": (lambda c: ["reproduce", "man-table2", "--preset", "tiny", "--threads", "-2",
                                              "--runs-dir", str(c.ws / "r"), "--out", str(c.ws / "o")], "--threads"),
    "reproduce-seeds-words": (lambda c: ["reproduce", "man-table2", "--preset", "tiny", "--seeds", "a,b",
                                         "--runs-dir", str(c.ws / "r"), "--out", str(c.ws / "o")], "--seeds"),
    "reproduce-seed-negative": (lambda c: ["reproduce", "man-table2", "--preset", "tiny", "--seeds", "-1",
                                           "--runs-dir", str(c.ws / "r"), "--out", str(c.ws / "o")], "seed"),
    # ---- --parallel-clients: from the command line and a config file
    "parallel-clients-zero": (_train("--parallel-clients", "0"), "--parallel-clients"),
    "parallel-clients-word": (_train("--parallel-clients", "some"), "--parallel-clients"),
    "parallel-clients-cfg-float": (_cfg("p.toml", "parallel_clients = 2.5\n"), "--parallel-clients"),
    # ---- --threads -2 on every command that takes it (the issue counted 8 tracebacks)
    "threads-negative-train": (_train("--threads", "-2"), "--threads"),
    "threads-negative-hessian": (_on_run("hessian", "--threads", "-2"), "--threads"),
    "threads-negative-clients": (_on_run("hessian-clients", "--threads", "-2"), "--threads"),
    "threads-negative-surface": (_on_run("surface", "--threads", "-2"), "--threads"),
    "threads-negative-report": (lambda c: ["report", str(c.run), "--threads", "-2", "--out", str(c.ws / "rep")],
                                "--threads"),
    "threads-negative-sweep": (lambda c: ["sweep", str(c.write("g.toml", GOOD_GRID)), "--threads", "-2"],
                               "--threads"),
    "threads-huge-reproduce": (lambda c: ["reproduce", "man-table2", "--preset", "tiny", "--threads", str(10**12),
                                          "--runs-dir", str(c.ws / "r"), "--out", str(c.ws / "o")], "--threads"),
    "seed-negative-hessian": (_on_run("hessian", "--seed", "-1"), "seed"),
    "seed-huge-surface": (_on_run("surface", "--seed", str(2**64)), "seed"),
    "seed-huge-clients": (_on_run("hessian-clients", "--seed", str(2**32)), "seed"),
    "threads-huge-train": (_train("--threads", str(2**70)), "--threads"),
    "reproduce-workers-zero": (lambda c: ["reproduce", "man-table2", "--preset", "tiny", "--workers", "0",
                                          "--runs-dir", str(c.ws / "r"), "--out", str(c.ws / "o")], "--workers"),
    # ---- a reproduction restricted by --methods / --seeds never replaces a fuller report
    "reproduce-methods-over-a-fuller-report": (_fuller_report, "--out"),
    "reproduce-seeds-over-a-fuller-report": (_fuller_report_seeds, "--out"),
    # ---- config and grid files read as YAML 1.2, a key set twice refused
    "cfg-yaml-sexagesimal": (_cfg("c.yaml", "model: tiny\nrounds: 1:1\n"), "--rounds must be an integer, got '1:1'"),
    "cfg-yaml-yes": (_cfg("c.yaml", "model: tiny\naugment: yes\n"), "--augment must be true or false"),
    "cfg-yaml-duplicate": (_cfg("c.yaml", "model: tiny\nlr: 0.1\nlr: 0.2\n"), "sets 'lr' twice (lines 2 and 3)"),
    "cfg-toml-duplicate": (_cfg("c.toml", 'model = "tiny"\nlr = 0.1\nlr = 0.2\n'), "sets 'lr' twice"),
    "grid-yaml-duplicate": (lambda c: ["sweep", str(c.write("g.yaml", "fixed:\n  model: tiny\n  rounds: 1\ngrid:\n"
                                                                      "  algo: [fedavg]\n  algo: [fedprox]\n"))],
                            "sets 'algo' twice"),
    # ---- float settings beyond the float32 range: named before training, not an overflow inside a step
    "lr-1e308": (_train("--lr", "1e308"), "--lr must be at most 3.403e+38"),
    "cfg-lr-1e308": (_cfg("c.yaml", "model: tiny\nlr: 1e308\n"), "--lr must be at most"),
    "weight-decay-1e308": (_train("--weight-decay", "1e308"), "--weight-decay must be at most"),
    "mu-1e308": (_train("--algo", "fedprox", "--mu", "1e308"), "--mu must be at most"),
    "feddyn-alpha-1e308": (_train("--algo", "feddyn", "--feddyn-alpha", "1e308"), "--feddyn-alpha must be at most"),
    # ---- a torch file whose plain part nests a shared list at every level: refused on loading, before any walk
    "checkpoint-config-shared-list": (_on_run("hessian", "--top", "1", "--no-trace", "--samples", "16",
                                              prepare=_bomb_in_checkpoint("config")),
                                      "final.pt: config nested too deeply or too large: not flatfl's"),
    "checkpoint-spec-shared-list": (_on_run("hessian", "--top", "1", "--no-trace", "--samples", "16",
                                            prepare=_bomb_in_checkpoint("spec")),
                                    "final.pt: model_spec nested too deeply or too large"),
    "report-checkpoint-shared-list": (_report_with(_bomb_in_checkpoint("config")), "config nested too deeply"),
    "resume-pt-shared-list": (_resume(_bomb_in_resume), "resume.pt: metrics nested too deeply"),
    "clients-pt-shared-list": (_clients_pt(_bomb_in_clients_pt), "clients.pt: round nested too deeply"),
    "eigenvectors-shared-list": (_bomb_in_eigenvectors, "vec.pt: param_names nested too deeply"),
    "data-pt-shared-list": (_bomb_in_data_pt, "data.pt: mean nested too deeply or too large"),
    # ---- a plain pickle (not a torch zip file): one line, never torch's warning or its advice
    "checkpoint-plain-pickle": (_on_run("hessian", "--top", "1", "--no-trace", prepare=_plain_pickle),
                                "is not a flatfl checkpoint (a plain pickle: flatfl loads weights only)"),
    "data-pt-plain-pickle": (_plain_pickle_data_pt, "data.pt is not a flatfl data file (a plain pickle"),
    # ---- sizes and counts bounded where they enter, before anything is allocated
    "track-top-huge": (_train("--track-hessian", "1", "--track-top", "99999999999"),
                       "--track-top must be at most 100,000"),
    "grid-track-top-huge": (_grid(GOOD_GRID.replace("rounds = 1", "rounds = 1\ntrack_hessian = 1") +
                                  "[fixed.track_hessian_settings]\ntop = 99999999999\n"),
                            "--track-top must be at most 100,000"),
    "per-layer-top-huge": (_on_run("hessian", "--per-layer", "--per-layer-top", "99999999999"),
                           "--per-layer-top must be at most 100,000"),
    "moon-proj-dim-huge": (_train("--algo", "moon", "--moon-proj-dim", "99999999999"),
                           "--moon-proj-dim for moon must be at most 65,536"),
    "gradaug-num-subnets-huge": (_train("--reg", "gradaug", "--num-subnets", "99999999999"),
                                 "--num-subnets for gradaug must be at most 100"),
    "surface-workers-huge": (_on_run("surface", "--workers", "99999999999"), "--workers must be at most 1024"),
    # ---- values that are 0 in float32, a loss that is not finite, a device given as a file
    "lr-1e-320": (_train("--lr", "1e-320"), "--lr must be at least 1.401e-45"),
    "cfg-lr-1e-320": (_cfg("c.yaml", "model: tiny\nlr: 1.0e-320\n"), "--lr must be at least"),
    "mu-1e-320": (_train("--algo", "fedprox", "--mu", "1e-320"), "--mu must be at least"),
    "hessian-loss-nan": (_nan_loss, "the loss is not finite (nan) on evaluation batch 0"),
    "surface-eigenvectors-device": (lambda c: ["surface", str(c.run / "final.pt"), "--directions", "hessian",
                                               "--eigenvectors", "/dev/zero", "--quiet", "--out", str(c.ws / "out")],
                                    "/dev/zero is not a regular file"),
}


def test_enough_cases():
    assert len(CASES) >= 60


def _one_line_error(fn, fragment: str) -> str:
    from flatfl.errors import FlatflError

    with pytest.raises(FlatflError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text and fragment in text, text
    return text


def test_own_data_checked_before_training(tmp_path):
    """Issue 29: your own data through the Python API is checked before any training, each problem one line and
    no run folder: a label beyond the network's outputs (one forward pass on one item), ragged items, non-finite
    inputs, a label too large to count, a network that cannot take the inputs."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    cfg = RunConfig(rounds=1, clients=2, batch_size=20, threads=1).validate()
    x, y = torch.rand(60, 1, 8, 8), torch.arange(60) % 5  # 5 classes
    net3 = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    run = tmp_path / "r"
    _one_line_error(lambda: Trainer(cfg, run, dataset=TensorDataset(x, y), model=net3, quiet=True),
                    "labels go up to 4 (5 classes) but your network has 3 outputs")
    _one_line_error(lambda: Trainer(cfg, run, dataset=TensorDataset(x, y), quiet=True,
                                    model=nn.Sequential(nn.Flatten(), nn.Linear(49, 5))),
                    "your network cannot take the data's inputs")
    ragged = [(torch.rand(1, 8, 8), 0), (torch.rand(1, 8, 7), 1)] * 10
    _one_line_error(lambda: Trainer(cfg, run, dataset=ragged, quiet=True), "item 1 is (1, 8, 7)")
    bad = x.clone()
    bad[3, 0, 0, 0] = float("nan")
    _one_line_error(lambda: Trainer(cfg, run, dataset=TensorDataset(bad, y), quiet=True), "NaN or infinite")
    huge = y.clone()
    huge[0] = 10**7
    _one_line_error(lambda: Trainer(cfg, run, dataset=TensorDataset(x, huge), quiet=True), "below 100,000")
    # BatchNorm1d and a client whose last batch is one sample (iid: 2 clients of 25 of the 50 training items, 2 of
    # each class's 12 held out; batch 24 leaves 1)
    bn = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5))
    iid = RunConfig(rounds=1, clients=2, batch_size=24, partition="iid", threads=1).validate()
    _one_line_error(lambda: Trainer(iid, run, dataset=TensorDataset(x, y), model=bn, quiet=True),
                    "its last batch has 1 sample")
    assert not run.exists()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_case(name, base, tmp_path, monkeypatch):
    setup, fragment = CASES[name]
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    ctx = Ctx(base, ws, monkeypatch)
    try:
        argv = setup(ctx)
        before_ws, before_base = snapshot(ws), snapshot(base)
        result = CliRunner().invoke(main, argv)
        monkeypatch.undo()
        after_ws, after_base = snapshot(ws), snapshot(base)
    finally:
        for fn in ctx._later:
            fn()
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code not in (0, None), (name, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (name, repr(result.exception))
    assert "Traceback" not in result.output, (name, result.output)
    assert len(lines) == 1, (name, result.stderr)
    assert lines[0].startswith("flatfl: ") and fragment in lines[0], (name, lines[0])
    assert "weights_only" not in lines[0], (name, lines[0])  # never torch's advice to load code
    assert after_base == before_base, name
    changed = {k for k in set(before_ws) | set(after_ws) if before_ws.get(k) != after_ws.get(k)}
    assert not changed, (name, sorted(changed))
    assert not (ws / "PWNED").exists()


def _ctrl_c_as_in_a_terminal():
    """SIGINT at its default in the child, as in a terminal: a test suite started in the background by a
    non-interactive shell (``cmd &``) inherits SIGINT ignored, and Python then installs no handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_while_importing_torch(proc, after: float = 0.0):
    """Send SIGINT once the child maps torch's libraries (flatfl's start-up, past the interpreter's own start: a
    signal during Python's initialisation is Python's, not flatfl's, to handle), ``after`` seconds later."""
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():
        proc.kill()
        pytest.skip("needs /proc to see the child's start-up")
    deadline = time.monotonic() + 120
    while "libtorch" not in (maps.read_text(errors="replace") if maps.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, "flatfl never started importing torch"
        time.sleep(0.005)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """SIGINT while flatfl is still importing (torch) or starting: one line, non-zero exit, no run folder."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for delay in (0.0, 0.4):
        proc = subprocess.Popen([sys.executable, "-m", "flatfl", "train", *FAST, "--rounds", "50", "--out",
                                 str(tmp_path / "r")], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
        _interrupt_while_importing_torch(proc, after=delay)
        _, err = proc.communicate(timeout=60)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode != 0 and "Traceback" not in err and len(lines) == 1, err
        assert "interrupted" in lines[0] or "Aborted" in lines[0], err


def test_console_script_entry_point_starts(tmp_path):
    """The installed ``flatfl`` script does ``from flatfl.cli import main`` with argv[0] 'flatfl' (a different
    import order from ``python -m flatfl``): it must start, and Ctrl-C while it starts is one line too."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = "import sys; sys.argv[0] = 'flatfl'; from flatfl.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", script, "--version"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "version" in done.stdout and not done.stderr.strip(), done.stderr
    proc = subprocess.Popen([sys.executable, "-c", script, "train", *FAST, "--rounds", "50", "--out",
                             str(tmp_path / "r")], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    _interrupt_while_importing_torch(proc)
    _, err = proc.communicate(timeout=60)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode != 0 and "Traceback" not in err and len(lines) == 1, err


def test_ctrl_c_while_torch_imports_is_held_back(tmp_path):
    """A Ctrl-C arriving while torch imports is raised once the import is done, as a KeyboardInterrupt (so torch's
    C++ start-up is never interrupted); without one the import returns normally."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = ("import os, subprocess, sys\n"
              "from flatfl.utils.startup import import_torch_uninterruptibly\n"
              "if sys.argv[1] == 'kill':\n"
              "    subprocess.Popen(['sh', '-c', f'sleep 0.05; kill -INT {os.getpid()}'])\n"
              "try:\n"
              "    import_torch_uninterruptibly()\n"
              "    import time; time.sleep(0.5)\n"
              "    print('imported', 'torch' in sys.modules)\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted after the import:', 'torch' in sys.modules)\n")
    for mode, expected in (("kill", "interrupted after the import: True"), ("none", "imported True")):
        done = subprocess.run([sys.executable, "-c", script, mode], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120, preexec_fn=_ctrl_c_as_in_a_terminal)
        assert done.returncode == 0 and done.stdout.strip() == expected and not done.stderr.strip(), (mode, done)


def test_other_model_factory_gets_a_notice(tmp_path, monkeypatch):
    """Issue 29: ``--model-factory`` other than the one the checkpoint recorded is said aloud (the weights still
    load when they fit); the recorded one, given again, is not."""
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    monkeypatch.chdir(tmp_path)
    code = "from torch import nn\n\ndef net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n"
    (tmp_path / "fac_i29a.py").write_text(code)
    (tmp_path / "fac_i29b.py").write_text(code)
    cfg = RunConfig(rounds=1, clients=2, batch_size=64, threads=1).validate()
    final = Trainer(cfg, tmp_path / "r", model_factory="fac_i29a:net", quiet=True).run()
    seen = {}
    for factory in ("fac_i29b:net", "fac_i29a:net"):
        r = CliRunner().invoke(main, ["hessian", str(final), "--model-factory", factory, "--top", "1", "--no-trace",
                                      "--samples", "16", "--quiet", "--out", str(tmp_path / factory.split(":")[0])])
        assert r.exit_code == 0, r.output
        seen[factory] = r.stderr
    assert "notice: --model-factory fac_i29b:net is not the factory" in seen["fac_i29b:net"]
    assert "(fac_i29a:net)" in seen["fac_i29b:net"] and "notice" not in seen["fac_i29a:net"]


def test_sweep_recomputes_a_result_of_other_weights(base, tmp_path):
    """Issue 29: ``flatfl.run_layout.analyse_run`` (sweeps, reproductions) does not skip a hessian.json that measured
    other weights (copied in with its manifest, newer than final.pt): it computes it again, of this run's weights."""
    from flatfl.run_layout import analyse_run
    from flatfl.utils.provenance import state_digest

    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    shutil.copytree(base / "hess-other", run / "hessian")
    os.utime(run / "hessian" / "hessian.json")  # newer than final.pt, as a fresh result would be
    wanted = json.loads((run / "hessian" / "hessian.json").read_text())["settings"]
    wanted = {k: wanted[k] for k in ("top", "trace", "samples")}
    done = analyse_run(run, hessian=wanted)
    assert done["hessian"] == "computed"
    own = state_digest(torch.load(run / "final.pt", weights_only=True)["state_dict"])
    assert json.loads((run / "hessian" / "hessian.json").read_text())["weights_sha256"] == own


def test_killed_worker_fails_only_its_task(tmp_path, monkeypatch):
    """Issue 29: a worker killed with SIGKILL (as the out-of-memory killer does) breaks the process pool; only the
    task that kills its worker fails, in one line, and every other task finishes with its result."""
    from flatfl.executors import LocalExecutor

    (tmp_path / "killer_i29.py").write_text(
        "import os, signal\n\n"
        "def work(x):\n"
        "    if x == 1:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return 10 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import killer_i29

    outcomes = {o.index: o for o in LocalExecutor(2).map(killer_i29.work, [0, 1, 2, 3])}
    assert sorted(outcomes) == [0, 1, 2, 3]
    assert {i: o.result for i, o in outcomes.items() if o.ok} == {0: 0, 2: 20, 3: 30}
    assert not outcomes[1].ok and "worker process died" in outcomes[1].error and "\n" not in outcomes[1].error
    assert outcomes[1].details is None


def test_a_pool_that_dies_without_failing_its_futures_does_not_hang(tmp_path, monkeypatch):
    """A worker killed at the wrong moment can take the process pool's manager down without failing the futures it
    held. Simulated: no future ever completes and no worker process is alive; every task then ends, in one line,
    as lost twice, instead of the map waiting forever."""
    import flatfl.executors as executors

    (tmp_path / "square_dead_pool.py").write_text("def work(x):\n    return x * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import square_dead_pool

    monkeypatch.setattr(executors, "POOL_POLL_SECONDS", 0.01)
    monkeypatch.setattr(executors, "wait", lambda fs, timeout, return_when: (set(), set(fs)))
    monkeypatch.setattr(executors.multiprocessing, "active_children", lambda: [])
    outcomes = list(executors.LocalExecutor(2).map(square_dead_pool.work, [1, 2, 3]))
    assert sorted(o.index for o in outcomes) == [0, 1, 2]
    assert all(not o.ok and "worker process died" in o.error and "\n" not in o.error for o in outcomes)


def test_resume_keeps_the_versions_of_earlier_rounds_and_report_shows_them(tmp_path, crash_in_round):
    """A run resumed under other library versions keeps, in config.json, the versions its earlier rounds were
    trained with and adds the resumption's under 'resumed'; the report then says that versions differ."""
    from flatfl.report import build_report
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    run = tmp_path / "run"
    cfg = RunConfig(model="tiny", rounds=2, clients=4, participation=1.0, local_epochs=1, batch_size=64,
                    checkpoint_every=1, threads=1).validate()
    with crash_in_round(1), pytest.raises(RuntimeError, match="simulated crash"):  # stopped after round 1's checkpoint
        Trainer(cfg, run, quiet=True).run()
    old_env = dict(json.loads((run / "config.json").read_text())["environment"], flatfl="0.0.9", torch="1.13.0")
    edit_json(run / "config.json", lambda d: d.update(environment=old_env, flatfl_version="0.0.9"))
    r = CliRunner().invoke(main, ["train", "--resume", str(run), "--quiet"])
    assert r.exit_code == 0, r.output
    saved = json.loads((run / "config.json").read_text())
    assert saved["environment"] == old_env and saved["flatfl_version"] == "0.0.9"
    assert [e["from_round"] for e in saved["resumed"]] == [1]
    assert saved["resumed"][0]["environment"]["torch"] == torch.__version__
    summary = build_report([run], tmp_path / "rep")
    assert any("different flatfl / torch versions" in n and "torch 1.13.0" in n and "training from round 1" in n
               for n in summary["notices"]), summary["notices"]


# ------------------------------------------------------------------------------------------- own networks, bounds
def test_edited_model_factory_is_refused_and_old_checkpoints_still_load(tmp_path, monkeypatch):
    """Your network's structure is recorded with the checkpoint: once ``my_models.py`` builds another network
    (a ReLU now a Tanh), ``flatfl hessian``, ``flatfl.load_checkpoint(path, model=net)`` and ``--resume`` refuse it
    in one line, where only parameter shapes were compared before; changed code of your own class is a notice,
    a comment is nothing; a checkpoint recorded without the structure (older flatfl) still loads."""
    import importlib

    import flatfl
    from flatfl.errors import CheckpointError
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer
    from flatfl.utils.provenance import json_digest

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    seq = ("from torch import nn\n\ndef net():\n"
           "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.{}(), nn.Linear(8, 10))\n")
    (tmp_path / "fac_i41_seq.py").write_text(seq.format("ReLU"))
    cls = ("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
           "        super().__init__()\n        self.a, self.b = nn.Linear(64, 8), nn.Linear(8, 10)\n\n"
           "    def forward(self, x):\n        return self.b(torch.{}(self.a(x.flatten(1))))\n\n\ndef net():\n"
           "    return Net()\n")
    (tmp_path / "fac_i41_cls.py").write_text(cls.format("relu"))
    cfg = RunConfig(rounds=1, clients=2, batch_size=64, threads=1).validate()
    seq_final = Trainer(cfg, tmp_path / "seq", model_factory="fac_i41_seq:net", quiet=True).run()
    cls_final = Trainer(cfg, tmp_path / "cls", model_factory="fac_i41_cls:net", quiet=True).run()

    def hessian(final, out):
        return CliRunner().invoke(main, ["hessian", str(final), "--top", "1", "--no-trace", "--samples", "16",
                                         "--quiet", "--out", str(tmp_path / out)])

    (tmp_path / "fac_i41_seq.py").write_text(seq.format("Tanh"))  # same parameter shapes, another network
    importlib.invalidate_caches()
    sys.modules.pop("fac_i41_seq", None)
    r = hessian(seq_final, "h-seq")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "builds another network than the one trained (module '2' is Tanh(), trained as ReLU())" in lines[0]
    assert not (tmp_path / "h-seq").exists()
    import fac_i41_seq

    with pytest.raises(CheckpointError, match=r"module '2' is Tanh\(\), trained as ReLU\(\)"):
        flatfl.load_checkpoint(seq_final, model=fac_i41_seq.net())
    r = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / "seq"), "--quiet"])
    assert r.exit_code == 2 and "your network is not the one the run trained" in r.stderr, r.output

    # your own class: a comment is no change; another activation in forward is said aloud
    commented = cls.format("relu").replace("    def forward", "    # edited\n    def forward")
    (tmp_path / "fac_i41_cls.py").write_text(commented)
    sys.modules.pop("fac_i41_cls", None)
    r = hessian(cls_final, "h-cls-comment")
    assert r.exit_code == 0 and "notice" not in r.stderr, r.output
    (tmp_path / "fac_i41_cls.py").write_text(cls.format("tanh"))
    sys.modules.pop("fac_i41_cls", None)
    r = hessian(cls_final, "h-cls-code")
    assert r.exit_code == 0 and "notice: the code of fac_i41_cls.Net changed since" in r.stderr, r.output

    # a checkpoint of a flatfl that recorded no structure: loads as before
    def drop_structure(p):
        p["model_spec"] = {k: v for k, v in p["model_spec"].items() if k != "structure"}
        p["model_spec_sha256"] = json_digest(p["model_spec"])

    edit_checkpoint(seq_final, drop_structure)
    assert flatfl.load_checkpoint(seq_final, model=fac_i41_seq.net()).num_params == 64 * 8 + 8 + 8 * 10 + 10


LIMITED = r"""
import resource, sys
from flatfl.cli import main
import flatfl.data.formats, yaml  # loaded before the limit: the commands' own code

def size():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))

limit = size() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for argv in sys.argv[2:]:
    try:
        main(argv.split("\t"))
    except SystemExit as e:
        print("exit", e.code, flush=True)
    except MemoryError:
        print("exit MemoryError", flush=True)
"""


def _gzip_bomb(path: Path, declared=(60_000, 28, 28), inflated_mib: int = 1024) -> None:
    """An IDX images file whose header declares ``declared`` and whose gzip data inflates to ``inflated_mib`` MiB
    (gzip members of 16 MiB of zeros, concatenated: a few hundred kB on disk)."""
    import gzip

    header = (0x803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in declared)
    zeros = gzip.compress(bytes(16 << 20), compresslevel=9, mtime=0)
    with open(path, "wb") as f:
        f.write(gzip.compress(header, mtime=0))
        for _ in range(inflated_mib // 16):
            f.write(zeros)


def test_gzip_and_yaml_bombs_under_a_memory_limit(tmp_path):
    """Under an address-space limit of 300 MiB above what flatfl itself takes, a Fashion-MNIST ``.gz`` that
    inflates to 1 GiB (its header declaring the real 60,000 images) and a YAML config of a few hundred bytes whose
    aliases stand for 387 million values each end in one named line, fast: the IDX file is streamed and not
    inflated past its declared size, the aliases are counted, not expanded."""
    folder = tmp_path / "data" / "fashion-mnist"
    folder.mkdir(parents=True)
    _gzip_bomb(folder / "train-images-idx3-ubyte.gz")
    for name in ("train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (folder / name).write_bytes(b"unused: the first file already fails")
    levels = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefg", "bcdefgh"):
        levels.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = "model: tiny\nlr: [" + ", ".join(levels + ["[" + ",".join(["*h"] * 9) + "]"]) + "]\n"
    (tmp_path / "bomb.yaml").write_text(bomb)
    assert len(bomb) < 700
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["train\t--dataset\tfashion-mnist\t--data-dir\t" + str(tmp_path / "data") + "\t--threads\t1\t--out\t"
            + str(tmp_path / "r1"),
            "train\t--config\t" + str(tmp_path / "bomb.yaml") + "\t--threads\t1\t--out\t" + str(tmp_path / "r2")]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LIMITED, str(300 << 20), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert done.stdout.split("\n")[:2] == ["exit 2", "exit 2"], (done.stdout, done.stderr[-2000:])
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2 and all(ln.startswith("flatfl: error: ") and len(ln) < 700 for ln in lines), lines
    assert "train-images-idx3-ubyte.gz holds more than the 47,040,016 bytes its header (60000, 28, 28) declares" \
        in lines[0], lines[0]
    assert "bomb.yaml holds" in lines[1] and "values once its YAML aliases are expanded" in lines[1], lines[1]
    assert took < 120 and not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_idx_header_declaring_more_than_the_file_is_refused_before_inflating(tmp_path):
    """A header declaring more than the known file size (or, for files of unknown size, more than any data set
    read here) is refused from the header alone."""
    from flatfl.data import formats
    from flatfl.errors import DatasetError

    _gzip_bomb(tmp_path / "big.gz", declared=(10**6, 28, 28), inflated_mib=16)
    with pytest.raises(DatasetError, match=r"declares \(1000000, 28, 28\) \(784,000,016 bytes\), more than the "
                                           r"47,040,016 bytes this file may hold: refused before inflating"):
        formats.read_idx(tmp_path / "big.gz", 0x803, size=47_040_016)
    _gzip_bomb(tmp_path / "huge.gz", declared=(2**31, 2**16, 2**16), inflated_mib=16)
    with pytest.raises(DatasetError, match="refused before inflating"):
        formats.read_idx(tmp_path / "huge.gz", 0x803)


def test_yaml_aliases_and_long_values_give_short_lines(tmp_path):
    """A recursive alias and a value quoted in an error (a list of 5,000 copies of a 200-character string, within
    the bound) give one line of a few hundred characters, not megabytes."""
    (tmp_path / "rec.yaml").write_text("model: &m [[*m]]\n")
    (tmp_path / "long.yaml").write_text('lr: [&a ["' + "y" * 200 + '"], ' + ",".join(["*a"] * 5000) + "]\n")
    for name, fragment in (("rec.yaml", "contains itself (a recursive YAML alias)"),
                           ("long.yaml", "--lr must be a number")):
        r = CliRunner().invoke(main, ["train", "--config", str(tmp_path / name), "--out", str(tmp_path / "r")])
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and fragment in lines[0], r.stderr[:500]
        assert len(lines[0]) < 700, len(lines[0])


class _Server:
    """An HTTP server on 127.0.0.1 (a thread) answering every request with ``respond(handler)``."""

    def __init__(self, respond):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                try:
                    respond(self)
                except OSError:  # the client went away
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _endless(h, announce=None):
    """Zeros without end (stops at 64 MiB, so that a client without a cap ends too)."""
    h.send_response(200)
    if announce is not None:
        h.send_header("Content-Length", str(announce))
    h.end_headers()
    block = bytes(1 << 20)
    for _ in range(64):
        h.wfile.write(block)


def _trickle(h, seconds=8.0, headers_too=False):
    """A byte of data every 0.1 s (with ``headers_too``, a header line), for ``seconds``."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\n" if headers_too else b"HTTP/1.1 200 OK\r\n\r\n")
    h.wfile.flush()
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        h.wfile.write(b"X-Slow: 1\r\n" if headers_too else b"\0")
        h.wfile.flush()
        time.sleep(0.1)


def test_download_is_bounded_in_size_and_time(tmp_path, monkeypatch):
    """``--download`` against a local server: an endless stream stops at the archive's known size, a server that
    announces more is not read at all, a trickle of data or of headers stops at the overall deadline; each is one
    DatasetError line, and no ``.part`` file is left."""
    import dataclasses

    from flatfl.data import download
    from flatfl.errors import DatasetError

    monkeypatch.setattr(download, "DOWNLOAD_TIMEOUT", 5.0)
    monkeypatch.setattr(download, "DOWNLOAD_DEADLINE", 1.0)
    cases = [(_endless, r"sent more than the 1,048,576 bytes of cifar-10-python.tar.gz; stopped"),
             (lambda h: _endless(h, announce=1 << 30), r"announces 1,073,741,824 bytes, more than the 1,048,576"),
             (_trickle, r"not finished within 1 s \(\d+ bytes received\); stopped"),
             (lambda h: _trickle(h, headers_too=True), r"not finished within 1 s")]
    for k, (respond, message) in enumerate(cases):
        root = tmp_path / f"root{k}"
        with _Server(respond) as base:
            spec = dataclasses.replace(download.ARCHIVES["cifar10"], url=base + "cifar-10-python.tar.gz",
                                       size=1 << 20)
            monkeypatch.setitem(download.ARCHIVES, "cifar10", spec)
            start = time.monotonic()
            with pytest.raises(DatasetError, match=message) as info:
                download.ensure_dataset("cifar10", root)
            assert time.monotonic() - start < 4.0 and "\n" not in str(info.value)
        assert list(root.iterdir()) == [], (k, list(root.iterdir()))


KILLED_DOWNLOAD = r"""
import sys
from pathlib import Path
from flatfl.data import download
download.FASHION_MNIST_URL, download.DEBIAN_FASHION_MNIST = sys.argv[1], Path(sys.argv[2]) / "no-debian"
download.ensure_fashion_mnist(Path(sys.argv[2]) / "data", download=True)
"""


def test_download_killed_with_sigterm_leaves_no_part_file(tmp_path):
    """SIGTERM (``kill``, ``timeout``) in the middle of a download: the ``.part`` file is removed and the process
    still ends by SIGTERM."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    folder = tmp_path / "data" / "fashion-mnist"
    with _Server(lambda h: _trickle(h, seconds=60)) as base:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_DOWNLOAD, base, str(tmp_path)], cwd=tmp_path,
                                env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not list(folder.glob(".*.part")) if folder.is_dir() else True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == -signal.SIGTERM, proc.stderr.read()
    assert list(folder.iterdir()) == []


def test_fashion_mnist_download_removes_a_dead_downloads_part_file(tmp_path, monkeypatch):
    """A Fashion-MNIST download killed midway (its process gone) left a ``.part``: the next download removes it."""
    import dataclasses
    import gzip
    import hashlib

    import numpy as np

    from flatfl.data import download, load_dataset

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    files = []
    for f, (magic, shape) in zip(download.FASHION_MNIST_FILES, ((0x803, (20, 28, 28)), (0x801, (20,)),
                                                                (0x803, (10, 28, 28)), (0x801, (10,)))):
        raw = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in shape) + bytes(int(np.prod(shape)))
        (mirror / f.name).write_bytes(gzip.compress(raw, mtime=0))
        files.append(dataclasses.replace(f, sha256=hashlib.sha256(raw).hexdigest(),
                                         gz_md5=hashlib.md5((mirror / f.name).read_bytes()).hexdigest()))
    monkeypatch.setattr(download, "FASHION_MNIST_FILES", tuple(files))
    monkeypatch.setattr(download, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    monkeypatch.setattr(download, "FASHION_MNIST_URL", mirror.as_uri() + "/")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "data" / "fashion-mnist"
    folder.mkdir(parents=True)
    stale = folder / f".train-images-idx3-ubyte.gz.{dead.pid}.abcd1234.part"
    stale.write_bytes(b"half a download")
    assert len(load_dataset("fashion-mnist", tmp_path / "data", download=True).train_y) == 20
    assert sorted(p.name for p in folder.iterdir()) == sorted(f.name for f in files)


def test_install_data_names_missing_files(tmp_path):
    """``install.sh data`` says "installed" only when all four files are there; else it names the missing ones
    and exits non-zero (an apt-get that installed nothing stands in for the package manager)."""
    fm, bin_dir = tmp_path / "fm", tmp_path / "bin"
    fm.mkdir()
    bin_dir.mkdir()
    for tool in ("dirname", "id"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    for fake in ("apt-get", "sudo"):
        (bin_dir / fake).write_text('#!/bin/sh\n[ "$0" = "${0%sudo}" ] || exec "$@"\nexit 0\n')
        (bin_dir / fake).chmod(0o755)
    names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
             "t10k-labels-idx1-ubyte.gz"]
    (fm / names[0]).write_bytes(b"x")
    (fm / names[3]).write_bytes(b"x")
    env = {"PATH": str(bin_dir), "FLATFL_FASHION_MNIST_DIR": str(fm), "HOME": str(tmp_path)}
    bash = shutil.which("bash")
    done = subprocess.run([bash, str(ROOT / "install.sh"), "data"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "installed" not in done.stdout, (done.stdout, done.stderr)
    assert f"still lacks {names[1]}, {names[2]}" in done.stderr, done.stderr
    for name in names:
        (fm / name).write_bytes(b"x")
    done = subprocess.run([bash, str(ROOT / "install.sh"), "data"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"Fashion-MNIST already installed in {fm}", done


def test_empty_source_date_epoch_is_ignored(monkeypatch):
    """An empty ``SOURCE_DATE_EPOCH`` is taken as unset: removed before the command runs (numpy's f2py, imported
    with scipy by report and hessian, reads it as a number and failed: ``invalid literal for int()``); one that is
    no number of seconds is one line naming it."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "")
    r = CliRunner().invoke(main, ["partition", "--clients", "2"])
    assert r.exit_code == 0 and "SOURCE_DATE_EPOCH" not in os.environ, r.output
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "soon")
    r = CliRunner().invoke(main, ["partition", "--clients", "2"])
    assert r.exit_code == 2 and r.stderr == ("flatfl: error: SOURCE_DATE_EPOCH must be a non-negative integer (seconds "
                                             "since 1970), got 'soon'; unset it or leave it empty to use the current "
                                             "time\n"), r.output


def test_a_long_load_error_is_cut_at_a_word():
    """A loader's message longer than a line is cut between words, with an ellipsis, never mid-word."""
    from flatfl.checkpoint import short_reason

    words = "the pickle stream declares a frame of 18446744073709551615 bytes which exceeds what this file holds " * 3
    cut = short_reason(ValueError(words + "\nsecond line"))
    assert cut.endswith(" ...") and len(cut) <= 164 and "second" not in cut
    assert words.startswith(cut[:-4]) and words[len(cut) - 4] == " "
    assert short_reason(ValueError("")) == "ValueError" and short_reason(OSError("short")) == "short"
