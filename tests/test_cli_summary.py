"""Every command ends with one line saying what it found and where it wrote it, piped or in a terminal (issue 18.2),
and ``--threads`` is validated and applied on every compute command (issue 18.1)."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import flatfl
from flatfl.cli import main
from flatfl.utils.threads import apply_threads, check_threads, default_threads

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--model", "tiny", "--rounds", "2", "--clients", "3", "--local-epochs", "1", "--batch-size", "64",
         "--threads", "1"]


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def last_line(output: str) -> str:
    return [ln for ln in output.splitlines() if ln.strip()][-1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary") / "run"
    r = CliRunner().invoke(main, TRAIN + ["--save-clients", "--quiet", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out, r.output


def test_train_ends_with_accuracies_and_path(run_dir):
    out, output = run_dir
    line = last_line(output)
    m = re.fullmatch(r"round 2: test accuracy (\d+\.\d\d)% \(server model\), (\d+\.\d\d)% \(average of all "
                     r"clients' models\) -> (.+)", line)
    assert m, line
    assert Path(m.group(3)) == out / "final.pt"
    # the server accuracy, recomputed from the checkpoint's model on the test split
    ckpt = flatfl.load_checkpoint(out / "final.pt")
    correct = total = 0
    with torch.no_grad():
        for x, y in ckpt.eval_batches("test", batch_size=512):
            correct += int((ckpt.model(x).argmax(1) == y).sum())
            total += len(y)
    assert float(m.group(1)) == pytest.approx(100 * correct / total, abs=0.006)
    row = list(csv.DictReader((out / "metrics.csv").open()))[-1]
    assert float(m.group(2)) == pytest.approx(100 * float(row["all_test_acc"]), abs=0.006)


def test_train_summary_survives_a_terminal(tmp_path):
    """In a pseudo-terminal the progress bar is drawn and erased; the summary line comes after it and stays."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    proc = subprocess.Popen([sys.executable, "-m", "flatfl", *TRAIN, "--out", str(tmp_path / "r")], cwd=ROOT,
                            stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(master)
    screen = b"".join(chunks).decode(errors="replace")
    final_line = screen.replace("\r\n", "\n").rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert "test accuracy" in final_line and final_line.endswith(str(tmp_path / "r" / "final.pt")), repr(screen[-600:])


def test_hessian_summary(run_dir, tmp_path):
    out = tmp_path / "h"
    r = invoke("hessian", str(run_dir[0]), "--samples", "128", "--trace-hvps", "12", "--quiet", "--threads", "1",
               "--out", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "hessian.json").read_text())
    tr = rep["trace"]
    assert last_line(r.output) == (
        f"Hessian, exact products ({rep['products']['method']}), {rep['precision']}: top eigenvalue "
        f"{rep['top_eigenvalues'][0]:.6g} +- {rep['error_estimates'][0]:.2g}, trace {tr['estimate']:.6g} +- "
        f"{tr['stderr']:.3g} on 128 samples; {rep['hvps_total']} HVPs in {rep['seconds']:.1f} s -> "
        f"{out / 'hessian.json'}")
    # 12 products cannot reach the default 1% target: the trace line says so, with the error they reached
    assert tr["target_reached"] is False and tr["target_rtol"] == 0.01
    line = next(s for s in r.output.splitlines() if s.startswith("trace: "))
    assert line.endswith(f"12 HVPs; the target of 1% relative error was not reached in the budget "
                         f"({100 * tr['relative_stderr']:.3g}% at 12 HVPs))"), line


def test_hessian_clients_surface_report_summaries(run_dir, tmp_path):
    run = str(run_dir[0])
    out = tmp_path / "hc"
    r = invoke("hessian-clients", run, "--probes", "6", "--groups", "3", "--samples", "32", "--quiet",
               "--out", str(out))
    assert r.exit_code == 0, r.output
    c = json.loads((out / "clients-default.json").read_text())
    line = last_line(r.output)
    assert line.startswith(f"H_N {c['H_N']:.6g} +- ") and f", H_D {c['H_D']:.6g} +- " in line, line
    assert line.endswith(f"-> {out / 'clients-default.json'}")

    out = tmp_path / "s"
    r = invoke("surface", run, "--grid", "3", "--samples", "64", "--quiet", "--threads", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    s = json.loads((out / "surface.json").read_text())
    line = last_line(r.output)
    assert line.startswith(f"loss min {s['loss_min']:.6g}, max {s['loss_max']:.6g}, loss at origin ") and \
        line.endswith(f"-> {out / 'surface.json'}"), line
    assert s["loss_min"] <= s["loss_at_origin"] <= s["loss_max"]

    out = tmp_path / "rep"
    r = invoke("report", run, "--out", str(out))
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    tables = ", ".join(summary["tables"]) or "no paper table"
    assert last_line(r.output) == (f"1 runs, tables: {tables}; {len(summary['pages'])} PDF pages "
                                   f"-> {out}/report.pdf")
    # what the tables found, as the report's first page says it, is printed before that line
    assert summary["headline"] and all(sentence in r.output.splitlines()[:-1] for sentence in summary["headline"])
    assert (out / "report.pdf").is_file()


def test_sweep_summary(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(f'out = "{tmp_path / "sw"}"\nthreads = 1\n[fixed]\nmodel = "tiny"\nrounds = 1\nclients = 2\n'
                    'local_epochs = 1\nbatch_size = 64\n[grid]\nseed = [0, 1]\n')
    r = invoke("sweep", str(grid), "--workers", "1")
    assert r.exit_code == 0, r.output
    assert last_line(r.output) == f"2 of 2 runs done -> {tmp_path / 'sw'}/sweep.csv"
    assert len(list(csv.DictReader((tmp_path / "sw" / "sweep.csv").open()))) == 2


# ------------------------------------------------------------------------------------------------------ threads
@pytest.mark.parametrize("command", [
    ["train"], ["hessian", "ckpt", "--out", "o"], ["hessian-clients", "ckpt", "--out", "o"],
    ["surface", "ckpt", "--out", "o"], ["report", "r", "--out", "o"], ["sweep", "g.toml"],
    ["reproduce", "man-table6", "--preset", "tiny"]])
def test_threads_below_one_is_one_line_exit_2(command, tmp_path):
    r = CliRunner().invoke(main, command + ["--threads", "0"])
    assert r.exit_code == 2
    assert r.output.strip() == "flatfl: error: --threads must be a positive integer (>= 1), got 0"


def test_threads_config_key_is_validated_and_applied(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('threads = "two"\n')
    r = CliRunner().invoke(main, ["train", "--config", str(cfg), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and r.output.strip() == "flatfl: error: --threads must be an integer, got 'two'"
    cfg.write_text("threads = 1\nrounds = 1\nclients = 2\nmodel = 'tiny'\n")
    torch.set_num_threads(2)
    r = CliRunner().invoke(main, ["train", "--config", str(cfg), "--quiet", "--out", str(tmp_path / "y")])
    assert r.exit_code == 0, r.output
    assert torch.get_num_threads() == 1
    assert json.loads((tmp_path / "y" / "config.json").read_text())["config"]["threads"] == 1


def test_default_threads_rule():
    assert default_threads(cores=2, load=0.0) == 1 and default_threads(cores=1, load=0.0) == 1
    assert default_threads(cores=16, load=0.0) == 16
    assert default_threads(cores=16, load=1.2) == 15  # one busy core left alone
    assert default_threads(cores=16, load=3.6) == 12
    assert default_threads(4, cores=16, load=0.0) == 4  # four workers share the idle cores
    assert default_threads(cores=8, load=30.0) == 1
    assert check_threads(None) is None and check_threads(3) == 3
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(flatfl.errors.FlatflError):
            check_threads(bad)
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
