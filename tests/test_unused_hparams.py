"""A hyper-parameter of a piece the run does not select is refused with one line, from flags, config files and grid
files alike; help texts state the default each piece applies (issue 18.6)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.train.config import RunConfig, build_config, read_settings_file
from flatfl.errors import ConfigError
from flatfl.reproduce import Selection, plan
from flatfl.sweep import expand_grid
from flatfl.train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS


def train(*args, tmp_path):
    return CliRunner().invoke(main, ["train", *args, "--rounds", "1", "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("args, flag, owner", [
    (["--zeta", "0.1"], "--zeta", "--reg man"),
    (["--rho", "0.1"], "--rho", "--local-opt sam"),
    (["--rho", "0.1"], "--rho", "--algo fedsam"),  # reads it through its fixed optimizer
    (["--eta", "0.1"], "--eta", "--algo fedasam"),
    (["--algo", "fedspeed", "--eta", "0.1"], "--eta", "--local-opt asam"),
    (["--reg", "man", "--width", "0.5"], "--width", "--reg gradaug"),
    (["--algo", "fedavg", "--server-lr", "2"], "--server-lr", "--algo mofedsam"),
    (["--algo", "feddyn", "--feddc-alpha", "0.1"], "--feddc-alpha", "--algo feddc"),
    (["--local-opt", "sam", "--eta", "0.1"], "--eta", "--local-opt asam"),
])
def test_unused_flag_is_one_line_and_exit_2(args, flag, owner, tmp_path):
    r = train(*args, tmp_path=tmp_path)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flatfl: error: {flag} is a setting of ") and owner in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("algo, local_opt, reg, params", [
    ("fedsam", "sgd", "none", {"rho": 0.1}),          # fedsam runs SAM: its rho is used
    ("fedasam", "sgd", "none", {"rho": 0.3, "eta": 0.1}),
    ("fedspeed", "sgd", "man", {"rho": 0.2, "zeta": 0.1}),
    ("fedavg", "asam", "none", {"rho": 0.3, "eta": 0.1}),
    ("mofedsam", "sgd", "none", {"rho": 0.2, "server_lr": 2.0, "fedcm_alpha": 0.2}),
    ("fedavg", "sgd", "gradaug", {"width": 0.5, "num_subnets": 3}),
    ("fedavg", "sgd", "fedalign", {"width": 0.5}),
    ("scaffold", "sgd", "none", {"cv_lr": "initial"}),
])
def test_used_settings_are_accepted_and_applied(algo, local_opt, reg, params):
    cfg = RunConfig(algo=algo, local_opt=local_opt, reg=reg, params=dict(params)).validate()
    algo_cls = ALGORITHMS.get_class(cfg.algo)
    opt_cls = LOCAL_OPTIMIZERS.get_class(algo_cls.local_optimizer(cfg.local_opt))
    resolved = {}
    for cls in (REGULARIZERS.get_class(reg), algo_cls):
        resolved.update({hp.key: v for hp, v in zip(cls.hparams, cls.resolve(cfg.params).values())})
    resolved.update({hp.key: v for hp, v in zip(opt_cls.hparams,
                                                 opt_cls.resolve(algo_cls.optimizer_settings(cfg.params)).values())})
    for key, value in params.items():
        assert resolved[key] == value  # the value the run uses is the one given


def test_config_file_and_params_table(tmp_path):
    for text in ("zeta = 0.1\n", "[params]\nzeta = 0.1\n", "algo = 'fedspeed'\n[params]\neta = 0.3\n"):
        f = tmp_path / "c.toml"
        f.write_text(text)
        r = CliRunner().invoke(main, ["train", "--config", str(f), "--out", str(tmp_path / "run")])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and "is a setting of" in r.output, r.output
    f.write_text("reg = 'man'\nzeta = 0.1\n")
    assert CliRunner().invoke(main, ["train", "--config", str(f), "--rounds", "1", "--model", "tiny",
                                     "--clients", "2", "--quiet", "--out", str(tmp_path / "ok")]).exit_code == 0


def test_grid_file_names_the_run(tmp_path):
    grid = tmp_path / "g.toml"
    # a run's own setting (a grid axis, an include) must be read by that run
    grid.write_text(f'out = "{tmp_path / "sw"}"\n[fixed]\nrounds = 1\n[grid]\nreg = ["man", "none"]\n'
                    'zeta = [0.1, 0.2]\n')
    r = CliRunner().invoke(main, ["sweep", str(grid), "--dry-run"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "run reg=none, zeta=0.1: --zeta is a setting of --reg man" in r.output
    # a [fixed] setting applies to the runs that read it; one that no run reads is an error
    grid.write_text(f'out = "{tmp_path / "sw"}"\n[fixed]\nrounds = 1\nzeta = 0.1\n[grid]\nalgo = ["fedavg", "feddyn"]\n')
    r = CliRunner().invoke(main, ["sweep", str(grid), "--dry-run"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "[fixed] zeta" in r.output and "no run of the grid uses it" in r.output
    assert not (tmp_path / "sw").exists()
    grid.write_text(f'out = "{tmp_path / "sw"}"\n[fixed]\nrounds = 1\nzeta = 0.1\n[grid]\nreg = ["none", "man"]\n')
    tasks = {t.name: t for t in expand_grid(read_settings_file(grid), root=tmp_path / "sw")}
    assert tasks["reg-man"].settings["params"] == {"zeta": 0.1} and tasks["reg-none"].settings["params"] == {}


@pytest.mark.parametrize("target", ["man-tables", "fedalign-table1"])
@pytest.mark.parametrize("preset", ["tiny", "quick", "paper"])
def test_reproduce_presets_set_only_used_settings(target, preset):
    for task in plan(Selection(target, preset)):
        cfg = build_config({}, task.settings)  # would raise on an unused setting
        algo_cls = ALGORITHMS.get_class(cfg.algo)
        pieces = (algo_cls, LOCAL_OPTIMIZERS.get_class(algo_cls.local_optimizer(cfg.local_opt)),
                  REGULARIZERS.get_class(cfg.reg))
        used = {hp.key for cls in pieces for hp in cls.hparams}
        assert set(cfg.params) <= used, (task.name, cfg.params)


def test_help_states_each_default_once():
    text = " ".join(CliRunner().invoke(main, ["train", "--help"], terminal_width=400).output.split())
    rho = text[text.index("--rho FLOAT"):text.index("--robust")]
    for piece in ("--local-opt sam (and --algo fedsam): 0.05", "--local-opt asam (and --algo fedasam): 0.5",
                  "--algo fedspeed: 0.1", "--algo mofedsam: 0.1"):
        assert piece in rho, rho
    width = text[text.index("--width FLOAT"):text.index("--zeta")]
    assert width.count("0.25") == 1 and width.count("0.8") == 1, width
    zeta = text[text.index("--zeta FLOAT"):]
    assert "[--reg man only; default 0.15]" in zeta


def test_unused_setting_error_from_python():
    with pytest.raises(ConfigError, match="--zeta is a setting of --reg man"):
        RunConfig(params={"zeta": 0.2}).validate()


def test_a_run_saved_with_an_unused_setting_still_counts_as_the_same_run(tmp_path):
    """Runs written before unused settings were refused may hold one (a sweep's [fixed] zeta in its reg=none runs):
    it changes nothing, so a sweep resumes them instead of calling them different."""
    import json

    from flatfl.sweep import run_state

    r = CliRunner().invoke(main, ["train", "--model", "tiny", "--rounds", "1", "--clients", "2", "--quiet",
                                  "--threads", "1", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    f = tmp_path / "run" / "config.json"
    saved = json.loads(f.read_text())
    saved["config"]["params"] = {"zeta": 0.3}
    f.write_text(json.dumps(saved))
    expected = build_config({}, {"model": "tiny", "rounds": 1, "clients": 2, "out": str(tmp_path / "run")})
    assert run_state(tmp_path / "run", expected=expected) == "finished"
    other = build_config({}, {"model": "tiny", "rounds": 1, "clients": 2, "reg": "man", "params": {"zeta": 0.2}})
    with pytest.raises(ConfigError):
        run_state(tmp_path / "run", expected=other)
