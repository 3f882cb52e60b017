"""Ranks that disagree are refused before they compute, set-up faults are named within the asked timeout, and a
rank's own error reaches the user once (docs/distributed.md). Ranks are started by hand on this machine, as each
machine's torchrun starts them in a multi-node launch (gloo on the CPU); the worlds of a test run side by side.

What the independent truth is: the command each rank was given (a setting that differs, a rank that is missing, a
port held by a socket of the test's own, a loss that raises on one rank only), and the files on disk afterwards."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.utils import ranks
from ranks import ROOT, free_port
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

#: the asked timeout of the tests that wait (seconds), and what a busy 2-core machine may add to start a rank
TIMEOUT, START_UP = 3, 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny digits run of tests/tiny_run.py (the checkpoint the ranks analyse)."""
    return train_tiny(tmp_path_factory.mktemp("agree") / "run", "--threads", "1")


def start_world(commands: list, env: dict | None = None, cwd=None, port: int | None = None) -> list:
    """``python -m flatfl ARGS`` as rank r of ``len(commands)`` for each ``commands[r]`` (None: rank r is not
    started), every rank with MASTER_ADDR=127.0.0.1 and one port; ``env`` added (a value None removes the variable).
    Returns (rank, process, start time) of the started ranks."""
    port = free_port() if port is None else port
    started = []
    for rank, args in enumerate(commands):
        if args is None:
            continue
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(commands)), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(len(commands)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        e.pop("FLATFL_DEBUG", None)
        for k, v in (env or {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        started.append((rank, subprocess.Popen([sys.executable, "-m", "flatfl", *args, "--threads", "1"], env=e,
                                               cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                        time.monotonic()))
    return started


def finished(started: list, timeout: float = 240) -> dict:
    """rank -> (exit code, stdout, stderr lines, seconds it ran) once every started rank has ended."""
    out = {}
    try:
        for rank, p, t0 in started:
            stdout, stderr = p.communicate(timeout=timeout)
            out[rank] = (p.returncode, stdout, [line for line in stderr.splitlines() if line.strip()],
                         time.monotonic() - t0)
    finally:
        for _, p, _ in started:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def only_line(results: dict) -> str:
    """The one line every rank printed together, asserted to be flatfl's error line (no traceback)."""
    lines = [line for code, _, err, _ in results.values() for line in err]
    assert len(lines) == 1 and lines[0].startswith("flatfl: error: "), results
    return lines[0]


def test_ranks_given_other_settings_end_before_any_work_naming_the_setting_and_the_rank(run, tmp_path):
    """Ranks started with another --precision (which aborted gloo), another training --seed, or a flag rank 1 alone
    cannot parse: every rank exits 2 at once, rank 0 printing one line that names the setting (or rank 1's own
    error) and the rank; no output folder is made."""
    h = ["hessian", str(run), "--top", "1", "--samples", "40"]
    worlds = {
        "precision": start_world([[*h, "--out", str(tmp_path / "p")], [*h, "--precision", "float64",
                                                                       "--out", str(tmp_path / "p")]]),
        "seed": start_world([["train", "--rounds", "1", "--clients", "4", "--seed", "1", "--out", str(tmp_path / "s")],
                             ["train", "--rounds", "1", "--clients", "4", "--seed", "2", "--out", str(tmp_path / "s")]]),
        "usage": start_world([[*h, "--out", str(tmp_path / "u")], [*h, "--top", "two", "--out", str(tmp_path / "u")]]),
    }
    results = {name: finished(world) for name, world in worlds.items()}
    for name, result in results.items():
        assert [code for code, *_ in result.values()] == [2, 2], (name, result)
        assert not result[1][2], (name, result)  # rank 1 says nothing: rank 0 speaks
    assert "rank 1 differs from rank 0 in --precision: \"float64\" on rank 1" in only_line(results["precision"])
    assert "rank 1 differs from rank 0 in --seed: 2 on rank 1, 1 on rank 0" in only_line(results["seed"])
    line = only_line(results["usage"])
    assert line.startswith("flatfl: error: rank 1: Invalid value for '--top': 'two'"), line
    assert not any((tmp_path / name).exists() for name in "psu")


def test_setup_faults_are_named_within_the_asked_timeout(run, tmp_path):
    """With FLATFL_DISTRIBUTED_TIMEOUT=3: rank 0 alone, rank 1 alone, and a port held by another program (a socket
    of this test's, which is not a store): each rank ends within the timeout and its start-up, with one line naming
    what is wrong, never torch's DistStoreError."""
    h = ["hessian", str(run), "--top", "1", "--samples", "40", "--out", str(tmp_path / "h")]
    env = {ranks.TIMEOUT_ENV: str(TIMEOUT)}
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        worlds = {"rank 0 alone": start_world([h, None], env), "rank 1 alone": start_world([None, h], env),
                  "taken port": start_world([h, h], env, port=port)}
        results = {name: finished(world) for name, world in worlds.items()}
    finally:
        taken.close()
    for name, result in results.items():
        for rank, (code, _, err, seconds) in result.items():
            assert code == 2 and seconds < TIMEOUT + START_UP, (name, rank, result)
            assert all("DistStoreError" not in line and "Traceback" not in line for line in err), (name, result)
    (line,) = results["rank 0 alone"][0][2]
    assert line.startswith("flatfl: error: rank 0 waited 3 s (FLATFL_DISTRIBUTED_TIMEOUT) for rank 1 of WORLD_SIZE=2")
    (line,) = results["rank 1 alone"][1][2]
    assert line.startswith("flatfl: error: rank 1 waited 3 s (FLATFL_DISTRIBUTED_TIMEOUT) for rank 0 at "
                           "MASTER_ADDR:MASTER_PORT")
    (line,) = results["taken port"][0][2]
    assert f"MASTER_PORT={port} is taken by another program" in line
    (line,) = results["taken port"][1][2]
    assert "something answers at MASTER_ADDR:MASTER_PORT" in line and "but not as rank 0 of this run" in line
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("env, says", [
    ({ranks.TIMEOUT_ENV: "1e14"}, "FLATFL_DISTRIBUTED_TIMEOUT='1e14': the seconds a rank waits for the others must be"),
    ({ranks.TIMEOUT_ENV: "nan"}, "FLATFL_DISTRIBUTED_TIMEOUT='nan': the seconds"),
    ({ranks.TIMEOUT_ENV: "-1"}, "FLATFL_DISTRIBUTED_TIMEOUT='-1': the seconds"),
    ({ranks.TIMEOUT_ENV: "half an hour"}, "FLATFL_DISTRIBUTED_TIMEOUT='half an hour': the seconds"),
    ({"MASTER_ADDR": None}, "WORLD_SIZE=2 is set but MASTER_ADDR is not: the ranks meet at MASTER_ADDR:MASTER_PORT"),
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, "WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT are not"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a port number (1 to 65535)"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: a world has at least one process"),
    ({"WORLD_SIZE": "1", "RANK": "3"}, "RANK=3 is not below WORLD_SIZE=1"),
    ({"RANK": "5"}, "RANK=5 is not below WORLD_SIZE=2"),
    ({"MASTER_ADDR": "256.1.1.1"}, "rank 0: MASTER_ADDR='256.1.1.1' is not a host name this machine can find"),
])
def test_a_hostile_environment_is_one_line_before_any_wait(run, tmp_path, monkeypatch, env, says):
    """Rank 0 of a 2-rank world with a timeout that is not a number of seconds from 1 to 7 days, or without
    MASTER_ADDR / MASTER_PORT: one line naming the variable and exit 2, at once (never an OverflowError, "invalid
    data" or a wait); nothing written."""
    base = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
            "TORCH_CPP_LOG_LEVEL": "WARNING"}
    for k, v in {**base, **env}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["hessian", str(run), "--top", "1", "--out", str(tmp_path / "h")])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and lines == [f"flatfl: error: {lines[0][len('flatfl: error: '):]}"], res.stderr
    assert says in lines[0] and time.monotonic() - t0 < 30
    assert not (tmp_path / "h").exists()


def test_timeout_seconds_reads_a_number_of_seconds(monkeypatch):
    """The timeout as read: unset -> 1800; '90' and '2.5e3' -> 90.0 and 2500.0; 1 and 7 days are the bounds."""
    monkeypatch.delenv(ranks.TIMEOUT_ENV, raising=False)
    assert ranks.timeout_seconds() == 1800
    for raw, value in (("90", 90.0), (" 2.5e3 ", 2500.0), ("1", 1.0), ("604800", 604800.0)):
        monkeypatch.setenv(ranks.TIMEOUT_ENV, raw)
        assert ranks.timeout_seconds() == value
    for raw in ("0.5", "604801", "inf", "0x10"):
        monkeypatch.setenv(ranks.TIMEOUT_ENV, raw)
        with pytest.raises(ConfigError, match="from 1 to"):
            ranks.timeout_seconds()


LOSS = textwrap.dedent("""
    import os
    import torch.nn.functional as F

    def loss(model, batch):
        if os.environ.get("RANK") == os.environ.get("FAILING_RANK"):
            raise KeyError("this rank's own data is missing")
        x, y = batch
        return F.cross_entropy(model(x), y)
""")


def test_a_ranks_own_error_reaches_the_user_once(run, tmp_path):
    """A --loss that raises on rank 1 only: rank 0 prints rank 1's own line (naming the loss, its file and line),
    once, and both exit 2; on rank 0 only: its line, once. No output folder either way."""
    (tmp_path / "my_loss.py").write_text(LOSS)
    h = ["hessian", str(run), "--top", "1", "--samples", "40", "--loss", "my_loss.py:loss"]
    worlds = {failing: start_world([[*h, "--out", f"h{failing}"]] * 2, {"FAILING_RANK": str(failing)}, cwd=tmp_path)
              for failing in (1, 0)}
    results = {failing: finished(world) for failing, world in worlds.items()}
    for failing, result in results.items():
        assert [code for code, *_ in result.values()] == [2, 2], result
        line = only_line(result)
        prefix = "flatfl: error: rank 1: " if failing == 1 else "flatfl: error: "
        assert line.startswith(f"{prefix}the loss my_loss.loss(model, batch) raised KeyError: \"this rank's own data "
                               "is missing\""), line
        assert "my_loss.py:7" in line
        assert not (tmp_path / f"h{failing}").exists()


AGREE_JOB = textwrap.dedent("""
    import os, sys
    import torch
    from torch import nn
    from flatfl.analysis import hessian
    from flatfl.errors import ConfigError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.arange(12) % 3
    if os.environ["RANK"] == "1" and sys.argv[1] == "data":
        x = x + 1e-9  # one rank's evaluation set differs in the last digits
    if os.environ["RANK"] == "1" and sys.argv[1] == "weights":
        with torch.no_grad():
            model[0].bias[0] += 1e-3  # another checkpoint: far beyond the last digits
    try:
        h = hessian(model, nn.CrossEntropyLoss(), data=(x, y))
        print("top", h.eigenvalues(top_n=1)[0][0])
    except ConfigError as e:
        print("refused:", e)
""")


def test_ranks_holding_other_data_or_weights_are_refused_before_any_product(tmp_path):
    """The Python API under 2 ranks (each rank's script builds its model and data; the same on both computes as one
    process, tests/test_distributed.py): an evaluation set 1e-9 off, or weights 1e-3 off, on rank 1 is refused on
    both ranks, naming it and the rank, before any product."""
    job = tmp_path / "job.py"
    job.write_text(AGREE_JOB)
    worlds = {case: _python_world(job, case) for case in ("data", "weights")}
    results = {case: finished(world) for case, world in worlds.items()}
    for case, result in results.items():
        assert all(code == 0 for code, *_ in result.values()), (case, result)
        what = "evaluation data" if case == "data" else "weights"
        outs = [out.strip() for _, out, _, _ in result.values()]
        assert all(o.startswith(f"refused: rank 1 differs from rank 0 in {what}: ") for o in outs), result


def _python_world(script: Path, *args: str) -> list:
    """``python SCRIPT ARGS`` as ranks 0 and 1 (started as :func:`start_world` starts flatfl)."""
    port = free_port()
    started = []
    for rank in range(2):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        started.append((rank, subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True), time.monotonic()))
    return started


def test_the_weights_fingerprint_tells_checkpoints_apart_but_not_rounding():
    """Weights 1e-13 off in relative terms (the last bits a model trained on another processor may differ in) give
    the same fingerprint; one weight 1e-4 off, another shape or another name gives another."""
    torch.manual_seed(0)
    w = [torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    same = ranks.fingerprint(["a", "b"], w)
    assert ranks.fingerprint(["a", "b"], [t * (1 + 1e-13) for t in w]) == same
    moved = [w[0].clone(), w[1].clone()]
    moved[1][0] += 1e-4
    assert ranks.fingerprint(["a", "b"], moved) != same
    assert ranks.fingerprint(["a", "c"], w) != same
    assert ranks.fingerprint(["a", "b"], [w[0].reshape(3, 5), w[1]]) != same


def test_a_rank_that_cannot_find_master_addr_says_so_itself(run, tmp_path):
    """Rank 1 started by hand on a machine that cannot resolve MASTER_ADDR: it cannot tell rank 0, so it says its
    own line (it used to exit 2 without a word), and writes nothing."""
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="256.1.1.1", MASTER_PORT="29559",
               **{ranks.TIMEOUT_ENV: "5"})
    done = subprocess.run([sys.executable, "-m", "flatfl", "hessian", str(run), "--top", "1", "--no-trace",
                           "--out", str(tmp_path / "h")], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and lines == ["flatfl: error: rank 1: MASTER_ADDR='256.1.1.1' is not a host name "
                                              "this machine can find"], lines
    assert not (tmp_path / "h").exists()
