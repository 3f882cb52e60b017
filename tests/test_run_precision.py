"""``--precision float32|float64``: a run's floating type, applied to the model, the data, the algorithm's state and
every product, recorded with the machine; an analysis of a float64 run computes in float64; the CPU presets run in
float64 and the paper presets in float32; a run recorded without the setting ran in float32."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dense import dense_hessian
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.train.config import RunConfig
from flatfl.train.identity import experiment_settings, run_settings
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.utils.machine import cpu_model, machine_label
from flatfl.utils.precision import computing_in, gpu_precision_notice
from tiny_run import train_tiny


def _cpu_of_proc() -> str | None:
    """The first 'model name' of /proc/cpuinfo, read here independently of flatfl (None where there is none)."""
    try:
        lines = open("/proc/cpuinfo", encoding="utf-8").read().splitlines()
    except OSError:
        return None
    names = [line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == "model name"]
    return " ".join(names[0].split()) if names else None


@pytest.fixture(scope="module")
def run64(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("p64") / "run", "--precision", "float64", "--algo", "feddyn")


def test_a_float64_run_is_float64_throughout_and_records_precision_and_machine(run64):
    info = json.loads((run64 / "config.json").read_text())
    assert info["config"]["precision"] == "float64" and info["training_path"]["dtype"] == "float64"
    env = info["environment"]
    want = _cpu_of_proc()
    assert env["cpu"] == (want if want else env["cpu"]) and env["cpu"]
    assert env["blas"] and env["torch_build"].startswith(torch.__version__)
    final = torch.load(run64 / "final.pt", weights_only=True)
    assert {v.dtype for v in final["state_dict"].values() if v.is_floating_point()} == {torch.float64}
    resume = torch.load(run64 / "resume.pt", weights_only=True)
    assert resume["theta"].dtype == torch.float64
    # FedDyn's server state h and the clients' gradients: the algorithm's state in the run's type too
    assert all(v.dtype == torch.float64 for v in resume["algorithm"]["server"].values()
               if isinstance(v, torch.Tensor) and v.is_floating_point())
    assert torch.get_default_dtype() == torch.float32  # the run restored torch's default type


def test_an_analysis_of_a_float64_run_computes_in_float64(run64, tmp_path):
    """The top eigenvalue 'flatfl hessian' gives for the float64 run equals the dense float64 Hessian's to 1e-9
    (float32 products would agree to about 1e-6 only); hessian.json records the precision and the machine."""
    import flatfl

    r = CliRunner().invoke(main, ["hessian", str(run64), "--samples", "64", "--batch-size", "64", "--no-trace",
                                  "--tol", "1e-10", "--quiet", "--out", str(tmp_path / "h")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "h" / "hessian.json").read_text())
    assert report["precision"] == "float64" and report["settings"]["precision"] == "float64"
    assert report["machine"]["cpu"] == cpu_model()
    ckpt = flatfl.load_checkpoint(run64)
    assert ckpt.precision == "float64" and next(ckpt.model.parameters()).dtype == torch.float64
    (x, y), = ckpt.eval_batches("train", samples=64, batch_size=64, seed=0)
    assert x.dtype == torch.float64
    truth = np.linalg.eigvalsh(dense_hessian(ckpt.model, x, y)).max()
    assert abs(report["top_eigenvalues"][0] - truth) <= 1e-9 * abs(truth)
    # asked for float32, the same checkpoint is measured in float32
    as32 = flatfl.load_checkpoint(run64, precision="float32")
    assert next(as32.model.parameters()).dtype == torch.float32
    assert as32.eval_batches("train", samples=8, batch_size=8)[0][0].dtype == torch.float32


def test_the_default_is_float32_and_a_run_recorded_without_it_ran_in_float32(tmp_path):
    run = train_tiny(tmp_path / "run")
    info = json.loads((run / "config.json").read_text())
    assert info["config"]["precision"] == "float32" and info["training_path"]["dtype"] == "float32"
    old = {k: v for k, v in info["config"].items() if k != "precision"}  # config.json of an earlier version
    assert experiment_settings(old) == experiment_settings(info["config"])
    assert run_settings(old) == run_settings(info["config"])
    assert experiment_settings(dict(old, precision="float64")) != experiment_settings(old)
    import flatfl

    assert flatfl.load_checkpoint(run).precision == "float32"


def test_bad_precisions_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="--precision must be one of float32, float64, got 'double'"):
        RunConfig(precision="double").validate()
    with pytest.raises(ConfigError, match="--precision must be one of float32, float64"):
        HessianSettings(precision="half").validate()
    r = CliRunner().invoke(main, ["train", "--precision", "float16", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and "precision" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_float64_on_a_gpu_is_said_in_one_line():
    line = gpu_precision_notice("float64", torch.device("cuda", 0))
    assert line and "\n" not in line and "slow" in line
    assert gpu_precision_notice("float64", torch.device("cpu")) is None
    assert gpu_precision_notice("float32", torch.device("cuda", 0)) is None
    with pytest.raises(ConfigError, match="not available on mps"):
        gpu_precision_notice("float64", torch.device("mps"))


def test_computing_in_sets_and_restores_the_default_type():
    with computing_in("float64"):
        assert torch.zeros(1).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_the_cpu_presets_run_in_float64_and_the_paper_presets_in_float32(tmp_path):
    from flatfl.reproduce import RunOptions, Selection, plan

    def precisions(target, preset, precision=None):
        return {RunConfig(**{k: v for k, v in t.settings.items()}).validate().precision
                for t in plan(Selection(target, preset), RunOptions(precision=precision), runs_dir=tmp_path)}

    for target, preset in [("man-tables", "quick"), ("man-tables", "fmnist"), ("man-tables", "fmnist-cnn"),
                           ("sam-family", "quick"), ("fedalign-table1", "quick")]:
        assert precisions(target, preset) == {"float64"}, (target, preset)
    for target in ("man-tables", "sam-family", "fedalign-table1"):
        assert precisions(target, "paper") == {"float32"}, target
    assert precisions("man-tables", "quick", precision="float32") == {"float32"}
    with pytest.raises(ConfigError, match="--precision"):
        plan(Selection("man-tables", "quick"), RunOptions(precision="float16"), runs_dir=tmp_path)


def test_sweep_precision_sets_every_run_and_refuses_a_per_run_precision(tmp_path):
    from flatfl.sweep import read_grid

    grid = tmp_path / "grid.toml"
    grid.write_text('[fixed]\ndataset = "digits"\nrounds = 1\n[grid]\nalgo = ["fedavg", "feddyn"]\n')
    assert {t.settings.get("precision") for t in read_grid(grid).tasks} == {None}
    assert {t.settings["precision"] for t in read_grid(grid, precision="float64").tasks} == {"float64"}
    grid.write_text('[fixed]\ndataset = "digits"\n[grid]\nprecision = ["float32", "float64"]\n')
    assert {t.settings["precision"] for t in read_grid(grid).tasks} == {"float32", "float64"}
    with pytest.raises(ConfigError, match="sets the precision per run"):
        read_grid(grid, precision="float64")


def test_the_cpu_model_is_read_from_cpuinfo_and_shown_in_the_scale_line(tmp_path, run64):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Some  CPU 9000 @ 3.0GHz\n\nprocessor\t: 1\n"
                    "model name\t: Other\n")
    assert cpu_model(str(info)) == "Some CPU 9000 @ 3.0GHz"
    assert cpu_model(str(tmp_path / "missing"))  # platform's answer where there is no /proc/cpuinfo
    one = {"cpu": "A", "cpu_capability": "AVX2", "blas": "mkl", "torch_build": "2.0 (CPU only)"}
    assert machine_label([one, one, {}]) == "A (AVX2), BLAS mkl, torch 2.0 (CPU only)"
    assert machine_label([{}, None]) == ""
    from flatfl.report.layouts import scale_label
    from flatfl.report.records import load_run

    line = scale_label([load_run(run64)])
    assert f"machine {cpu_model()} (" in line and line.endswith("one client at a time, float64")
