"""Own data and own networks: the README's snippet run as written (extracted from README.md), then
``flatfl hessian`` on its checkpoint through the CLI, checked against a dense Hessian of the user's network."""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dense import dense_hessian
import flatfl
from flatfl.cli import main
from flatfl.train.config import RunConfig
from flatfl.errors import FlatflError
from flatfl.train.engine import Trainer

ROOT = Path(__file__).resolve().parents[1]


def readme_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def block_starting(lang: str, first_line: str) -> str:
    found = [b for b in readme_blocks(lang) if b.startswith(first_line)]
    assert len(found) == 1, f"README.md must hold one {lang} block starting {first_line!r}"
    return found[0]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def run_readme_blocks(folder: Path) -> str:
    """Run the README's two Python blocks as written, in ``folder`` (empty); returns what the snippet printed."""
    (folder / "my_models.py").write_text(block_starting("python", "# my_models.py"))
    snippet = block_starting("python", "# training from Python, on your own data")
    (folder / "snippet.py").write_text(snippet + "\nprint('FINAL', final)\nprint('ACC', ckpt.model is not None)\n")
    r = subprocess.run([sys.executable, "snippet.py"], cwd=folder, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own")
    return folder, run_readme_blocks(folder)


def test_readme_snippet_run_twice_prints_the_same_numbers(readme_run, tmp_path):
    # the network's initial weights come from the run's seed: a second execution (another process, another
    # folder) trains the same model and prints the same test accuracy; every metric but the timing is equal
    folder, first = readme_run
    second = run_readme_blocks(tmp_path)
    printed = [ln for ln in first.splitlines() if ln.startswith("test accuracy")]
    assert len(printed) == 1 and printed == [ln for ln in second.splitlines() if ln.startswith("test accuracy")]

    def metrics(run):
        rows = list(csv.DictReader((run / "runs" / "own" / "metrics.csv").open()))
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    assert len(metrics(folder)) == 20 and metrics(folder) == metrics(tmp_path)
    a = torch.load(folder / "runs/own/final.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "runs/own/final.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_readme_snippet_trains_and_loads_the_custom_network(readme_run):
    folder, stdout = readme_run
    run = folder / "runs" / "own"
    assert f"FINAL {Path('runs/own/final.pt')}" in stdout
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["name"] == "custom" and saved["model"]["factory"] == "my_models:my_net"
    assert saved["model"]["class"] == "torch.nn.modules.container.Sequential"
    assert saved["dataset"]["custom"] and saved["dataset"]["file"] == "data.pt"
    payload = torch.load(run / "final.pt", weights_only=True)
    assert payload["model_spec"]["factory"] == "my_models:my_net" and payload["dataset"]["custom"]

    # load_checkpoint(path, model=net) puts the trained weights into the user's network; its test accuracy on the
    # user's own tensors (rebuilt here as the snippet built them) equals the run's last recorded test accuracy
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    ckpt = flatfl.load_checkpoint(run, model=net)
    assert ckpt.model is net and torch.equal(net[1].weight, payload["state_dict"]["1.weight"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) > x[:, 0, 4:].mean((1, 2))).long()
    with torch.no_grad():
        acc = float((net(x[800:]).argmax(1) == y[800:]).float().mean())
    last = list(csv.DictReader((run / "metrics.csv").open()))[-1]
    assert acc == pytest.approx(float(last["test_acc"]), abs=1e-6)
    assert acc > 0.7  # the task is learnable: well above chance (0.5)


def test_flatfl_hessian_on_the_custom_checkpoint_matches_a_dense_hessian(readme_run):
    folder, _ = readme_run
    commands = [ln for ln in block_starting("bash", "flatfl hessian runs/own").splitlines() if ln.strip()]
    assert len(commands) == 2
    results = []
    for line in commands:
        args = shlex.split(line.split("#")[0])
        assert args[0] == "flatfl"
        r = subprocess.run([sys.executable, "-m", "flatfl", *args[1:], "--quiet"], cwd=folder, env=env(),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out = folder / args[args.index("--out") + 1]
        assert str(out.relative_to(folder) / "hessian.json") in r.stdout.strip().splitlines()[-1]
        results.append(json.loads((out / "hessian.json").read_text()))

    # independent truth: the dense Hessian of the mean cross-entropy of the user's network over the training split
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) > x[:, 0, 4:].mean((1, 2))).long()
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    flatfl.load_checkpoint(folder / "runs" / "own", model=net)
    dense = dense_hessian(net.double(), x[:800].double(), y[:800])
    top = np.linalg.eigvalsh(dense)[::-1]
    for rep in results:
        assert rep["num_samples"] == 800 and rep["num_params"] == dense.shape[0] == 2146
    assert results[0]["top_eigenvalues"] == pytest.approx(top[:5], rel=1e-3)
    assert results[1]["top_eigenvalues"][0] == pytest.approx(top[0], rel=1e-3)


def test_custom_network_without_factory_is_one_clear_line(tmp_path):
    cfg = RunConfig(rounds=1, clients=2).validate()
    x = torch.rand(60, 1, 8, 8)
    y = torch.arange(60) % 3
    final = Trainer(cfg, tmp_path / "r", dataset=TensorDataset(x, y), quiet=True,
                    model=nn.Sequential(nn.Flatten(), nn.Linear(64, 3))).run()
    with pytest.raises(FlatflError, match="custom network .*Sequential.*model=net.*--model-factory"):
        flatfl.load_checkpoint(final)
    r = CliRunner().invoke(main, ["hessian", str(final), "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--model-factory module:function" in r.output
    r = CliRunner().invoke(main, ["hessian", str(final), "--model-factory", "nope", "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "must be 'module:function'" in r.output and r.output.count("\n") == 1
    r = CliRunner().invoke(main, ["hessian", str(final), "--model-factory", "no_such_module_x:f",
                                  "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "cannot import 'no_such_module_x'" in r.output
    assert not (tmp_path / "h").exists()
    # a wrong architecture: the weights do not fit, one line
    with pytest.raises(FlatflError, match="weights do not fit the given Sequential"):
        flatfl.load_checkpoint(final, model=nn.Sequential(nn.Flatten(), nn.Linear(64, 4)))
    # resuming a custom-network run without a factory says how to do it instead of training another model
    r = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / "r")])
    assert r.exit_code == 2 and "resume it from Python" in r.output


class PairDataset(Dataset):
    """A map-style dataset of (numpy uint8 image, int label): no tensors attribute, no flatfl fields."""

    def __init__(self, n, seed):
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 4, size=n)
        self.images = (rng.random((n, 3, 8, 8)) * 60 + self.labels[:, None, None, None] * 60).astype(np.uint8)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def test_map_style_dataset_with_a_registry_model_then_hessian_cli(tmp_path):
    ds = PairDataset(200, 0)
    cfg = RunConfig(model="tiny", rounds=2, clients=3, batch_size=20).validate()
    final = Trainer(cfg, tmp_path / "r", dataset=ds, quiet=True).run()  # no test set: 20% of each class held out
    ckpt = flatfl.load_checkpoint(final)
    data = ckpt.dataset()
    assert data.num_classes == 4 and len(data.train_y) + len(data.test_y) == 200
    assert len(data.test_y) == sum(int((ds.labels == c).sum()) // 5 for c in range(4))
    # the uint8 images are scaled and standardised with the training split's per-channel statistics
    tr = torch.as_tensor(ds.images).float() / 255
    assert data.mean[0] == pytest.approx(float(data.train_x[:, 0].float().mean() / 255), rel=1e-5)
    assert min(data.mean) > float(tr.mean()) * 0.5
    r = CliRunner().invoke(main, ["hessian", str(final), "--trace-hvps", "10", "--quiet", "--out",
                                  str(tmp_path / "h")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "h" / "hessian.json").read_text())["num_samples"] == len(data.train_y)


def test_bad_datasets_are_one_line():
    cfg = RunConfig(rounds=1, clients=2).validate()
    with pytest.raises(FlatflError, match="one integer label per input"):
        Trainer(cfg, "unused", dataset=(torch.rand(10, 1, 8, 8), torch.zeros(9)))
    with pytest.raises(FlatflError, match="map-style dataset of \\(image, label\\)"):
        Trainer(cfg, "unused", dataset=object())
    with pytest.raises(FlatflError, match="class indices"):
        Trainer(cfg, "unused", dataset=TensorDataset(torch.rand(10, 1, 8, 8), torch.rand(10)))


def test_surface_and_resume_of_the_custom_run_use_the_recorded_factory_and_data(readme_run):
    folder, _ = readme_run
    r = subprocess.run([sys.executable, "-m", "flatfl", "surface", "runs/own", "--grid", "3", "--samples", "64",
                        "--quiet", "--out", "runs/own/surface"], cwd=folder, env=env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads((folder / "runs/own/surface/surface.json").read_text())
    assert s["num_samples"] == 64 and s["num_params"] == 2146
    # resuming a finished custom run from the command line rebuilds the network (factory) and data (data.pt)
    r = subprocess.run([sys.executable, "-m", "flatfl", "train", "--resume", "runs/own"], cwd=folder, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "already finished" in r.stderr and r.stdout.strip().endswith("runs/own/final.pt")


NETDEF = "from torch import nn\n\n\ndef cnn():\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, 3))\n"


def test_a_factory_in_another_folder_is_named_by_its_file(tmp_path, monkeypatch):
    """From a folder that does not hold the factory's module, the refusal and the import error both say how to
    name its file (``--model-factory PATH/netdef.py:cnn``), and that form loads it; a file named by the run itself
    is imported only inside the current directory."""
    names = ("netdef_i40", "netdef_i40b")
    saved_path = list(sys.path)

    def forget():  # each command as in a fresh process: no module of the factory cached, sys.path as it was
        for n in names:
            sys.modules.pop(n, None)
        sys.path[:] = saved_path

    def hessian(*argv):
        forget()
        r = CliRunner().invoke(main, ["hessian", *argv, "--top", "1", "--no-trace", "--quiet"])
        forget()
        return r

    a, b = tmp_path / "a", tmp_path / "b"
    (a / "nets").mkdir(parents=True)
    b.mkdir()
    (a / "netdef_i40.py").write_text(NETDEF)
    (a / "nets" / "netdef_i40b.py").write_text(NETDEF)
    cfg = RunConfig(rounds=1, clients=2).validate()
    data = TensorDataset(torch.rand(60, 1, 8, 8), torch.arange(60) % 3)
    monkeypatch.chdir(a)
    try:
        Trainer(cfg, "runs/r", dataset=data, quiet=True, model_factory="netdef_i40:cnn").run()
        forget()
        Trainer(cfg, "runs/f", dataset=data, quiet=True, model_factory="nets/netdef_i40b.py:cnn").run()
        forget()
        r = hessian("runs/r", "--out", "h")  # the recorded factory, from its own folder
        assert r.exit_code == 0, r.output
        top = json.loads((a / "h" / "hessian.json").read_text())["top_eigenvalues"]
        r = hessian("runs/f", "--out", "hf")  # a recorded file inside the current directory
        assert r.exit_code == 0, r.output

        monkeypatch.chdir(b)
        r = hessian("../a/runs/r", "--out", "h")
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
        assert "--model-factory netdef_i40:cnn" in r.output and "--model-factory PATH/netdef_i40.py:cnn" in r.output
        r = hessian("../a/runs/r", "--model-factory", "netdef_i40:cnn", "--out", "h")
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
        assert "cannot import 'netdef_i40'" in r.output and "--model-factory PATH/netdef_i40.py:cnn" in r.output
        r = hessian("../a/runs/r", "--model-factory", "../a/netdef_i40.py:cnn", "--out", "h")
        assert r.exit_code == 0, r.output
        assert json.loads((b / "h" / "hessian.json").read_text())["top_eigenvalues"] == top
        r = hessian("../a/runs/r", "--model-factory", "../a/missing.py:cnn", "--out", "h2")
        assert r.exit_code == 2 and "no file ../a/missing.py" in r.output
        # a file the run recorded, outside the current directory: refused, never imported
        r = hessian("../a/runs/f", "--out", "hf")
        assert r.exit_code == 2 and "not in the current directory" in r.output
        assert "--model-factory nets/netdef_i40b.py:cnn" in r.output and "netdef_i40b" not in sys.modules
        assert not (b / "hf").exists() and not (b / "h2").exists()
    finally:
        forget()


def test_data_pt_is_tied_to_its_run_by_a_digest(tmp_path):
    """A run's data.pt is recorded by its sha256 (config.json and every checkpoint); analysing or resuming the run
    with another run's data.pt is one line naming both digests, and a run whose data.pt is gone never reads a
    parent folder's instead (one line: missing)."""
    import shutil

    from flatfl.checkpoint import own_data_sha256

    cfg = RunConfig(model="tiny", rounds=1, clients=2, batch_size=20, checkpoint_every=1).validate()
    runs = {}
    for seed in (0, 1):
        run = tmp_path / "runs" / f"r{seed}"
        Trainer(cfg, run, dataset=PairDataset(80, seed), quiet=True).run()
        runs[seed] = run
    saved = torch.load(runs[0] / "data.pt", weights_only=True)
    recorded = json.loads((runs[0] / "config.json").read_text())["dataset"]["sha256"]
    assert recorded == own_data_sha256(saved)
    assert torch.load(runs[0] / "final.pt", weights_only=True)["dataset"]["sha256"] == recorded
    assert recorded != json.loads((runs[1] / "config.json").read_text())["dataset"]["sha256"]
    round_ckpt = runs[0] / "checkpoints" / "round_0001.pt"
    assert flatfl.load_checkpoint(round_ckpt).dataset().num_classes == 4  # a round checkpoint: the run's data.pt

    def one_line(argv, fragment):
        r = CliRunner().invoke(main, argv)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and fragment in lines[0], r.output
        assert "Traceback" not in r.output
        return lines[0]

    shutil.copy(runs[1] / "data.pt", runs[0] / "data.pt")  # another run's data
    line = one_line(["hessian", str(runs[0] / "final.pt"), "--quiet", "--out", str(tmp_path / "h")],
                    "is not the data")
    assert recorded[:12] in line
    one_line(["train", "--resume", str(runs[0]), "--quiet"], "is not the data")
    (runs[0] / "data.pt").unlink()  # gone; the folder above holds a data.pt of another run
    shutil.copy(runs[1] / "data.pt", tmp_path / "runs" / "data.pt")
    shutil.copy(runs[1] / "data.pt", runs[0] / "checkpoints" / "data.pt")
    one_line(["hessian", str(runs[0] / "final.pt"), "--quiet", "--out", str(tmp_path / "h")], "is missing")
    one_line(["hessian", str(round_ckpt), "--quiet", "--out", str(tmp_path / "h")], "is missing")
    assert not (tmp_path / "h").exists()


def test_data_over_the_size_limit_is_recorded_by_its_digest_and_checked_on_resume(tmp_path, monkeypatch):
    """Data too large to save with its run (the limit lowered here) still records its sha256: the report tells two
    such data sets apart, and data given again to a resumed run must be the data it trained on."""
    from flatfl.checkpoint import dataset_sha256
    from flatfl.data.datasets import as_image_dataset
    from flatfl.errors import ConfigError
    from flatfl.train import run_folder
    from flatfl.train.identity import data_identity

    monkeypatch.setattr(run_folder, "CUSTOM_DATA_LIMIT_BYTES", 1024)
    cfg = RunConfig(model="tiny", rounds=1, clients=2, batch_size=20).validate()
    Trainer(cfg, tmp_path / "r", dataset=PairDataset(80, 0), quiet=True).run()
    info = json.loads((tmp_path / "r" / "config.json").read_text())["dataset"]
    assert info["file"] is None and not (tmp_path / "r" / "data.pt").exists()
    assert info["sha256"] == dataset_sha256(as_image_dataset(PairDataset(80, 0)))
    other = dataset_sha256(as_image_dataset(PairDataset(80, 1)))
    assert data_identity(info)["data_sha256"] != data_identity(dict(info, sha256=other))["data_sha256"]
    with pytest.raises(ConfigError, match="the data given is not the data the run trained on"):
        Trainer(cfg, tmp_path / "r", dataset=PairDataset(80, 1), resume=True, quiet=True)
    Trainer(cfg, tmp_path / "r", dataset=PairDataset(80, 0), resume=True, quiet=True)  # its own data: accepted
