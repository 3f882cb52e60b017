"""Code of yours breaks only itself (docs/reliability.md, "Plug-ins and your own code"): a ``--loss`` that changes
the working directory, turns torch's gradients off, closes sys.stdout or leaves a thread running, and a custom
``torch.autograd.Function`` whose backward raises when differentiated again. The independent truth: where the files
are on disk, the same analysis with a loss without the side effect, the process's exit and its printed lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.utils import user_code
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANALYSIS = ["--top", "1", "--no-trace", "--samples", "64", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny digits run of tests/tiny_run.py."""
    return train_tiny(tmp_path_factory.mktemp("user-code") / "run", "--threads", "1")


@pytest.fixture
def fresh_notices(monkeypatch):
    """Every notice said again (they are said once a process)."""
    monkeypatch.setattr(user_code, "NOTICES", set())


def loss_file(folder, name: str, before: str = "", after: str = "") -> str:
    """``folder/name.py`` defining ``loss(model, batch)``: cross-entropy, with ``before`` run first and ``after`` run
    once it is computed; returns its ``file.py:loss`` spec."""
    (folder / f"{name}.py").write_text(textwrap.dedent(f"""
        import os, sys, threading, time
        import torch
        import torch.nn.functional as F

        def loss(model, batch):
            {before or 'pass'}
            x, y = batch
            value = F.cross_entropy(model(x), y)
            {after or 'pass'}
            return value
    """))
    return f"{folder / name}.py:loss"


def top_eigenvalue(folder) -> float:
    return json.loads((folder / "hessian.json").read_text())["top_eigenvalues"][0]


def test_a_loss_that_changes_the_working_directory_writes_where_out_said(run, tmp_path, monkeypatch, fresh_notices):
    """A loss calling os.chdir(elsewhere) on every call, --out relative: hessian.json lands in the folder --out named
    from where flatfl started (and the printed path is it), nothing elsewhere; the directory is the starting one
    afterwards, and one notice says it was put back."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = loss_file(tmp_path, "moving_loss", before=f"os.chdir({str(elsewhere)!r})")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["hessian", str(run), *ANALYSIS, "--loss", spec, "--out", "h"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "h" / "hessian.json").is_file() and not (elsewhere / "h").exists()
    assert res.stdout.rstrip().endswith(f"-> {os.path.join('h', 'hessian.json')}")
    assert os.getcwd() == str(tmp_path)
    notices = [line for line in res.stderr.splitlines() if line.startswith("flatfl: notice:")]
    assert len(notices) == 1 and "changed the working directory" in notices[0], res.stderr


def test_a_loss_that_turns_gradients_off_measures_what_the_same_loss_does(run, tmp_path, fresh_notices):
    """torch.set_grad_enabled(False) once the loss is computed: the analysis ends as the same loss without it does
    (the same top eigenvalue), gradients are on again afterwards, and a notice says so."""
    plain = loss_file(tmp_path, "plain_loss")
    off = loss_file(tmp_path, "grad_off_loss", after="torch.set_grad_enabled(False)")
    a = CliRunner().invoke(main, ["hessian", str(run), *ANALYSIS, "--loss", plain, "--out", str(tmp_path / "a")])
    b = CliRunner().invoke(main, ["hessian", str(run), *ANALYSIS, "--loss", off, "--out", str(tmp_path / "b")])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert top_eigenvalue(tmp_path / "b") == top_eigenvalue(tmp_path / "a")
    assert torch.is_grad_enabled()
    assert "turned torch's gradients off (torch.set_grad_enabled)" in b.stderr


def test_closed_stdout_and_a_stray_thread_leave_the_result_line_and_the_exit(run, tmp_path):
    """A loss that closes sys.stdout and starts a thread (not a daemon) sleeping 120 s, as the command line runs
    it: the result line is still printed, two notices name what happened, and the process exits 0 long before the
    thread would end."""
    spec = loss_file(tmp_path, "rude_loss", before=(
        "sys.stdout.close(); threading.Thread(target=time.sleep, args=(120,), name='sleeper').start() "
        "if not any(t.name == 'sleeper' for t in threading.enumerate()) else None"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("FLATFL_DEBUG", None)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "flatfl", "hessian", str(run), *ANALYSIS, "--loss", spec,
                          "--out", str(tmp_path / "h")], env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0 and time.monotonic() - t0 < 100, res.stderr
    assert res.stdout.rstrip().endswith(f"-> {tmp_path / 'h' / 'hessian.json'}"), (res.stdout, res.stderr)
    notices = [line for line in res.stderr.splitlines() if line.startswith("flatfl: notice:")]
    assert any("closed sys.stdout; flatfl opened it again" in line for line in notices), res.stderr
    assert any("left 1 thread running (sleeper); flatfl ends without waiting for it" in line
               for line in notices), res.stderr
    assert "Traceback" not in res.stderr


SQUARE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    class Twice(torch.autograd.Function):   # 2 g x, whose own backward raises
        forward = staticmethod(lambda ctx, g, x: 2 * g * x)

        @staticmethod
        def backward(ctx, gg):
            raise TypeError("Twice has no second derivative")

    class Square(torch.autograd.Function):  # x * x, whose backward is Twice
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.square()

        backward = staticmethod(lambda ctx, g: Twice.apply(g, ctx.saved_tensors[0]))

    def loss(model, batch):
        return F.cross_entropy(Square.apply(model(batch[0])), batch[1])
""")


def test_a_backward_without_a_second_derivative_names_the_way_out(run, tmp_path):
    """A loss through a Function whose backward's backward raises TypeError: one line naming the backward, its file
    and line and --products finite-difference, exit 2, nothing written; with --products finite-difference (first
    derivatives only) the same loss is analysed."""
    (tmp_path / "square_loss.py").write_text(SQUARE)
    spec = f"{tmp_path / 'square_loss.py'}:loss"
    res = CliRunner().invoke(main, ["hessian", str(run), *ANALYSIS, "--loss", spec, "--out", str(tmp_path / "h")])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("flatfl: error: TypeError in your code, Twice.backward (") and \
        "square_loss.py:10): Twice has no second derivative" in lines[0], lines[0]
    assert "--products finite-difference" in lines[0] and "internal error" not in lines[0]
    assert not (tmp_path / "h").exists()
    res = CliRunner().invoke(main, ["hessian", str(run), *ANALYSIS, "--loss", spec, "--products",
                                    "finite-difference", "--out", str(tmp_path / "fd")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fd" / "hessian.json").is_file()


def test_a_block_left_open_and_collected_later_puts_nothing_back():
    """A block that began and never ended (a forward that never reached its end hook) and is closed only when the
    garbage collector finds it, commands later: the streams of its time must not replace the current ones."""
    import io
    import sys

    from flatfl.utils.user_code import user_code

    saved = sys.stdout
    try:
        sys.stdout = io.StringIO()  # an earlier command's stream
        block = user_code("the test's code")
        block.__enter__()
        later = sys.stdout = io.StringIO()  # a later command's
        del block  # the generator closed now, as the collector would
        assert sys.stdout is later
    finally:
        sys.stdout = saved
