"""The Hessian analysis defaults live in one place (HessianSettings); the command line, a grid file's [hessian]
section, run_hessian / compute and report --compute-missing all read them from there, and none changed."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from flatfl.analysis.commands.hessian_command import compute, run_hessian
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.report.pdf import DEFAULT_HESSIAN
from flatfl.sweep import read_grid
from flatfl.analysis.estimators.quantities import quantity_names
from flatfl.analysis.estimators.registry import estimator_names
from flatfl.analysis.commands.hessian_settings import HessianSettings

# the documented defaults (README / --help before the settings were gathered): written out, not derived
EXPECTED = {"top": 1, "trace": True, "density": False, "samples": None, "batch_size": 256, "split": "train",
            "method": "lanczos", "seed": 0, "device": "cpu", "save_eigenvectors": False, "tol": 1e-3,
            "trace_method": None, "trace_hvps": 100, "trace_rtol": 1e-2, "density_steps": 100, "density_starts": 4,
            "exact_residuals": False, "data_dir": None, "model_factory": None, "per_layer": False, "per_layer_top": 1,
            "loss": None, "curvature": "hessian", "products": "auto",
            "precision": None, "which": None, "smallest": 0, "measure": None, "damping": 0.0}


def choices(message: str) -> str:
    """``message`` with ``{eigenvalues}`` / ``{trace}`` / ``{quantities}`` filled in by the registered names, as the
    refusal lists them: a registered estimator changes the list, not the test."""
    return message.format(**{kind: ", ".join(estimator_names(kind)) for kind in ("eigenvalues", "trace")},
                          quantities=", ".join(quantity_names()))


GRID = '[fixed]\nmodel = "tiny"\nclients = 4\nrounds = 1\nlocal_epochs = 1\n[grid]\nalgo = ["fedavg"]\n'


def settings_default(fn):
    """The settings object ``fn`` computes with when none is given (its ``settings`` parameter's default)."""
    return inspect.signature(fn).parameters["settings"].default


def test_the_defaults_did_not_change():
    assert HessianSettings().to_dict() == EXPECTED
    with pytest.raises(dataclasses.FrozenInstanceError):
        HessianSettings().top = 2


def test_cli_defaults_equal_the_dataclass(received_settings):
    """What ``flatfl hessian`` passes on when no option is given: the documented defaults; flags given turn on."""
    assert received_settings("hessian", "flatfl.analysis.commands.hessian_command.run_hessian") == EXPECTED
    flags = received_settings("hessian", "flatfl.analysis.commands.hessian_command.run_hessian", "--save-eigenvectors",
                              "--exact-residuals", "--no-trace", "--density")
    assert flags == dict(EXPECTED, save_eigenvectors=True, exact_residuals=True, trace=False, density=True)


def test_analysis_function_defaults_equal_the_dataclass():
    """run_hessian and compute take one settings object (no keyword per setting), defaulting to the defaults."""
    for fn in (run_hessian, compute):
        assert settings_default(fn).to_dict() == EXPECTED
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def test_grid_file_defaults_equal_the_dataclass(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(GRID + "[hessian]\nseed = 0\n")
    (task,) = read_grid(grid).tasks
    assert HessianSettings.from_mapping(task.hessian).to_dict() == EXPECTED  # the omitted keys: the defaults
    grid.write_text(GRID + "[spectrum]\ntopp = 3\n")
    with pytest.raises(ConfigError) as e:
        read_grid(grid)
    assert str(e.value) == f"unknown option 'topp' in [spectrum] of {grid}. Did you mean 'top'?"


def test_report_defaults_are_the_dataclass_but_four_density_starts():
    assert DEFAULT_HESSIAN == {"top": 1, "trace": True, "density": False, "samples": None, "method": "lanczos",
                               "seed": 0, "density_starts": 4}


def test_from_mapping_refuses_unknown_keys_in_one_line():
    with pytest.raises(ConfigError) as e:
        HessianSettings.from_mapping({"topp": 1, "method": "power", "tole": 0.1}, source="my settings")
    assert str(e.value) == f"unknown options 'tole', 'topp' in my settings: use {', '.join(sorted(EXPECTED))}"
    assert HessianSettings.from_mapping({"method": "power", "top": 3}) == HessianSettings(method="power", top=3)


@pytest.mark.parametrize("settings, message", [
    ({"top": "one"}, "--top must be an integer, got 'one'"),
    ({"top": -1}, "--top must be a non-negative integer, got -1"),
    ({"trace": 1}, "--trace must be true or false, got 1"),
    ({"tol": 5.0}, "--tol must be in (0, 1) (a relative tolerance), got 5.0"),
    ({"tol": float("nan")}, "--tol must be a finite number, got nan"),
    ({"method": "qr"}, "unknown eigenvalue method 'qr': choose one of {eigenvalues}"),
    ({"trace_method": "diagonal"}, "unknown trace method 'diagonal': choose one of {trace}"),
    ({"split": "val"}, "unknown split 'val': choose one of train, test"),
    ({"trace_hvps": 0}, "--trace-hvps must be >= 1, got 0"),
    ({"density_starts": 0}, "--density-steps and --density-starts must be >= 1"),
    ({"samples": 0}, "--samples must be a positive integer, got 0"),
    ({"seed": -1}, "--seed must be an integer in 0..4294967295, got -1"),
    ({"top": 0, "trace": False}, "nothing to compute: ask for --top K >= 1, --smallest K >= 1, --trace, --density, "
                                      "--per-layer or --measure"),
    ({"damping": -0.5}, "--damping must be from 0 to 1e+12 (the matrix measured is the curvature + damping * I; beyond "
                        "it the curvature is lost to rounding), got -0.5"),
    ({"damping": 1e39}, "--damping must be from 0 to 1e+12 (the matrix measured is the curvature + damping * I; beyond "
                        "it the curvature is lost to rounding), got 1e+39"),
    ({"measure": "frobenius,nope"}, "unknown quantity 'nope': choose one of {quantities}"),
    ({"top": 0, "save_eigenvectors": True}, "--save-eigenvectors needs --top >= 1"),
    ({"smallest": -1}, "--smallest must be an integer from 0 to 100,000, got -1"),
    ({"smallest": 2, "which": "smallest"}, "--smallest with --which smallest: --top already finds the smallest "
                                           "eigenvalues; give one of the two"),
])
def test_validate(settings, message):
    with pytest.raises(ConfigError) as e:
        HessianSettings(**settings).validate()
    assert str(e.value) == choices(message)


def test_grid_values_are_checked_together_before_any_run(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(GRID + '[hessian]\nmethod = "qr"\n')
    with pytest.raises(ConfigError) as e:
        read_grid(grid)
    message = "unknown eigenvalue method 'qr': choose one of {eigenvalues}"
    assert str(e.value) == f"[hessian] of {grid}: {choices(message)}"


def test_report_compute_missing_checks_the_asked_settings_first(tmp_path):
    from click.testing import CliRunner

    res = CliRunner().invoke(main, ["report", str(tmp_path / "no-run"), "--out", str(tmp_path / "rep"),
                                    "--compute-missing", "--method", "qr"])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        choices("flatfl: error: unknown eigenvalue method 'qr': choose one of {eigenvalues}")]
