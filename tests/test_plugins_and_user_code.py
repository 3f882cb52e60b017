"""Plug-ins and user code cannot take flatfl down (docs/reliability.md, "Plug-ins and your own code").

* estimator plug-ins (entry-point group ``flatfl.estimators``) load only when an estimator's name is looked up
  that the built-ins do not hold, and one at a time: a broken one (missing module, import error, sys.exit while
  imported, a name already taken, an unknown kind) is skipped with one warning naming its distribution and entry
  point, and every command still works;
* a result that is not finite, from any estimator, is refused in one line;
* sys.exit called by the user's code (a loss) is one line naming it and a non-zero exit, never 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import flatfl
from flatfl.cli import main
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(flatfl.__file__).resolve().parent.parent

PLUGIN = '''
import sys
import numpy as np
from flatfl.analysis.estimators.registry import Estimator, register_estimator

def exits():
    sys.exit(0)

def registers_then_fails():
    register_estimator("half-done", "eigenvalues", "plugmod:nan_top")
    raise RuntimeError("second half broken")

def replaces_lanczos():
    register_estimator("lanczos", "eigenvalues", "plugmod:nan_top", replace=True)

dup = Estimator("lanczos", "eigenvalues", "plugmod:nan_top")
badkind = Estimator("x", "hessians", "plugmod:nan_top")
good = [Estimator("nan-top", "eigenvalues", "plugmod:nan_top")]

def nan_top(op, k, *, tol, seed, return_vectors, exact_residuals):
    from flatfl.analysis import EigenResult
    return EigenResult(eigenvalues=np.full(k, np.nan), residuals=np.zeros(k), converged=np.ones(k, bool), hvps=1,
                       method="nan-top")
'''

POINTS = {"missing": "no_such_module_xyz:thing", "exits": "plugmod:exits", "dup": "plugmod:dup",
          "badkind": "plugmod:badkind", "partial": "plugmod:registers_then_fails", "good": "plugmod:good",
          "replaces": "plugmod:replaces_lanczos"}


@pytest.fixture
def plugins(tmp_path) -> Path:
    """A folder holding an installed distribution 'brokenplug' (its dist-info) whose entry points are
    :data:`POINTS`, and its module; returned to be put on PYTHONPATH / sys.path."""
    where = tmp_path / "site"
    info = where / "brokenplug-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flatfl.estimators]\n" + "".join(f"{k} = {v}\n" for k, v in POINTS.items()))
    (where / "plugmod.py").write_text(textwrap.dedent(PLUGIN))
    return where


def flatfl_cli(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flatfl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_broken_plugins_are_one_warning_each_and_every_command_works(plugins, tmp_path):
    version = flatfl_cli(plugins, "--version", cwd=tmp_path)
    assert version.returncode == 0 and "version" in version.stdout and version.stderr == ""  # nothing loaded
    helped = flatfl_cli(plugins, "hessian", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    # the good one is offered; 'half-done', registered by a plug-in that failed after, was taken back with it
    assert "lanczos | power | nan-top (power" in " ".join(helped.stdout.split())
    warnings = helped.stderr.strip().splitlines()
    assert len(warnings) == 6, warnings  # one per broken entry point, none for the good one
    for line, name in zip(warnings, ("missing", "exits", "dup", "badkind", "partial", "replaces")):
        assert line.startswith(f"flatfl: warning: the estimator plug-in {name} = {POINTS[name]} of the "
                               "distribution brokenplug 0.1"), line
    assert "second half broken" in warnings[4] and "sys.exit(0)" in warnings[1] and "'hessians'" in warnings[3]
    # a taken name: the one rule of docs/analysis.md, refused whether the plug-in asks to replace it or not
    taken = "an eigenvalue method called 'lanczos' is already registered (a plug-in cannot replace it)"
    assert warnings[2].endswith(taken) and warnings[5].endswith(taken), warnings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("plugins") / "run") / "final.pt"


def test_a_non_finite_estimate_is_refused(checkpoint, tmp_path):
    from flatfl.analysis.estimators.registry import register_estimator, unregister_estimator
    import numpy as np
    from flatfl.analysis import EigenResult

    def nan_top(op, k, *, tol, seed, return_vectors, exact_residuals):
        return EigenResult(eigenvalues=np.full(k, np.nan), residuals=np.zeros(k), converged=np.ones(k, bool),
                           hvps=1, method="nan-top")

    register_estimator("nan-top", "eigenvalues", nan_top)
    try:
        out = tmp_path / "h"
        r = CliRunner().invoke(main, ["hessian", str(checkpoint), "--method", "nan-top", "--samples", "32",
                                      "--no-trace", "--quiet", "--out", str(out)])
    finally:
        unregister_estimator("nan-top", "eigenvalues")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "'nan-top'" in r.output and "not finite" in r.output
    assert not (out / "hessian.json").exists()


def test_sys_exit_in_a_loss_is_one_line_naming_it_never_exit_0(checkpoint, tmp_path):
    (tmp_path / "exiting_loss.py").write_text("import sys\n\ndef loss(model, batch):\n    sys.exit(0)\n")
    r = subprocess.run([sys.executable, "-m", "flatfl", "hessian", str(checkpoint), "--loss",
                        "exiting_loss.py:loss", "--samples", "32", "--no-trace", "--quiet", "--out",
                        str(tmp_path / "h")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "exiting_loss.py" in lines[0] and "sys.exit(0)" in lines[0], lines


# ----- user functions checked where they enter -----
LOSSES = '''
import torch
import torch.nn.functional as F

class Criterion:
    def __init__(self, model, batch):
        pass

def one_argument(model):
    return 0.0

def detached(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y).detach()

def integer(model, batch):
    return torch.tensor(3)

def raises(model, batch):
    raise ValueError("my own bug")

def changes_weights(model, batch):
    x, y = batch
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    return F.cross_entropy(model(x), y)
'''


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> Path:
    """The losses' file, written once (imported once by its name, as --loss imports it)."""
    path = tmp_path_factory.mktemp("losses") / "user_losses_checked.py"
    path.write_text(LOSSES)
    return path


@pytest.mark.parametrize("name, words", [
    ("Criterion", "Criterion is a class"),
    ("one_argument", "one_argument(model) cannot take those two arguments"),
    ("detached", "no graph to the parameters"),
    ("integer", "torch.int64 tensor (3)"),
    ("raises", "raised ValueError: my own bug on batch 0 (in raises ("),
    ("changes_weights", "the model's weights changed during the analysis"),
])
def test_a_loss_that_is_not_one_is_one_line_naming_it(checkpoint, losses, tmp_path, name, words):
    out = tmp_path / "h"
    r = CliRunner().invoke(main, ["hessian", str(checkpoint), "--loss", f"{losses}:{name}", "--samples", "32",
                                  "--no-trace", "--quiet", "--out", str(out)])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert words in r.output and "internal error" not in r.output and "invalid data" not in r.output
    assert not (out / "hessian.json").exists()


def test_own_networks_returning_a_dict_or_with_nothing_to_train_are_refused_before_training(tmp_path):
    from torch import nn

    from combinations import case_data
    from flatfl.errors import ConfigError
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            return {"logits": self.fc(x.flatten(1))}

    frozen = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).requires_grad_(False)
    cfg = RunConfig(model="mlp", clients=2, rounds=1, batch_size=8, seed=0).validate()
    for net, words in ((DictOut(), "returns a dict with keys 'logits'"), (frozen, "no trainable parameter")):
        with pytest.raises(ConfigError, match=words):
            Trainer(cfg, tmp_path / "run", quiet=True, dataset=case_data(8), model=net)


def test_a_zero_element_parameter_is_an_empty_block_and_the_others_unchanged():
    import torch
    from torch import nn

    from flatfl.analysis import hessian

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()

    class WithEmpty(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = plain
            self.empty = nn.Parameter(torch.zeros(0, dtype=torch.float64))

        def forward(self, x):
            return self.net(x) + self.empty.sum()

    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    mine = hessian(WithEmpty(), data=(x, y)).per_layer(2, dense_up_to=100)
    truth = hessian(plain, data=(x, y)).per_layer(2, dense_up_to=100)
    empty, *rest = mine.blocks
    assert (empty.module, empty.dim, empty.trace, len(empty.eigenvalues)) == ("(model)", 0, 0.0, 0)
    for a, b in zip(rest, truth.blocks):
        assert a.module == "net." + b.module and a.dim == b.dim
        assert abs(a.trace - b.trace) <= 1e-12 * abs(b.trace)
        assert max(abs(a.eigenvalues - b.eigenvalues)) <= 1e-12 * max(abs(b.eigenvalues))


# ----- the Python API -----
def test_the_python_api_refuses_16_bit_models_bad_tolerances_and_endless_loaders(monkeypatch):
    import itertools

    import torch
    from torch import nn

    from flatfl.analysis.operators import batches as batches_module
    from flatfl.analysis import hessian
    from flatfl.errors import ConfigError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    with pytest.raises(ConfigError, match="torch.bfloat16: Hessian products in 16-bit"):
        hessian(nn.Sequential(nn.Linear(4, 2)).bfloat16(), data=(x.bfloat16(), y))
    h = hessian(model, data=(x, y))
    for tol in (float("inf"), float("nan"), 0.0, -1e-3):
        with pytest.raises(ConfigError, match="tol must be positive and finite"):
            h.eigenvalues(tol=tol)
        with pytest.raises(ConfigError, match="tol must be positive and finite"):
            h.trace(tol=tol)
    with pytest.raises(ConfigError, match=r"rtol must be positive and finite \(a number\) or None"):
        h.trace_estimate(rtol=float("inf"))

    def endless():
        while True:
            yield x, y

    monkeypatch.setattr(batches_module, "MAX_UNSIZED_BATCHES", 5)
    with pytest.raises(ConfigError, match="no length and yielded more than 5 batches"):
        hessian(model, dataloader=endless())
    bounded = hessian(model, dataloader=itertools.islice(endless(), 5))  # 5 copies of the batch: its Hessian
    assert bounded.num_samples == 80
    assert abs(bounded.eigenvalues()[0][0] - h.eigenvalues()[0][0]) <= 1e-5 * abs(h.eigenvalues()[0][0])


# ----- outputs: a folder's identity includes every setting that changes its content -----
def test_a_reproduction_of_another_model_never_writes_into_the_default_models_report(tmp_path, monkeypatch):
    import json

    import flatfl.reproduce as rep

    monkeypatch.setattr(rep, "REPORTS_DIR", tmp_path / "reports")
    default = rep.default_out("man-tables", "tiny")
    assert default.name == "man-tables-tiny"
    assert rep.default_out("man-tables", "tiny", model="clients-average") == default  # the tables' own model
    assert rep.default_out("man-tables", "tiny", model="server").name == "man-tables-tiny-model-server"
    assert rep.default_out("man-tables", "tiny", model="server", track_hessian=5).name == \
        "man-tables-tiny-model-server-track5"
    assert rep.default_out("man-tables", "tiny", "FedAvg", model="server").name == "man-tables-tiny-fedavg-model-server"
    # an explicit --out holding the same runs' report of the tables' model: refused before any run trains
    runs = tmp_path / "runs"
    names = [t.name for t in rep.plan(rep.Selection("man-tables", "tiny"), runs_dir=runs)]
    default.mkdir(parents=True)
    (default / "summary.json").write_text(json.dumps({"runs": len(names), "models": {
        "man-table2": "clients-average", "man-table6": "clients-average"}}))
    (default / "runs.csv").write_text("run,method\n" + "".join(f"{n},x\n" for n in names))
    before = {p.name: p.read_bytes() for p in default.iterdir()}
    r = CliRunner().invoke(main, ["reproduce", "man-tables", "--preset", "tiny", "--runs-dir", str(runs), "--threads",
                                  "1", "--workers", "1", "--model", "server", "--out", str(default)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "measuring the clients-average model; this reproduction measures the server model" in r.stderr
    assert not runs.exists() and {p.name: p.read_bytes() for p in default.iterdir()} == before


def test_gpu_check_refuses_an_out_it_cannot_create_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("mine\n")
    out = tmp_path / "a-file" / "check"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [f"gpu_check: error: --out {out} cannot be used: Not a directory"]
    assert (tmp_path / "a-file").read_text() == "mine\n"


# ----- an option's check at the command line is the one the computation needs -----
@pytest.mark.parametrize("flags, need", [((), 2), (("--trace-method", "hutchinson", "--per-layer"), 2),
                                         (("--trace-method", "hutchinson"), 1), (("--no-trace",), 1)])
def test_trace_hvps_is_checked_against_what_the_estimators_need(flags, need):
    from flatfl.errors import ConfigError
    from flatfl.analysis.commands.hessian_settings import HessianSettings

    method = flags[1] if flags[:1] == ("--trace-method",) else None
    settings = dict(trace_method=method, per_layer="--per-layer" in flags, trace="--no-trace" not in flags)
    HessianSettings(trace_hvps=need, **settings).validate()
    with pytest.raises(ConfigError, match=rf"^--trace-hvps must be >= {need}\b"):
        HessianSettings(trace_hvps=need - 1, **settings).validate()


def test_the_smallest_trace_budget_the_check_admits_runs(checkpoint, tmp_path):
    r = CliRunner().invoke(main, ["hessian", str(checkpoint), "--trace-hvps", "2", "--per-layer", "--samples", "32",
                                  "--quiet", "--out", str(tmp_path / "h")])
    assert r.exit_code == 0, r.output


# ----- MAN records the modules it hooked -----
def test_man_on_an_own_network_records_the_modules_it_hooked_in_config_json(tmp_path):
    import json

    import torch

    from combinations import CASE_SEED, GeluLayerNormResidual, case_data
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    torch.manual_seed(CASE_SEED)
    net = GeluLayerNormResidual()  # GELUs act0 (input), act1 (residual branch), act (before the classifier)
    cfg = RunConfig(model="mlp", reg="man", clients=2, rounds=1, batch_size=16, seed=0).validate()
    Trainer(cfg, tmp_path / "run", quiet=True, dataset=case_data(8), model=net).run()
    record = json.loads((tmp_path / "run" / "config.json").read_text())["regularizer"]
    assert record == {"hooked_modules": ["act0", "act1", "act"],
                      "chosen_by": "the non-linearity modules before the final linear layer"}


# ----- progress with the time left -----
def test_each_phases_bound_holds_what_the_phase_spent(checkpoint, tmp_path):
    """The bar's total is the products left at most: every phase of a real run spends no more than its bound."""
    import json

    from flatfl.analysis.commands.progress import phase_bounds
    from flatfl.analysis.commands.hessian_settings import HessianSettings

    args = ["--top", "3", "--smallest", "2", "--per-layer", "--density", "--density-steps", "20", "--trace-hvps",
            "30", "--trace-rtol", "1e-9", "--measure", "frobenius"]
    r = CliRunner().invoke(main, ["hessian", str(checkpoint), *args, "--samples", "64", "--quiet", "--out",
                                  str(tmp_path / "h")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "h" / "hessian.json").read_text())
    blocks = report["per_layer"]["blocks"]
    settings = HessianSettings(top=3, smallest=2, per_layer=True, density=True, density_steps=20, trace_hvps=30,
                               trace_rtol=1e-9, measure="frobenius")
    bounds = dict(phase_bounds(settings, report["num_params"], [b["dim"] for b in blocks]))
    spent = {"top eigenvalues": report["eigen"]["hvps"],
             "smallest eigenvalues": report["smallest_eigenvalues"]["hvps"], "trace": report["trace"]["hvps"],
             "density": report["density"]["hvps"],
             **{f"per-layer block {i + 1}/{len(blocks)}": b["hvps"] for i, b in enumerate(blocks)},
             "squared Frobenius norm": report["quantities"]["frobenius"]["hvps"]}
    assert set(bounds) == set(spent) and all(spent[k] <= bounds[k] for k in spent), (spent, bounds)
    assert bounds["density"] == 20 * settings.density_starts and bounds["trace"] == 30
    assert spent["squared Frobenius norm"] == bounds["squared Frobenius norm"] == 30  # no target reached: the budget


def test_the_bar_total_is_the_products_left_at_most_tightened_at_each_phase():
    from flatfl.analysis.commands.progress import PhasedProgress

    class Bar:  # what PhasedProgress reads and sets of a tqdm bar
        n, total, description = 0, None, ""

        def update(self, k):
            self.n += k

        def set_description(self, text, refresh=True):
            self.description = text

        def refresh(self):
            pass

    bar = Bar()
    progress = PhasedProgress(bar, [("top eigenvalues", 660), ("trace", 100), ("density", 80)])
    progress.next_phase("top eigenvalues")
    assert bar.total == 840 and bar.description.startswith("top eigenvalues")
    progress.update(40)  # Lanczos converged after 40 of its 660
    progress.next_phase("trace")
    assert bar.total == 40 + 100 + 80
    progress.update(100)
    progress.next_phase("density")
    assert bar.total == 140 + 80
    unknown = PhasedProgress(Bar(), [("top eigenvalues", None), ("trace", 100)])  # a plug-in's phase: no total
    unknown.next_phase("top eigenvalues")
    assert unknown.bar.total is None
    unknown.next_phase("trace")
    assert unknown.bar.total == 100


def hessian_of_own_network(checkpoint, tmp_path, module: str, forward: str):
    """``flatfl hessian CHECKPOINT --model-factory FILE:net``, the factory building the checkpoint's tiny network
    with ``forward`` (the source of a function ``forward(self, x)``, ``plain`` the network's own) in its place."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent('''
        import sys, types
        from flatfl.models import build_model

        def net():
            model = build_model("tiny", num_classes=10, in_channels=1, image_size=8)
            plain = model.forward
        ''') + textwrap.indent(textwrap.dedent(forward), "    ") +
        "    model.forward = types.MethodType(forward, model)\n    return model\n")
    return CliRunner().invoke(main, ["hessian", str(checkpoint), "--model-factory", f"{tmp_path / module}.py:net",
                                     "--samples", "32", "--quiet", "--out", str(tmp_path / "h")])


def line_of(path: Path, text: str) -> int:
    """The number of the first line of ``path`` holding ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_sys_exit_in_an_own_networks_forward_is_one_line_naming_it(checkpoint, tmp_path):
    r = hessian_of_own_network(checkpoint, tmp_path, "exiting_network_59", "def forward(self, x):\n    sys.exit(0)\n")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    where = f"exiting_network_59.py:{line_of(tmp_path / 'exiting_network_59.py', 'sys.exit(0)')})"
    assert "forward (" in r.output and f"{where} called sys.exit(0)" in r.output


def test_an_own_network_returning_a_dict_is_one_line_for_the_criterion(checkpoint, tmp_path):
    r = hessian_of_own_network(checkpoint, tmp_path, "dict_network_59",
                               "def forward(self, x):\n    return {'logits': plain(x)}\n")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "the model returns a dict with keys 'logits', not a tensor" in r.output


def test_per_layer_results_of_other_weights_are_not_dropped(checkpoint, tmp_path):
    """A folder holding --per-layer results of one checkpoint: flatfl hessian of other weights without --per-layer
    is refused before any work, the files as they were; with --per-layer it replaces them."""
    other = train_tiny(tmp_path / "other", "--seed", "1") / "final.pt"
    out = tmp_path / "h"
    common = ["--samples", "32", "--trace-hvps", "20", "--quiet", "--out", str(out)]
    assert CliRunner().invoke(main, ["hessian", str(checkpoint), "--per-layer", *common]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = CliRunner().invoke(main, ["hessian", str(other), *common])
    assert r.exit_code == 2 and "holds per-layer results (per_layer.csv) of other weights" in r.output, r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert CliRunner().invoke(main, ["hessian", str(other), "--per-layer", *common]).exit_code == 0


def test_gpu_check_writes_a_relative_out_where_it_was_run(tmp_path):
    """--out relative to the folder gpu_check is run from (its parts run from the repository root)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--parts",
                           "hessian", "--out", "rel/check"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert {"gpu-check.md", "hessian.json", "hessian.log"} <= {p.name for p in (tmp_path / "rel" / "check").iterdir()}
    assert not (ROOT / "rel").exists()


def test_a_value_error_in_an_own_networks_forward_is_named_as_its_not_the_datas(checkpoint, tmp_path):
    r = hessian_of_own_network(checkpoint, tmp_path, "checking_network_59",
                               "def forward(self, x):\n    raise ValueError(\"my network's own check failed\")\n")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    where = f"checking_network_59.py:{line_of(tmp_path / 'checking_network_59.py', 'raise ValueError')})"
    assert "ValueError in your code, forward (" in r.output and f"{where}: my network's" in r.output
    assert "invalid data" not in r.output

def test_a_keyboard_interrupt_raised_in_a_loss_is_one_line_naming_it_exit_130(checkpoint, losses, tmp_path):
    keyboard = tmp_path / "interrupting_loss_59.py"
    keyboard.write_text("def loss(model, batch):\n    raise KeyboardInterrupt\n")
    r = CliRunner().invoke(main, ["hessian", str(checkpoint), "--loss", f"{keyboard}:loss", "--samples", "32",
                                  "--no-trace", "--quiet", "--out", str(tmp_path / "h")])
    assert r.exit_code == 130 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"flatfl: interrupted; in your code, loss ({keyboard}:2)")


def test_a_16_bit_model_given_to_the_operator_and_a_budget_below_the_estimators_are_one_line():
    """HessianOperator itself refuses a bfloat16 model (the API's check, one level down); a trace budget below what
    the estimator needs (Hutch++: 2 products) names max_hvps instead of failing deeper."""
    import torch
    from torch import nn

    from flatfl.analysis import HessianOperator, hessian
    from flatfl.errors import ConfigError

    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with pytest.raises(ConfigError, match="16-bit"):
        HessianOperator(nn.Linear(3, 2).to(torch.bfloat16), (x.to(torch.bfloat16), y))
    h = hessian(nn.Linear(3, 2), nn.CrossEntropyLoss(), data=(x, y))
    with pytest.raises(ConfigError, match="max_hvps of at least 2"):
        h.trace_estimate(max_hvps=1)
    assert h.trace_estimate(max_hvps=2, rtol=None).hvps <= 2


def test_an_own_network_that_changes_the_working_directory_writes_where_out_said(checkpoint, tmp_path, monkeypatch):
    """A network whose forward calls os.chdir(elsewhere) and turns gradients on at every call, --out relative:
    hessian.json lands where --out named from the starting folder, nothing elsewhere, the directory is the starting
    one afterwards and one notice names the network; the top eigenvalue is the plain network's."""
    from flatfl.utils import user_code

    monkeypatch.setattr(user_code, "NOTICES", set())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "moving_network_67.py").write_text(textwrap.dedent(f'''
        import os, types
        from flatfl.models import build_model

        def net():
            model = build_model("tiny", num_classes=10, in_channels=1, image_size=8)
            plain = model.forward

            def forward(self, x):
                os.chdir({str(elsewhere)!r})
                return plain(x)

            model.forward = types.MethodType(forward, model)
            return model
        '''))
    monkeypatch.chdir(tmp_path)
    common = ["--samples", "32", "--no-trace", "--quiet", "--threads", "1"]
    r = CliRunner().invoke(main, ["hessian", str(checkpoint), "--model-factory", "moving_network_67.py:net",
                                  *common, "--out", "h"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "h" / "hessian.json").is_file() and not (elsewhere / "h").exists()
    assert os.getcwd() == str(tmp_path)
    notices = [line for line in r.stderr.splitlines() if line.startswith("flatfl: notice:")]
    assert len(notices) == 1 and "the network of --model-factory moving_network_67.py:net changed the working " \
        "directory" in notices[0], r.stderr
    plain = CliRunner().invoke(main, ["hessian", str(checkpoint), *common, "--out", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    top = [json.loads((folder / "hessian.json").read_text())["top_eigenvalues"][0]
           for folder in (tmp_path / "h", tmp_path / "plain")]
    assert top[0] == pytest.approx(top[1], rel=1e-12)
