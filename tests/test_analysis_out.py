"""Without ``--out`` the analysis commands write into a fixed folder of the run (flatfl/run_layout.py's layout), say
where, and never replace a file flatfl did not write."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from flatfl.cli.analysis_commands import default_out
from flatfl.cli import main
from flatfl.run_layout import CLIENTS_DIR, HESSIAN_DIR, SURFACE_DIR, analysis_dir
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("out") / "run", "--save-clients")


def test_hessian_without_out_writes_into_the_run(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    r = CliRunner().invoke(main, ["hessian", str(run), "--top", "3", "--samples", "128", "--trace-hvps", "20",
                                  "--quiet"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    target = run / HESSIAN_DIR / "hessian.json"
    report = json.loads(target.read_text())
    assert len(report["top_eigenvalues"]) == 3
    assert r.output.strip().splitlines()[-1].endswith(f"-> {target} (no --out: the run's analysis folder)")

    # a file of the user's in that folder is never replaced: one line, the file kept, nothing written
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    (other / HESSIAN_DIR).mkdir()
    (other / HESSIAN_DIR / "eigenvalues.csv").write_text("mine\n")
    r = CliRunner().invoke(main, ["hessian", str(other / "final.pt"), "--top", "3", "--samples", "128", "--quiet"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "eigenvalues.csv" in r.output, r.output
    assert (other / HESSIAN_DIR / "eigenvalues.csv").read_text() == "mine\n"
    assert not (other / HESSIAN_DIR / "hessian.json").exists()

    # hessian-clients beside it, surface in its own folder
    r = CliRunner().invoke(main, ["hessian-clients", str(run), "--probes", "10", "--groups", "5", "--samples", "32",
                                  "--quiet"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (run / CLIENTS_DIR / "clients-default.json").is_file() and "(no --out" in r.output
    r = CliRunner().invoke(main, ["surface", str(run), "--grid", "3", "--samples", "32", "--quiet"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (run / SURFACE_DIR / "surface.json").is_file() and "(no --out" in r.output


def test_the_folder_follows_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("final.pt", "final-clients-average.pt", "checkpoints/round_0003.pt"):
        (run / name).write_bytes(b"")
    assert default_out(run, "hessian") == run / HESSIAN_DIR
    assert default_out(run / "final.pt", "surface") == run / SURFACE_DIR
    assert default_out(run / "final-clients-average.pt", "hessian") == run / analysis_dir("hessian", "clients-average")
    assert default_out(run / "checkpoints" / "round_0003.pt", "hessian") == run / "hessian-round_0003"
    assert default_out(run, "hessian-clients") == run / CLIENTS_DIR


def test_not_a_run_is_one_line(tmp_path):
    r = CliRunner().invoke(main, ["hessian", str(tmp_path), "--quiet"])
    assert r.exit_code == 2 and "not a flatfl run" in r.output and len(r.output.strip().splitlines()) == 1
