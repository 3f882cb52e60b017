"""The training engine end to end on digits: checkpoints, resume (kill -9 included), the CLI's bad-input handling."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import flatfl
from flatfl.cli import main
from flatfl.errors import CheckpointError

FAST = ["--model", "tiny", "--clients", "6", "--participation", "0.5", "--local-epochs", "1", "--batch-size", "32",
        "--quiet"]


def _train(tmp, *args):
    r = CliRunner().invoke(main, ["train", *FAST, *args], catch_exceptions=False)
    return r


def _sd(path):
    return torch.load(path, weights_only=True)["state_dict"]


def _same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _metrics_wo_time(run):
    import csv

    rows = list(csv.DictReader(open(run / "metrics.csv")))
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_train_writes_run_and_checkpoint_round_trips(tmp_path):
    out = tmp_path / "run"
    r = _train(tmp_path, "--rounds", "4", "--checkpoint-every", "2", "--out", str(out))
    assert r.exit_code == 0, r.output
    for f in ("config.json", "partition.json", "metrics.csv", "final.pt", "resume.pt",
              "checkpoints/round_0002.pt", "checkpoints/round_0004.pt"):
        assert (out / f).is_file(), f
    assert len(_metrics_wo_time(out)) == 4
    ck = flatfl.load_checkpoint(out / "final.pt")
    assert ck.round == 4 and not ck.model.training
    assert ck.num_params == sum(p.numel() for p in ck.model.parameters())
    # the weights are the server model the engine saved
    assert _same_state(ck.model.state_dict(), _sd(out / "final.pt"))
    # a run directory resolves to its final checkpoint
    assert flatfl.load_checkpoint(out).round == 4
    # deterministic evaluation batches; the sample-draw depends on the seed only
    b1 = ck.eval_batches("train", samples=100, batch_size=32, seed=3)
    b2 = ck.eval_batches("train", samples=100, batch_size=32, seed=3)
    assert [len(y) for _, y in b1] == [32, 32, 32, 4]
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(b1, b2))
    # the checkpoint's accuracy equals the one recorded in metrics.csv
    xs, ys = zip(*ck.eval_batches("test", batch_size=500))
    acc = float(torch.cat([ck.model(x).argmax(1) for x in xs]).eq(torch.cat(ys)).float().mean())
    assert abs(acc - float(_metrics_wo_time(out)[-1]["test_acc"])) < 1e-6


def test_resume_after_crash_equals_uninterrupted(tmp_path, crash_in_round):
    ref = tmp_path / "ref"
    assert _train(tmp_path, "--rounds", "6", "--checkpoint-every", "2", "--out", str(ref)).exit_code == 0
    crashed = tmp_path / "crashed"
    with crash_in_round(4):  # round 5, after the round-4 checkpoint
        r = _train(tmp_path, "--rounds", "6", "--checkpoint-every", "2", "--out", str(crashed))
    assert r.exit_code == 1 and "internal error RuntimeError: simulated crash" in r.output  # one line, no traceback
    assert not (crashed / "final.pt").exists()
    r = CliRunner().invoke(main, ["train", "--resume", str(crashed), "--quiet"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert _same_state(_sd(ref / "final.pt"), _sd(crashed / "final.pt"))
    assert _metrics_wo_time(ref) == _metrics_wo_time(crashed)


def test_resume_after_kill_9(tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    args = [sys.executable, "-m", "flatfl", "train", *FAST, "--rounds", "40", "--checkpoint-every", "3"]
    # the uninterrupted run in this process (its own process would add only its start-up); the killed one, and its
    # resume, in processes of their own
    assert _train(tmp_path, "--rounds", "40", "--checkpoint-every", "3", "--out", str(ref)).exit_code == 0
    p = subprocess.Popen(args + ["--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "round_0006.pt").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (killed / "final.pt").exists(), "the run finished before it could be killed"
    r = subprocess.run([sys.executable, "-m", "flatfl", "train", "--resume", str(killed), "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _same_state(_sd(ref / "final.pt"), _sd(killed / "final.pt"))
    assert _metrics_wo_time(ref) == _metrics_wo_time(killed)


def test_config_file_and_command_line_precedence(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('rounds = 3\nlr = 0.05\nalgo = "fedprox"\n[params]\nmu = 0.01\n')
    out = tmp_path / "run"
    r = _train(tmp_path, "--config", str(cfg), "--rounds", "2", "--out", str(out))
    assert r.exit_code == 0, r.output
    import json

    saved = json.loads((out / "config.json").read_text())
    assert saved["config"]["rounds"] == 2 and saved["config"]["lr"] == 0.05
    assert saved["resolved"]["algorithm"] == {"name": "fedprox", "mu": 0.01}
    ycfg = tmp_path / "c.yaml"
    ycfg.write_text("rounds: 1\nmu: 0.5\nalgo: fedprox\nlocal-epochs: 1\n")
    out2 = tmp_path / "run2"
    assert _train(tmp_path, "--config", str(ycfg), "--out", str(out2)).exit_code == 0
    assert json.loads((out2 / "config.json").read_text())["resolved"]["algorithm"]["mu"] == 0.5


def _bad(args, tmp_path):
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    return lines


@pytest.mark.parametrize("args,msg", [
    (["--dataset", "mnist"], "unknown dataset"),
    (["--model", "vgg99"], "unknown model"),
    (["--algo", "fedfoo"], "unknown algorithm"),
    (["--reg", "nope"], "unknown regularizer"),
    (["--local-opt", "adamw"], "unknown local optimizer"),
    (["--participation", "0"], "participation"),
    (["--participation", "1.5"], "participation"),
    (["--rounds", "0"], "rounds"),
    (["--lr", "-0.1"], "lr"),
    (["--batch-size", "0"], "batch-size"),
    (["--clients", "5000"], "more clients"),
    (["--alpha", "0"], "alpha"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}/nodata"], "cifar"),
    (["--device", "cuda:0"], "CUDA"),
    (["--config", "{tmp}/missing.toml"], "config file not found"),
])
def test_bad_training_input_gives_one_line(tmp_path, args, msg, monkeypatch):
    if "cuda" in " ".join(args) and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    import dataclasses

    from flatfl.data import download

    # nothing may leave the machine: an unreachable local address stands in for the dataset host
    monkeypatch.setitem(download.ARCHIVES, "cifar10",
                        dataclasses.replace(download.ARCHIVES["cifar10"], url="http://127.0.0.1:9/cifar-10-python.tar.gz"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = tmp_path / "run"
    lines = _bad(["train", *FAST, "--rounds", "1", "--out", str(out), *args], tmp_path)
    assert len(lines) == 1 and msg.lower() in lines[0].lower(), lines
    assert not (out / "final.pt").exists()


def test_corrupt_and_foreign_checkpoints(tmp_path):
    out = tmp_path / "run"
    assert _train(tmp_path, "--rounds", "1", "--out", str(out)).exit_code == 0
    data = (out / "final.pt").read_bytes()
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        flatfl.load_checkpoint(trunc)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(CheckpointError, match="not a flatfl checkpoint"):
        flatfl.load_checkpoint(foreign)
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(CheckpointError):
        flatfl.load_checkpoint(text)
    # the right file with the wrong architecture: its spec's digest gives it away
    payload = torch.load(out / "final.pt", weights_only=True)
    payload["model_spec"] = {"name": "mlp", "kwargs": {"num_classes": 10, "in_channels": 1, "image_size": 8}}
    wrong = tmp_path / "wrong.pt"
    torch.save(payload, wrong)
    with pytest.raises(CheckpointError, match="model_spec was changed after training"):
        flatfl.load_checkpoint(wrong)
    # and weights that do not fit the network given
    with pytest.raises(CheckpointError, match="do not fit"):
        flatfl.load_checkpoint(out / "final.pt", model=torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3)))


def test_resume_on_a_non_run_and_existing_out(tmp_path):
    (tmp_path / "empty").mkdir()
    lines = _bad(["train", "--resume", str(tmp_path / "empty")], tmp_path)
    assert len(lines) == 1 and "not a flatfl run" in lines[0]
    out = tmp_path / "run"
    assert _train(tmp_path, "--rounds", "1", "--out", str(out)).exit_code == 0
    lines = _bad(["train", *FAST, "--rounds", "1", "--out", str(out)], tmp_path)
    assert len(lines) == 1 and "already exists" in lines[0]


def test_divergence_stops_with_round_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    # an absurd learning rate from round 3 on (a resume refuses edited settings, so it is injected in-process)
    from flatfl.train import engine

    orig = engine.Trainer.run_round

    def diverging(self, r):
        if r == 2:
            self.cfg.lr, self.cfg.clip = 1e30, 0.0
        return orig(self, r)

    monkeypatch.setattr(engine.Trainer, "run_round", diverging)
    lines = _bad(["train", *FAST, "--rounds", "5", "--checkpoint-every", "1", "--out", str(out), "--quiet"], tmp_path)
    assert len(lines) == 1 and "non-finite" in lines[0] and "round 3" in lines[0], lines
    assert "round_0002.pt" in lines[0]
    assert not (out / "final.pt").exists() or flatfl.load_checkpoint(out / "final.pt").round == 2
    assert flatfl.load_checkpoint(out / "checkpoints" / "round_0002.pt").round == 2


def test_same_command_same_numbers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(tmp_path, "--rounds", "2", "--out", str(a)).exit_code == 0
    assert _train(tmp_path, "--rounds", "2", "--out", str(b)).exit_code == 0
    assert _same_state(_sd(a / "final.pt"), _sd(b / "final.pt"))
    c = tmp_path / "c"
    assert _train(tmp_path, "--rounds", "2", "--seed", "1", "--out", str(c)).exit_code == 0
    assert not _same_state(_sd(a / "final.pt"), _sd(c / "final.pt"))


def test_config_records_threads_and_library_versions(tmp_path):
    """What "same numbers" depends on besides the settings is in every run's config.json."""
    import json
    import platform

    out = tmp_path / "run"
    assert _train(tmp_path, "--rounds", "1", "--threads", "1", "--out", str(out)).exit_code == 0
    data = json.loads((out / "config.json").read_text())
    env = data["environment"]
    assert env["torch_threads"] == 1 == data["config"]["threads"]
    assert (env["torch"], env["numpy"], env["python"], env["flatfl"]) == \
        (torch.__version__, np.__version__, platform.python_version(), flatfl.__version__)
    assert isinstance(env["torch_interop_threads"], int) and env["torch_interop_threads"] >= 1
