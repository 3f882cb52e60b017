"""Config and grid files are read strictly (flatfl/train/config.py, ``read_settings_file``): YAML by the YAML 1.2
core schema (``seed: 010`` is 10, not octal 8; ``rounds: 1:1`` is the string '1:1', not sexagesimal 61; ``yes`` is
no boolean), a key set twice in one table refused in one line naming it (YAML and TOML), and the names of
algorithms, local optimizers and regularizers stored as their registries' lower-case names wherever they enter."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.sweep import expand_grid, read_grid
from flatfl.train.config import build_config, read_config_file, read_settings_file

TINY = "model: tiny\nclients: 4\nrounds: 1\nlocal_epochs: 1\n"


def _write(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("text, key, value", [
    ("seed: 010\n", "seed", 10),  # YAML 1.1: octal 8
    ("seed: 0o10\n", "seed", 8),  # 1.2's octal, written as such
    ("seed: 0x10\n", "seed", 16),
    ("lr: 1e-2\n", "lr", 0.01),  # YAML 1.1: the string '1e-2'
    ("lr: .5\n", "lr", 0.5),
    ("rounds: 1:1\n", "rounds", "1:1"),  # YAML 1.1: sexagesimal 61
    ("augment: yes\n", "augment", "yes"),  # YAML 1.1: true
    ("augment: off\n", "augment", "off"),
    ("augment: True\n", "augment", True),
    ("name: 2024-01-01\n", "name", "2024-01-01"),  # YAML 1.1: a date
    ("n: 1_000\n", "n", "1_000"),
    ("n: ~\n", "n", None),
])
def test_yaml_is_read_by_the_1_2_core_schema(tmp_path, text, key, value):
    got = read_settings_file(_write(tmp_path, "c.yaml", text))[key]
    assert got == value and type(got) is type(value)


def test_yaml_1_2_numbers_reach_the_run_and_the_grid(tmp_path):
    cfg = build_config(read_config_file(_write(tmp_path, "c.yml", TINY + "seed: 010\nlr: 1e-2\n")))
    assert (cfg.seed, cfg.lr) == (10, 0.01)
    grid = _write(tmp_path, "g.yaml", f"out: {tmp_path / 'runs'}\nfixed:\n  model: tiny\n  rounds: 1\n"
                                      "grid:\n  seed: [010, 011]\n")
    assert sorted(t.settings["seed"] for t in read_grid(grid).tasks) == [10, 11]


@pytest.mark.parametrize("name, text, fragment", [
    ("c.yaml", TINY.replace("rounds: 1", "rounds: 1:1"), "--rounds must be an integer, got '1:1'"),
    ("c.yaml", TINY + "augment: yes\n", "--augment must be true or false, got 'yes'"),
    ("c.yaml", TINY + "seed: 1\nlr: 0.1\nseed: 2\n", "sets 'seed' twice (lines 5 and 7); keep one"),
    ("c.yaml", TINY + "params:\n  zeta: 1\n  zeta: 2\n", "sets 'zeta' twice (lines 6 and 7)"),
    ("c.toml", 'model = "tiny"\nseed = 1\nrounds = 1\nseed = 2\n', "sets 'seed' twice"),
    ("c.toml", "[params]\nmu = 1.0\n[params]\nmu = 2.0\n", "sets 'params' twice"),
])
def test_bad_config_files_are_one_line_naming_the_problem(tmp_path, name, text, fragment):
    f = _write(tmp_path, name, text)
    r = CliRunner().invoke(main, ["train", "--config", str(f), "--quiet", "--out", str(tmp_path / "run")])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("flatfl: error: "), r.output
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_a_duplicate_key_in_a_grid_file_is_refused(tmp_path):
    for name, text in (("g.yaml", "fixed:\n  model: tiny\ngrid:\n  algo: [fedavg]\n  algo: [fedprox]\n"),
                       ("g.toml", '[fixed]\nmodel = "tiny"\n[grid]\nalgo = ["fedavg"]\nalgo = ["fedprox"]\n')):
        with pytest.raises(ConfigError, match="sets 'algo' twice"):
            read_grid(_write(tmp_path, name, text))


def test_a_yaml_merge_key_may_still_be_overridden(tmp_path):
    raw = read_settings_file(_write(tmp_path, "g.yaml", "base: &b {model: tiny, rounds: 1}\nfixed:\n  <<: *b\n"
                                                        "  rounds: 2\n"))
    assert raw["fixed"] == {"model": "tiny", "rounds": 2}


def test_method_names_are_stored_in_their_registries_case(tmp_path):
    """FedAvg / MAN / SAM from a flag, a config file or a grid file are stored as fedavg / man / sam, so runs of
    one method group together (run folder names, config.json, the sweep's run names)."""
    cfg = build_config({}, {"algo": "FedAvg", "reg": "MAN", "local_opt": "SAM"})
    assert (cfg.algo, cfg.reg, cfg.local_opt) == ("fedavg", "man", "sam")
    from_file = build_config(read_config_file(_write(tmp_path, "c.yaml", "algo: FedProx\nreg: Man\nlocal-opt: ASAM\n")))
    assert (from_file.algo, from_file.reg, from_file.local_opt) == ("fedprox", "man", "asam")
    tasks = expand_grid({"fixed": {"model": "tiny", "rounds": 1, "reg": "MAN"},
                         "grid": {"algo": ["FedAvg", "fedavg", "FEDPROX"]}}, root=tmp_path / "sw")
    assert sorted(t.name for t in tasks) == ["algo-fedavg", "algo-fedprox"]  # FedAvg and fedavg: one run
    assert {t.settings["reg"] for t in tasks} == {"man"}
    with pytest.raises(ConfigError, match="unknown algorithm 'FedAvgg'. Did you mean 'fedavg'"):
        build_config({}, {"algo": "FedAvgg"})

    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--algo", "FedAvg", "--reg", "MAN", "--local-opt", "SAM", "--model", "tiny",
                                  "--clients", "2", "--rounds", "1", "--batch-size", "64", "--quiet", "--threads", "1",
                                  "--out", str(run)])
    assert r.exit_code == 0, r.output
    stored = json.loads((run / "config.json").read_text())["config"]
    assert (stored["algo"], stored["reg"], stored["local_opt"]) == ("fedavg", "man", "sam")
