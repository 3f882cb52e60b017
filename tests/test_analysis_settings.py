"""The defaults of ``flatfl hessian-clients`` and ``flatfl surface`` live in one place each (ClientMetricsSettings,
SurfaceSettings): the command line, a grid file's [clients] / [surface] section, the reproduce presets and the
functions read them; bad values and typos are refused in one line, in a grid file before any run. And the Hessian
estimators are one registry: its names are the command line's help, the settings' choices and the dispatch."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
from click.testing import CliRunner

from flatfl.analysis.commands.clients_command import run_client_metrics
from flatfl.analysis.estimators.by_name import eigen_estimator, estimate_trace, trace_estimator
from flatfl.analysis.commands.surface_command import run_surface
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.sweep import read_grid
from flatfl.analysis.commands.client_metrics_settings import ClientMetricsSettings
from flatfl.analysis.estimators.registry import EIGEN_ESTIMATORS, TRACE_ESTIMATORS
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.analysis.commands.surface_settings import SurfaceSettings

# the documented defaults (--help before the settings were gathered): written out, not derived
CLIENTS = {"protocol": "default", "probes": 100, "groups": 10, "samples": None, "batch_size": None, "seed": 0,
           "tol": 1e-3, "device": "cpu", "data_dir": None, "model_factory": None, "curvature": "hessian",
           "precision": None}
SURFACE = {"directions": "random", "grid": 21, "range": 1.0, "samples": None, "workers": 1, "batch_size": 256,
           "split": "train", "seed": 0, "include_bn_bias": False, "eigenvectors": None, "tol": 1e-3, "device": "cpu",
           "data_dir": None, "force": False, "save_every": 8, "model_factory": None, "precision": None}
GRID = '[fixed]\nmodel = "tiny"\nclients = 4\nrounds = 1\nlocal_epochs = 1\nsave_clients = true\n[grid]\nalgo = ["fedavg"]\n'


def settings_default(fn):
    """The settings object ``fn`` computes with when none is given (its ``settings`` parameter's default)."""
    return inspect.signature(fn).parameters["settings"].default


@pytest.mark.parametrize("cls, expected", [(ClientMetricsSettings, CLIENTS), (SurfaceSettings, SURFACE)])
def test_the_defaults_did_not_change_and_are_frozen(cls, expected):
    assert cls().to_dict() == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls().seed = 2


@pytest.mark.parametrize("command, function, expected", [
    ("hessian-clients", "flatfl.analysis.commands.clients_command.run_client_metrics", CLIENTS),
    ("surface", "flatfl.analysis.commands.surface_command.run_surface", SURFACE)])
def test_cli_defaults_equal_the_dataclass(received_settings, command, function, expected):
    """What the command passes on when no option is given: the documented defaults (save_every is no option: its
    default)."""
    assert received_settings(command, function) == expected


def test_surface_flags_given_reach_the_function(received_settings):
    received = received_settings("surface", "flatfl.analysis.commands.surface_command.run_surface",
                                 "--include-bn-bias", "--force", "--range", "0.5")
    assert received == dict(SURFACE, include_bn_bias=True, force=True, range=0.5)


@pytest.mark.parametrize("fn, expected", [(run_client_metrics, CLIENTS), (run_surface, SURFACE)])
def test_function_defaults_equal_the_dataclass(fn, expected):
    assert settings_default(fn).to_dict() == expected
    assert list(inspect.signature(fn).parameters)[:3] == ["checkpoint", "out", "settings"]


@pytest.mark.parametrize("section, cls, expected", [("clients", ClientMetricsSettings, CLIENTS),
                                                    ("surface", SurfaceSettings, SURFACE)])
def test_grid_file_sections_are_the_dataclass(tmp_path, section, cls, expected):
    grid = tmp_path / "g.toml"
    grid.write_text(GRID + f"[{section}]\nseed = 3\n")
    (task,) = read_grid(grid).tasks
    assert cls.from_mapping(getattr(task, section)).to_dict() == dict(expected, seed=3)
    grid.write_text(GRID + f"[{section}]\nseeed = 3\n")  # a typo: refused when the grid is read, before any run
    with pytest.raises(ConfigError) as e:
        read_grid(grid)
    assert str(e.value) == f"unknown option 'seeed' in [{section}] of {grid}. Did you mean 'seed'?"


@pytest.mark.parametrize("section, text, message", [
    ("clients", 'protocol = "mine"', "unknown cross-client protocol 'mine': choose one of default, fedalign"),
    ("clients", "probes = 3", "--probes must be at least 4 for the default protocol, got 3"),
    ("surface", 'directions = "up"', "unknown direction kind 'up': choose one of random, hessian"),
    ("surface", 'eigenvectors = "e.pt"', "--eigenvectors needs --directions hessian"),
])
def test_grid_values_are_checked_together_before_any_run(tmp_path, section, text, message):
    grid = tmp_path / "g.toml"
    grid.write_text(GRID + f"[{section}]\n{text}\n")
    with pytest.raises(ConfigError) as e:
        read_grid(grid)
    assert str(e.value) == f"[{section}] of {grid}: {message}"


@pytest.mark.parametrize("settings, message", [
    ({"protocol": "x"}, "unknown cross-client protocol 'x': choose one of default, fedalign"),
    ({"protocol": "fedalign", "probes": 1}, "--probes must be at least 2 for the fedalign protocol, got 1"),
    ({"groups": 1}, "--groups must be an integer >= 2, got 1"),
    ({"samples": "all"}, "--samples must be an integer, got 'all'"),
    ({"samples": 0}, "--samples must be a positive integer, got 0"),
    ({"batch_size": -2}, "--batch-size must be a positive integer, got -2"),
    ({"tol": 1.5}, "--tol must be in (0, 1) (a relative tolerance), got 1.5"),
    ({"seed": -1}, "--seed must be an integer in 0..4294967295, got -1"),
])
def test_client_metrics_validate(settings, message):
    with pytest.raises(ConfigError) as e:
        ClientMetricsSettings(**settings).validate()
    assert str(e.value) == message


@pytest.mark.parametrize("settings, message", [
    ({"directions": "x"}, "unknown direction kind 'x': choose one of random, hessian"),
    ({"grid": 1}, "--grid must be an integer >= 2 (points per axis), got 1"),
    ({"range": 0.0}, "--range must be a positive number, got 0.0"),
    ({"range": float("inf")}, "--range must be a positive number, got inf"),
    ({"samples": 0}, "--samples must be a positive integer, got 0"),
    ({"workers": 0}, "--workers must be a positive integer, got 0"),
    ({"batch_size": 0}, "--batch-size must be a positive integer, got 0"),
    ({"split": "val"}, "unknown split 'val': choose one of train, test"),
    ({"eigenvectors": "e.pt"}, "--eigenvectors needs --directions hessian"),
    ({"tol": 0.0}, "--tol must be in (0, 1) (a relative tolerance), got 0.0"),
    ({"force": "yes"}, "--force must be true or false, got 'yes'"),
    ({"save_every": 0}, "save_every must be a positive integer, got 0"),
])
def test_surface_validate(settings, message):
    with pytest.raises(ConfigError) as e:
        SurfaceSettings(**settings).validate()
    assert str(e.value) == message


def test_from_mapping_refuses_unknown_keys_in_one_line():
    with pytest.raises(ConfigError) as e:
        SurfaceSettings.from_mapping({"grids": 3, "rnge": 1.0})
    assert str(e.value) == f"unknown options 'grids', 'rnge' in the surface settings: use {', '.join(sorted(SURFACE))}"
    assert ClientMetricsSettings.from_mapping({"probes": 8}) == ClientMetricsSettings(probes=8)


def test_reproduce_presets_are_valid_settings(tmp_path):
    from flatfl import paper_tables
    from flatfl.reproduce import PRESETS, TARGETS, Selection, plan, tables_of

    for target in TARGETS:
        offered = set.intersection(*(set(paper_tables.REPRODUCED[k].presets) for k in tables_of(target)))
        assert offered and offered <= set(PRESETS)
        for preset in sorted(offered):
            for task in plan(Selection(target, preset), runs_dir=tmp_path):
                for section, cls in (("clients", ClientMetricsSettings), ("surface", SurfaceSettings)):
                    if getattr(task, section) is not None:
                        cls.from_mapping(getattr(task, section))


def test_one_estimator_registry_for_help_checks_and_dispatch():
    helps = {p.name: p.lazy_help() if hasattr(p, "lazy_help") else getattr(p, "help", None)  # as --help shows it
             for p in main.commands["hessian"].params}
    assert helps["method"].startswith(" | ".join(EIGEN_ESTIMATORS) + " ")
    assert helps["trace_method"].startswith(" | ".join(TRACE_ESTIMATORS) + " ")
    for name in EIGEN_ESTIMATORS:
        assert list(inspect.signature(eigen_estimator(name)).parameters)[:2] == ["op", "k"]
        HessianSettings(method=name).validate()
    for name in TRACE_ESTIMATORS:
        assert "max_hvps" in inspect.signature(trace_estimator(name)).parameters
        HessianSettings(trace_method=name).validate()
    with pytest.raises(ConfigError) as e:
        estimate_trace(None, "diagonal")
    assert str(e.value) == f"unknown trace method 'diagonal': choose one of {', '.join(TRACE_ESTIMATORS)}"
    with pytest.raises(ConfigError) as e:
        eigen_estimator("qr")
    assert str(e.value) == f"unknown eigenvalue method 'qr': choose one of {', '.join(EIGEN_ESTIMATORS)}"
    assert {"lanczos", "power"} <= set(EIGEN_ESTIMATORS) and {"hutchpp", "hutchinson", "pyhessian"} <= set(
        TRACE_ESTIMATORS)  # the built-in ones; others may be registered beside them


def test_the_clients_command_refuses_bad_settings_before_reading_anything(tmp_path):
    res = CliRunner().invoke(main, ["hessian-clients", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                                    "--groups", "1"])
    assert res.exit_code != 0 and not (tmp_path / "o").exists()
    assert "--groups must be an integer >= 2, got 1" in res.output + (res.stderr or "")


def test_the_settings_and_the_registry_import_no_torch():
    """The command line reads the analyses' defaults, choices and help texts from flatfl.analysis without torch:
    the settings modules and the registry import none, nor does the package itself until a name is asked for."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent  # this checkout's package, whatever is installed
    code = ("import sys, flatfl.cli, flatfl.analysis, flatfl.analysis.commands.hessian_settings, "
            "flatfl.analysis.estimators.registry, flatfl.analysis.commands.surface_settings, "
            "flatfl.analysis.commands.client_metrics_settings\n"
            "from flatfl.analysis.estimators.registry import estimator_names\n"
            "assert estimator_names('eigenvalues')\n"
            "print('torch' in sys.modules)\n"
            "from flatfl.analysis import HessianOperator\n"  # a name asked for: its module imported now
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], (r.stdout, r.stderr)
