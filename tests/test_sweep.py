"""Sweeps: grid files expand to the right runs; a killed sweep resumes its unfinished run (giving what an
uninterrupted run gives) and skips finished ones; process-pool and Ray executors give the serial results."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.train.config import build_config
from flatfl.errors import ConfigError
from flatfl.executors import LocalExecutor, make_executor
from flatfl.sweep import RunTask, expand_grid, read_grid, run_state, run_sweep, run_tasks
from flatfl.train.engine import Trainer

TINY = dict(dataset="digits", clients=4, participation=1.0, local_epochs=1, batch_size=50, eval_every=1,
            checkpoint_every=1)


def _grid_text(out: Path, rounds, algos=("fedavg",)) -> str:
    """A grid over ``algos`` x ``rounds`` (an int or a list: runs run in this order)."""
    lines = [f'out = "{out}"', "threads = 1", "[fixed]"]
    lines += [f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else f"{k} = {v}" for k, v in TINY.items()]
    lines += ["[grid]", "algo = [" + ", ".join(f'"{a}"' for a in algos) + "]", f"rounds = {rounds}"]
    return "\n".join(lines) + "\n"


def _metrics(run_dir: Path) -> list[dict]:
    with (Path(run_dir) / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


# ---------------------------------------------------------------------------------------------- grid files
def test_grid_expands_to_every_combination_plus_includes(tmp_path):
    raw = {"seeds": [0, 1], "fixed": {"dataset": "digits", "rounds": 3, "zeta": 0.3},
           "grid": {"algo": ["fedavg", "feddyn"], "reg": ["none", "man"], "alpha": [0.3]},
           "include": [{"algo": "fedsam", "rho": 0.1}], "hessian": {"top": 2}}
    tasks = expand_grid(raw, root=tmp_path)
    assert len(tasks) == 2 * 2 * 2 + 1
    names = [t.name for t in tasks]
    assert len(set(names)) == len(names)
    assert "algo-feddyn__reg-man__seed-1" in names  # alpha has one value: not part of the name
    by = {t.name: t for t in tasks}
    t = by["algo-feddyn__reg-man__seed-1"]
    assert t.settings["algo"] == "feddyn" and t.settings["reg"] == "man" and t.settings["seed"] == 1
    assert t.settings["params"] == {"zeta": 0.3} and t.settings["rounds"] == 3 and t.settings["alpha"] == 0.3
    inc = by["algo-fedsam__rho-0.1"]  # an include is named after its own settings
    assert inc.settings["params"] == {"rho": 0.1}  # [fixed] zeta applies to the MAN runs only
    assert by["algo-feddyn__reg-none__seed-1"].settings["params"] == {}
    assert all(t.hessian == {"top": 2} for t in tasks) and all(t.clients is None for t in tasks)
    assert Path(t.run_dir) == tmp_path / t.name


@pytest.mark.parametrize("raw, message", [
    ({"grid": {"algo": ["nope"]}}, "unknown algorithm 'nope'"),
    ({"grid": {"rounds": []}}, "empty list"),
    ({"grid": {"colour": ["red"]}}, "unknown setting 'colour'"),
    ({"seeds": [0], "grid": {"seed": [1]}}, "both 'seeds'"),
    ({"fixed": {"rounds": 0}}, "--rounds must be a positive integer"),
    ({"sweep": {}}, "unknown section or key 'sweep'"),
    ({"fixed": {"algo": "fedavg"}, "grid": {"algo": ["fedprox"]}}, "algo is set in both \\[fixed\\] and \\[grid\\]"),
    ({"fixed": {"data-dir": "d"}, "grid": {"data_dir": ["e"]}}, "data_dir is set in both"),
])
def test_bad_grids_fail_with_one_clear_line(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=message):
        expand_grid(raw, root=tmp_path)


def test_grid_file_errors_on_the_command_line(tmp_path):
    bad = tmp_path / "g.toml"
    bad.write_text("[grid\nalgo = 1\n")
    res = CliRunner().invoke(main, ["sweep", str(bad)])
    assert res.exit_code == 2 and "cannot parse grid file" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["sweep", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "grid file not found" in res.output


def test_yaml_grid_and_dry_run(tmp_path):
    f = tmp_path / "grid.yaml"
    f.write_text(f"out: {tmp_path / 'runs'}\nfixed: {{rounds: 2, clients: 4}}\ngrid: {{reg: [none, man]}}\n")
    grid = read_grid(f)
    assert [t.name for t in grid.tasks] == ["reg-none", "reg-man"]
    rows = run_sweep(f, dry_run=True)
    assert [r["state"] for r in rows] == ["new", "new"]


def test_a_sweep_csv_of_the_users_is_refused_before_any_run_trains(tmp_path):
    """sweep.csv in the sweep's root that flatfl did not write (the user's notes) is never replaced: one line, and
    no run trains; a sweep.csv flatfl wrote is replaced by the next sweep."""
    grid = tmp_path / "grid.toml"
    grid.write_text(_grid_text(tmp_path / "runs", 1))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "sweep.csv").write_text("my notes\n")
    r = CliRunner().invoke(main, ["sweep", str(grid), "--workers", "1"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "sweep.csv exists and was not written by flatfl" in lines[0], \
        r.output
    assert (tmp_path / "runs" / "sweep.csv").read_text() == "my notes\n"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")) == ["sweep.csv"]
    (tmp_path / "runs" / "sweep.csv").unlink()
    assert run_sweep(grid)[0]["train"] == "trained" and run_sweep(grid)[0]["train"] == "skipped"


# ---------------------------------------------------------------------------------------------- resume after a kill
def test_killed_sweep_resumes_the_unfinished_run_and_skips_the_finished_one(tmp_path):
    rounds = 15
    grid = tmp_path / "grid.toml"
    runs = tmp_path / "runs"
    grid.write_text(_grid_text(runs, [1, rounds], algos=("feddyn",)))  # a 1-round run, then a 15-round one
    first, second = runs / "rounds-1", runs / f"rounds-{rounds}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "flatfl", "sweep", str(grid), "--workers", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not (second / "resume.pt").is_file():  # the first run finished; the second has checkpointed
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "the sweep did not reach its second run in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (first / "final.pt").is_file()
    assert not (second / "final.pt").is_file(), "the kill came too late to test resuming"
    assert run_state(second) == "partial"
    done_rounds = len(_metrics(second))
    assert 1 <= done_rounds < rounds
    first_bytes = (first / "final.pt").read_bytes()

    records = run_sweep(grid)
    by = {r["name"]: r for r in records}
    assert by["rounds-1"]["train"] == "skipped" and by[f"rounds-{rounds}"]["train"] == "resumed"
    assert (first / "final.pt").read_bytes() == first_bytes  # untouched
    with (runs / "sweep.csv").open() as f:
        index = {row["name"]: row for row in csv.DictReader(f)}
    assert index[f"rounds-{rounds}"]["train"] == "resumed" and index["rounds-1"]["error"] == ""

    # The resumed run equals an uninterrupted run with the same settings (the engine's determinism).
    cfg = build_config({}, dict(TINY, rounds=rounds, algo="feddyn", out=str(tmp_path / "ref")))
    Trainer(cfg, tmp_path / "ref", quiet=True).run()
    assert _metrics(second) == _metrics(tmp_path / "ref")

    again = run_sweep(grid)
    assert [r["train"] for r in again] == ["skipped", "skipped"]


def test_a_directory_holding_other_settings_is_refused(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(_grid_text(tmp_path / "runs", 1))
    assert run_sweep(grid)[0]["train"] == "trained"
    grid.write_text(_grid_text(tmp_path / "runs", 1).replace("batch_size = 50", "batch_size = 40"))
    rec = run_sweep(grid)[0]
    assert rec["error"] and "holds a run with other settings (batch_size: 50 there, 40 asked)" in rec["error"]


def test_a_run_made_before_a_setting_existed_counts_as_that_setting_at_its_default(tmp_path):
    """A run folder whose config.json predates a setting (here the curvature tracking) is the same run as one asked
    with that setting at its default, and another run than one asked with it on."""
    import json

    grid = tmp_path / "grid.toml"
    grid.write_text(_grid_text(tmp_path / "runs", 1))
    assert run_sweep(grid)[0]["train"] == "trained"
    cfg_file = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir()) / "config.json"
    record = json.loads(cfg_file.read_text())
    for key in ("track_hessian", "track_hessian_settings"):
        del record["config"][key]
    cfg_file.write_text(json.dumps(record))
    assert run_sweep(grid)[0]["train"] == "skipped"
    grid.write_text(_grid_text(tmp_path / "runs", 1).replace("[fixed]", "[fixed]\ntrack_hessian = 1"))
    rec = run_sweep(grid)[0]
    assert rec["error"] and "(track_hessian: 0 there, 1 asked" in rec["error"]


def test_a_run_killed_just_before_final_pt_is_completed_from_its_last_checkpoint(tmp_path):
    from flatfl.sweep import run_task

    task = RunTask("r", str(tmp_path / "r"), dict(TINY, rounds=2), threads=1)
    assert run_task(task)["train"] == "trained"
    final = tmp_path / "r" / "final.pt"
    last = tmp_path / "r" / "checkpoints" / "round_0002.pt"
    assert final.read_bytes() == last.read_bytes()  # the engine writes the same payload to both
    final.unlink()  # as if killed after resume.pt (finished) but before final.pt
    assert run_state(task.run_dir) == "partial"
    assert run_task(task)["train"] == "resumed"
    assert final.read_bytes() == last.read_bytes()


# ---------------------------------------------------------------------------------------------- executors
def _two_tasks(root: Path) -> list[RunTask]:
    return [RunTask(name=a, run_dir=str(root / a), settings=dict(TINY, rounds=1, algo=a), threads=1)
            for a in ("fedavg", "fedprox")]


def test_process_pool_gives_the_serial_results(tmp_path):
    serial = run_tasks(_two_tasks(tmp_path / "serial"))
    pooled = run_tasks(_two_tasks(tmp_path / "pool"), LocalExecutor(2))
    assert [r["train"] for r in serial] == [r["train"] for r in pooled] == ["trained", "trained"]
    for a in ("fedavg", "fedprox"):
        assert _metrics(tmp_path / "serial" / a) == _metrics(tmp_path / "pool" / a)


def test_a_failing_task_does_not_stop_the_others(tmp_path):
    tasks = _two_tasks(tmp_path)
    tasks[0].settings = dict(tasks[0].settings, clients=5000)  # more clients than samples
    records = run_tasks(tasks)
    assert records[0]["error"] and "clients" in records[0]["error"]
    assert records[1]["error"] is None and records[1]["train"] == "trained"


def test_unknown_executor_and_bad_workers():
    with pytest.raises(ConfigError, match="unknown executor"):
        make_executor("slurm")
    with pytest.raises(ConfigError, match="--workers must be a positive integer"):
        make_executor("local", workers=0)


def test_ray_executor_runs_two_tasks(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'flatfl[ray]')")
    from flatfl.executors import RayExecutor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        records = run_tasks(_two_tasks(tmp_path / "ray"), RayExecutor())
    finally:
        ray.shutdown()
    assert [r["train"] for r in records] == ["trained", "trained"] and all(r["error"] is None for r in records)
    serial = run_tasks(_two_tasks(tmp_path / "serial"))
    assert all(r["error"] is None for r in serial)
    for a in ("fedavg", "fedprox"):
        assert _metrics(tmp_path / "ray" / a) == _metrics(tmp_path / "serial" / a)
