"""benchmarks/gpu_check.py, the one command of every GPU check: its ``--smoke --minimal`` run on the CPU (the same
code paths at toy sizes, one equivalence and one graph case) writes one table with a row per check and a header naming
the device and the versions, and exits 0; an ``--out`` it must not write into is refused in one line."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def table_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]


def test_smoke_run_writes_one_table_of_every_check(tmp_path):
    gc = gpu_check_module()
    out = tmp_path / "check"
    start = time.monotonic()
    # every part gets 3 times its --smoke timeout: the suite runs beside it on the same cores (pytest-xdist)
    limits = [f"--timeout={name}={3 * smoke}" for name, _, smoke, _ in gc.PARTS]
    budget = 3 * (sum(p[2] for p in gc.PARTS if p[3]) + max(p[2] for p in gc.PARTS if not p[3]))
    done = run("--smoke", "--minimal", *limits, "--budget", str(budget), "--out", str(out), timeout=budget + 60)
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    table = (out / gc.TABLE).read_text()
    assert done.stdout == table  # the table is printed
    header = table.splitlines()[0]
    assert "device cpu" in header and f"torch {torch.__version__}" in header and "flatfl " in header
    assert "smoke run, minimal" in header
    rows = table_rows(table)
    assert rows[0] == ["check", "figure", "goal", "met"]
    expected = [check for part in gc.DISPLAY for check, _ in gc.checks(part, smoke=True)]
    assert [r[0] for r in rows[1:]] == expected
    for check, figure, goal, met in rows[1:]:
        assert figure and goal, check
        assert met in ("yes", "no", "not measured"), (check, met)  # every part ran to its end
    for part in gc.DISPLAY:
        assert (out / f"{part}.log").read_text().strip(), part
    # a folder gpu_check made may be written again
    assert gc.refuse_out(out) is None
    print(f"gpu_check --smoke: {seconds:.0f} s")


def test_an_out_folder_not_made_by_gpu_check_is_refused_in_one_line(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    done = run("--smoke", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "not made by gpu_check" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]

    a_file = tmp_path / "mine.txt"
    done = run("--smoke", "--out", str(a_file), timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "is a file" in done.stderr
