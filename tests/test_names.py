"""An unknown name (algorithm, regularizer, local optimizer, model, dataset, partition, estimator, protocol, direction
kind, split, reproduction target, preset, a hyper-parameter's value), on the command line, in a config file or in a
grid file, is one line naming the closest valid name (difflib), as click does for an unknown command; a name close to
none lists the valid ones. Nothing runs: every case fails before any work."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError, unknown_name


def test_unknown_name_suggests_the_closest_or_lists_them():
    assert str(unknown_name("algorithm", "fedavgg", ["fedavg", "fedprox", "feddyn"])) == \
        "unknown algorithm 'fedavgg'. Did you mean 'fedavg'?"
    assert str(unknown_name("algorithm", "FedProxx", ["fedavg", "fedprox"])) == \
        "unknown algorithm 'FedProxx'. Did you mean 'fedprox'?"
    assert str(unknown_name("split", "val", ["train", "test"])) == "unknown split 'val': choose one of train, test"


CHECKPOINT_FREE = "no-such-checkpoint.pt"  # the names are checked before the checkpoint is opened

CASES = [
    (["train", "--algo", "fedavgg"], "unknown algorithm 'fedavgg'. Did you mean 'fedavg'?"),
    (["train", "--reg", "mann"], "unknown regularizer 'mann'. Did you mean 'man'?"),
    (["train", "--local-opt", "samm"], "unknown local optimizer 'samm'. Did you mean 'sam'?"),
    (["train", "--model", "tinyy"], "unknown model 'tinyy'. Did you mean 'tiny'?"),
    (["train", "--dataset", "digit"], "unknown dataset 'digit'. Did you mean 'digits'?"),
    (["train", "--partition", "iidd"], "unknown partition 'iidd'. Did you mean 'iid'?"),
    (["train", "--sampling", "fractoin"], "unknown sampling 'fractoin'. Did you mean 'fraction'?"),
    (["train", "--algo", "scaffold", "--cv-lr", "curent"], "Did you mean 'current'?"),
    (["hessian", CHECKPOINT_FREE, "--out", "OUT", "--method", "lanczoss"],
     "unknown eigenvalue method 'lanczoss'. Did you mean 'lanczos'?"),
    (["hessian", CHECKPOINT_FREE, "--out", "OUT", "--trace-method", "hutchinsn"],
     "unknown trace method 'hutchinsn'. Did you mean 'hutchinson'?"),
    (["hessian", CHECKPOINT_FREE, "--out", "OUT", "--split", "trian"], "unknown split 'trian'. Did you mean 'train'?"),
    (["hessian-clients", CHECKPOINT_FREE, "--out", "OUT", "--protocol", "fedaling"],
     "unknown cross-client protocol 'fedaling'. Did you mean 'fedalign'?"),
    (["surface", CHECKPOINT_FREE, "--out", "OUT", "--directions", "hesian"],
     "unknown direction kind 'hesian'. Did you mean 'hessian'?"),
    (["reproduce", "man-tabel2"], "unknown reproduction target 'man-tabel2'. Did you mean 'man-table2'?"),
    (["reproduce", "man-table2", "--preset", "quik"], "unknown preset 'quik'. Did you mean 'quick'?"),
    (["report", "RUNS", "--model", "sever"], "unknown model 'sever'. Did you mean 'server'?"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_unknown_names_on_the_command_line(tmp_path, args, message):
    args = [str(tmp_path / a) if a in ("OUT", "RUNS", CHECKPOINT_FREE) else a for a in args]
    (tmp_path / "RUNS").mkdir()
    r = CliRunner().invoke(main, args + ["--threads", "1"] if args[0] != "report" else args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("flatfl: error: ") and message in lines[0], lines
    assert not (tmp_path / "OUT").exists()


def test_unknown_names_in_config_and_grid_files(tmp_path):
    from flatfl.sweep import read_grid

    config = tmp_path / "settings.toml"
    config.write_text('algo = "feddynn"\nrounds = 1\n')
    r = CliRunner().invoke(main, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--threads", "1"])
    assert r.exit_code == 2 and r.stderr.strip() == "flatfl: error: unknown algorithm 'feddynn'. Did you mean 'feddyn'?"
    assert not (tmp_path / "run").exists()
    config.write_text('reg = "asdd"\n')
    r = CliRunner().invoke(main, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--threads", "1"])
    assert r.exit_code == 2 and "unknown regularizer 'asdd'. Did you mean 'asd'?" in r.stderr
    grid = tmp_path / "grid.toml"
    for text, message in (("roundss = 1\n", f"unknown setting 'roundss' in {config}. Did you mean 'rounds'?"),
                          ("rounds = 1\nzetta = 0.1\n", f"unknown setting 'zetta' in {config}. Did you mean 'zeta'?"),
                          ("[params]\nrhoo = 0.1\n", f"unknown hyper-parameter 'rhoo' in {config}. Did you mean 'rho'?")):
        config.write_text(text)
        r = CliRunner().invoke(main, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--threads",
                                      "1"])
        assert r.exit_code == 2 and r.stderr.strip() == f"flatfl: error: {message}", r.stderr
    grid.write_text('[grid]\nalgo = ["fedavg", "scafold"]\n')
    with pytest.raises(ConfigError, match=r"unknown algorithm 'scafold'. Did you mean 'scaffold'\?"):
        read_grid(grid)
    grid.write_text('[grid]\nalgo = ["fedavg"]\n[hessian]\ntopp = 3\n')
    with pytest.raises(ConfigError, match=r"unknown option 'topp' in \[hessian\] of .*\. Did you mean 'top'\?"):
        read_grid(grid)
    grid.write_text('[grid]\nalgo = ["fedavg"]\n[hessian]\nmethod = "powr"\n')
    with pytest.raises(ConfigError, match=r"unknown eigenvalue method 'powr'. Did you mean 'power'\?"):
        read_grid(grid)
