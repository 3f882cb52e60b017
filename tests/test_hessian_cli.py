"""``flatfl hessian`` end to end on a real (tiny) run: outputs, determinism, PyHessian mode, bad input."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import scipy.sparse.linalg as spla
import torch
from click.testing import CliRunner

import flatfl
from flatfl.analysis import HessianOperator
from flatfl.analysis.commands.hessian_command import load_eigenvectors
from flatfl.cli import main
from tiny_run import train_tiny


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("hessian") / "run")


def hessian(*args):
    return CliRunner().invoke(main, ["hessian", *args], catch_exceptions=False)


def read_report(out):
    return json.loads((out / "hessian.json").read_text())


def test_hessian_writes_everything_and_matches_arpack(run_dir, tmp_path):
    out = tmp_path / "h"
    r = hessian(str(run_dir / "final.pt"), "--top", "5", "--density", "--density-steps", "20", "--samples", "256",
                "--trace-hvps", "30", "--save-eigenvectors", "--quiet", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "top eigenvalues of the Hessian (largest algebraic):" in r.output and "trace:" in r.output
    for name in ("hessian.json", "eigenvalues.csv", "eigenvalues.png", "eigenvalues.pdf", "density.png",
                 "density.pdf", "eigenvectors.pt"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rep = read_report(out)
    ckpt = flatfl.load_checkpoint(run_dir / "final.pt")
    assert rep["checkpoint"] == str(run_dir / "final.pt") and rep["round"] == ckpt.round == 1
    assert rep["num_params"] == ckpt.num_params and rep["num_samples"] == 256
    values = np.array(rep["top_eigenvalues"])
    assert len(values) == 5 and np.all(np.diff(values) <= 0) and len(rep["residuals"]) == 5
    assert set(rep["trace"]) >= {"estimate", "stderr", "hvps"} and rep["trace"]["hvps"] == 30
    assert len(rep["density"]["nodes"][0]) == 20 and np.isclose(sum(rep["density"]["weights"][0]), 1.0)
    assert rep["hvps_total"] == rep["eigen"]["hvps"] + rep["trace"]["hvps"] + rep["density"]["hvps"]
    assert rep["seconds"] > 0 and rep["settings"]["samples"] == 256 and rep["settings"]["seed"] == 0
    rows = list(csv.DictReader(open(out / "eigenvalues.csv")))
    assert [float(row["eigenvalue"]) for row in rows] == rep["top_eigenvalues"]

    # independent reference: ARPACK (scipy eigsh) on the same 256 samples, in float64
    model = ckpt.model.double()
    batches = [(x.double(), y) for x, y in ckpt.eval_batches("train", samples=256, seed=0)]
    op = HessianOperator(model, batches)
    lin = spla.LinearOperator((op.dim, op.dim), dtype=np.float64,
                              matvec=lambda v: op.matvec(torch.from_numpy(np.ascontiguousarray(v).ravel())).numpy())
    reference = np.sort(spla.eigsh(lin, k=5, which="LA", tol=1e-10, v0=np.ones(op.dim))[0])[::-1]
    assert np.allclose(values, reference, rtol=1e-3)

    saved = load_eigenvectors(out / "eigenvectors.pt")
    assert saved.vectors.shape == (5, op.dim) and saved.vectors.dtype == torch.float32
    assert list(saved.as_parameters(0)) == [n for n, _ in model.named_parameters()]
    v = saved.vectors[0].double()
    assert torch.linalg.norm(op.matvec(v) - values[0] * v) <= 1e-3 * values[0]


def test_defaults_same_seed_same_numbers_and_power_mode(run_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):  # no flags: the top eigenvalue and the trace
        r = hessian(str(run_dir), "--samples", "128", "--trace-hvps", "20", "--quiet", "--out", str(out))
        assert r.exit_code == 0, r.output
    ra, rb = read_report(a), read_report(b)
    assert len(ra["top_eigenvalues"]) == 1 and ra["trace"] is not None and ra["density"] is None
    assert not (a / "eigenvalues.png").exists() and (a / "eigenvalues.csv").is_file()
    for key in ("top_eigenvalues", "residuals", "trace", "hvps_total"):
        assert ra[key] == rb[key], key

    p = tmp_path / "p"
    r = hessian(str(run_dir), "--samples", "128", "--method", "power", "--top", "2", "--trace-hvps", "20", "--quiet",
                "--out", str(p))
    assert r.exit_code == 0, r.output
    rp = read_report(p)
    assert rp["eigen"]["method"] == "power" and rp["trace"]["method"] == "pyhessian"
    assert rp["top_eigenvalues"][0] >= rp["top_eigenvalues"][1]
    # PyHessian's rule stops at a 1e-3 relative change; the answer is near Lanczos's converged value
    assert rp["top_eigenvalues"][0] == pytest.approx(ra["top_eigenvalues"][0], rel=0.05)


@pytest.mark.parametrize("args,message", [
    (["--top", "100000"], "larger than the number of parameters"),
    (["--samples", "0"], "samples"),
    (["--method", "arnoldi"], "unknown eigenvalue method"),
    (["--trace-method", "diagonal"], "unknown trace method"),
    (["--split", "validation"], "unknown split"),
])
def test_bad_options_fail_with_one_line_and_no_output(run_dir, tmp_path, args, message):
    out = tmp_path / "out"
    r = hessian(str(run_dir / "final.pt"), *args, "--quiet", "--out", str(out))
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flatfl: error:") and message in lines[0]
    assert not out.exists()


def test_not_a_checkpoint_and_missing_cuda(tmp_path, run_dir):
    bogus = tmp_path / "notes.pt"
    bogus.write_text("not a checkpoint")
    out = tmp_path / "out"
    r = hessian(str(bogus), "--out", str(out))
    assert r.exit_code == 2 and "not a readable flatfl checkpoint" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not out.exists()
    if not torch.cuda.is_available():
        r = hessian(str(run_dir), "--device", "cuda", "--out", str(out))
        assert r.exit_code == 2 and "CUDA is not available" in r.stderr
        assert not out.exists()
