"""Ctrl-C as a terminal sends it (SIGINT to the whole process group) while ``flatfl sweep --workers 2`` and
``flatfl train`` run: one stderr line saying what was kept and how to go on, exit status 130, no traceback, no
"leaked semaphore" warning, every worker process gone within seconds, and the same command (``train --resume``)
then finishes the runs (docs/reliability.md; the pool is :func:`flatfl.utils.processes.worker_pool`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
FAST = ["--model", "tiny", "--clients", "4", "--participation", "1", "--local-epochs", "1", "--batch-size", "64",
        "--quiet", "--threads", "1"]


def _as_in_a_terminal():
    """SIGINT at its default in the child (a suite started by a non-interactive shell inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(argv, cwd) -> subprocess.Popen:
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc to find the worker processes")
    return subprocess.Popen([sys.executable, "-m", "flatfl", *argv], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_as_in_a_terminal)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _wait_for(what, proc, condition, seconds: float = 120.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"flatfl ended before {what}: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"{what} did not happen in time"
        time.sleep(0.02)


def _ctrl_c(proc) -> tuple[str, str]:
    """SIGINT to the process group, as a terminal's Ctrl-C; the output, once the command has ended."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def _one_interrupt_line(proc, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "leaked semaphore" not in err and "KeyboardInterrupt" not in err, err
    assert len(lines) == 1 and lines[0].startswith("flatfl: interrupted; "), err
    return lines[0]


def _cleanup(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # never leave a stray process behind
    except (ProcessLookupError, PermissionError):
        pass


def test_ctrl_c_stops_a_sweep_and_its_workers_then_the_sweep_resumes(tmp_path):
    runs = tmp_path / "runs"
    grid = tmp_path / "grid.toml"
    grid.write_text(f'out = "{runs}"\nthreads = 1\n[fixed]\nmodel = "tiny"\nclients = 4\nrounds = 60\n'
                    'checkpoint_every = 5\nlocal_epochs = 1\n[grid]\nalgo = ["fedavg", "fedprox"]\n')
    argv = ["sweep", str(grid), "--workers", "2"]
    proc = _start(argv, tmp_path)
    try:
        pids: set[int] = set()

        def both_workers_hold_their_run_lock() -> bool:
            for lock in runs.glob("*/.flatfl.lock"):
                text = lock.read_text().strip() if lock.is_file() else ""
                if text.isdigit():
                    pids.add(int(text))
            return len(pids) == 2

        _wait_for("both workers holding their run's lock", proc, both_workers_hold_their_run_lock)
        assert proc.pid not in pids
        _, err = _ctrl_c(proc)
        line = _one_interrupt_line(proc, err)
        assert line == "flatfl: interrupted; finished runs are kept, rerun the same command to resume", line
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a worker kept running after Ctrl-C"
        folders = sorted(d for d in runs.iterdir() if d.is_dir())
        assert len(folders) == 2 and not any((d / "final.pt").exists() for d in folders)  # stopped mid-training
        started = {d.name for d in folders if (d / "config.json").is_file()}
    finally:
        _cleanup(proc)

    again = subprocess.run([sys.executable, "-m", "flatfl", *argv], cwd=tmp_path, env=ENV, capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    assert "2 of 2 runs done" in again.stdout, again.stdout
    for d in folders:  # a run stopped after its first file continues; one stopped before it (only its lock) starts
        assert f"{d.name}: train {'resumed' if d.name in started else 'trained'}" in again.stdout, again.stdout
        assert (d / "final.pt").is_file()


def test_ctrl_c_stops_a_training_which_resume_then_finishes(tmp_path):
    from click.testing import CliRunner

    from flatfl.cli import main

    run = tmp_path / "run"
    proc = _start(["train", *FAST, "--rounds", "100", "--checkpoint-every", "5", "--out", str(run)], tmp_path)
    try:
        _wait_for("the first checkpoint", proc, lambda: (run / "resume.pt").is_file())
        _, err = _ctrl_c(proc)
        line = _one_interrupt_line(proc, err)
        assert line == (f"flatfl: interrupted; the run is kept up to its last checkpoint: flatfl train --resume {run} "
                        "continues it"), line
        assert not (run / "final.pt").exists()
    finally:
        _cleanup(proc)
    res = CliRunner().invoke(main, ["train", "--resume", str(run), "--quiet"])
    assert res.exit_code == 0, res.output
    assert (run / "final.pt").is_file() and res.output.startswith("round 100: test accuracy")
