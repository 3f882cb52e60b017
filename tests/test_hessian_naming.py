"""What ``flatfl hessian`` and the Python object say they measured: every figure axis, title, result line and
hessian.json names the curvature, the products and the precision; ``--which`` from the command line; an earlier
analysis with other settings in ``--out`` is kept; a ``--samples`` above what the split holds says what it used."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from flatfl import load_checkpoint
from flatfl.analysis import hessian
from flatfl.analysis.commands import result_figures
from flatfl.analysis.commands.hessian_command import run_hessian
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.analysis.estimators.density import spectral_density
from flatfl.analysis.estimators.eigen import top_eigenvalues
from flatfl.analysis.operators.hessian import HessianOperator
from flatfl.cli import main
from tiny_run import analyse_tiny, train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SAMPLES = 48


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("naming") / "run")


@pytest.fixture
def drawn(monkeypatch):
    """The figures the analysis code draws, kept (name by suffix order) instead of only saved as bytes."""
    figures = []

    def keep(fig, fmt):
        figures.append(fig)
        return b""

    monkeypatch.setattr(result_figures, "saved", keep)
    return figures


def texts(fig) -> list[str]:
    """Every axis label and title of ``fig`` (its suptitle too)."""
    out = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    for ax in fig.axes:
        out += [ax.get_xlabel(), ax.get_ylabel(), ax.get_title()]
    return out


def test_figures_name_the_curvature_products_and_order(drawn):
    A = torch.as_tensor(np.diag(np.linspace(-1.0, 3.0, 30)))
    dens = spectral_density(A, steps=10, starts=1)
    report = {"curvature": "ggn", "settings": {"split": "train", "curvature": "ggn"}, "num_samples": 48,
              "products": {"method": "jvp-vjp", "exact": True, "relative_error": None}, "precision": "float32",
              "top_eigenvalues": [-1.0, -0.86, -0.72], "residuals": [1e-9] * 3, "error_estimates": [1e-6] * 3,
              "converged": [True] * 3, "eigen": {"method": "lanczos", "which": "smallest", "tol": 1e-3},
              "density": dens.as_dict()}
    files = result_figures.hessian_figures(report, "tiny, round 1")
    assert sorted(files) == ["density.pdf", "density.png", "eigenvalues.pdf", "eigenvalues.png"]
    eigen_fig, density_fig = drawn[0], drawn[2]
    words = texts(eigen_fig)
    assert "GGN eigenvalue λ" in words and "eigenvalue index (smallest first)" in words
    assert any(w.startswith("(a) smallest 3 eigenvalues") for w in words)
    assert any("GGN, exact products (jvp-vjp), float32" in w.replace("\n", " ") for w in words)
    assert not any("Hessian" in w for w in words)
    words = texts(density_fig)
    assert "GGN eigenvalue λ" in words and not any("Hessian" in w for w in words)
    legend = [t.get_text() for t in density_fig.axes[0].get_legend().get_texts()]
    assert "smallest 3 eigenvalues" in legend


def test_save_density_names_the_curvature(drawn, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y), curvature="empirical-fisher")
    assert h.measured == "empirical Fisher, exact products (per-sample-gradients), float64"
    h.spectral_density(steps=8, starts=1)
    h.save_density(tmp_path / "d.png")
    words = texts(drawn[-1])
    assert "empirical Fisher eigenvalue λ" in words
    assert any("empirical Fisher, exact products (per-sample-gradients), float64" in w.replace("\n", " ")
               for w in words)


def test_the_result_lines_and_file_name_the_curvature(run, tmp_path):
    r, rep = analyse_tiny(run, tmp_path / "ggn", "--curvature", "ggn", "--top", "2", "--no-trace", "--samples",
                     str(SAMPLES))
    assert r.exit_code == 0, r.output
    assert rep["curvature"] == "ggn" and rep["measured"] == "GGN, exact products (jvp-vjp), float32"
    assert rep["products"] == {"method": "jvp-vjp", "exact": True, "relative_error": None}
    lines = r.output.splitlines()
    assert lines[0].startswith("top eigenvalues of the Gauss-Newton matrix (largest algebraic): ")
    assert lines[-1].startswith(f"GGN, exact products (jvp-vjp), float32: top eigenvalue "
                                f"{rep['top_eigenvalues'][0]:.6g} +- {rep['error_estimates'][0]:.2g} on 48 samples; ")
    # float32 products: no error estimate below their rounding, sqrt(dim) eps32 max|lambda|
    floor = np.sqrt(rep["num_params"]) * np.finfo(np.float32).eps * abs(rep["top_eigenvalues"][0])
    assert rep["eigen"]["rounding_floor"] >= floor * (1 - 1e-6)
    assert min(rep["error_estimates"]) >= rep["eigen"]["rounding_floor"] > 1e-6


def test_which_from_the_command_line(run, tmp_path):
    r, rep = analyse_tiny(run, tmp_path / "neg", "--which", "smallest", "--top", "5", "--no-trace", "--samples",
                     str(SAMPLES), "--tol", "1e-5")
    assert r.exit_code == 0, r.output
    assert rep["settings"]["which"] == "smallest" and rep["eigen"]["which"] == "smallest"
    assert r.output.splitlines()[0].startswith("smallest eigenvalues of the Hessian (smallest algebraic): ")
    assert " smallest eigenvalue " in r.output.splitlines()[-1]
    values = np.array(rep["top_eigenvalues"])
    assert values[0] < 0 and np.all(np.diff(values) >= 0)  # the most negative first
    assert rep["eigenvalue_ratio"] is None  # lambda_1 / lambda_5 is a ratio of the largest
    # the same eigenvalues as the Python estimator on the same model and samples, within their error estimates
    ckpt = load_checkpoint(run)
    op = HessianOperator(ckpt.model, ckpt.eval_batches(split="train", samples=SAMPLES, batch_size=256, seed=0))
    ours = top_eigenvalues(op, 5, which="smallest", tol=1e-7)
    assert np.all(np.abs(values - ours.eigenvalues) <= np.array(rep["error_estimates"]) + ours.error_bounds)


@pytest.mark.parametrize("flags, message", [
    (["--which", "lowest"], "choice of eigenvalues"),
    (["--which", "largest", "--method", "power"], "the power eigenvalue method finds the largest magnitude "
                                                  "eigenvalues only, not the largest algebraic"),
])
def test_a_bad_which_is_one_line_from_the_command_line(run, tmp_path, flags, message):
    r = CliRunner().invoke(main, ["hessian", str(run), "--quiet", "--out", str(tmp_path / "h"), *flags])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "h" / "hessian.json").exists()


def test_an_earlier_analysis_with_other_settings_is_kept(run, tmp_path):
    out = tmp_path / "h"
    first = ["--top", "2", "--no-trace", "--density", "--density-steps", "8", "--density-starts", "1",
             "--samples", str(SAMPLES)]
    r, rep = analyse_tiny(run, out, *first)
    assert r.exit_code == 0, r.output
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "density.png" in before
    r, _ = analyse_tiny(run, out, "--top", "1", "--no-trace", "--samples", str(SAMPLES))
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"flatfl: error: {out} holds an earlier analysis with other settings (--top 2 there, 1 here; " \
           f"--density true there, false here" in r.output
    assert f"choose another --out (e.g. --out {out.with_name('h-2')})" in r.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing replaced
    # the same settings again (another batch size does not change the numbers): replaced as a fresh start
    r, again = analyse_tiny(run, out, *first, "--batch-size", "16")
    assert r.exit_code == 0, r.output
    assert again["top_eigenvalues"] == pytest.approx(rep["top_eigenvalues"], rel=1e-5)
    # from Python, replace=True is the caller's choice to replace it
    report = run_hessian(str(run), str(out), HessianSettings(top=1, trace=False, samples=SAMPLES), quiet=True,
                         replace=True)
    assert report["settings"]["top"] == 1 and not (out / "density.png").exists()


def test_samples_above_the_split_say_what_was_used(run, tmp_path):
    r, rep = analyse_tiny(run, tmp_path / "all", "--samples", "5000", "--top", "1", "--no-trace", "--tol", "1e-2")
    assert r.exit_code == 0, r.output
    used = len(load_checkpoint(run).dataset().split("train")[1])
    assert rep["num_samples"] == used < 5000
    assert rep["samples"] == {"asked": 5000, "used": used, "split": "train",
                              "note": f"{used:,} of the 5,000 asked: the train split holds {used:,}, all of them "
                                      "were used"}
    assert f" on {used:,} of the 5,000 samples asked (the whole train split); " in r.output.splitlines()[-1]
    assert Path(tmp_path / "all" / "hessian.json").is_file()
