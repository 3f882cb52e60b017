"""``flatfl hessian --curvature ggn | empirical-fisher`` on a tiny trained run against dense float64 matrices built
here from the checkpoint's model and the same evaluation samples; ``--products finite-difference`` for a loss through
a Function torch cannot differentiate twice; lambda_1 / lambda_5 and the settings in hessian.json."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from flatfl import load_checkpoint
from flatfl.cli import main
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SAMPLES = 48


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("curvatures") / "run")


def analyse(run, out, *flags):
    r = CliRunner().invoke(main, ["hessian", str(run), "--samples", str(SAMPLES), "--quiet", "--out", str(out),
                                  *flags])
    return r, (json.loads((out / "hessian.json").read_text()) if r.exit_code == 0 else None)


def model_and_data(run):
    """The checkpoint's model in float64 and its evaluation samples (the command's defaults: train split, seed 0)."""
    ckpt = load_checkpoint(run)
    batches = ckpt.eval_batches(split="train", samples=SAMPLES, batch_size=256, seed=0)
    x = torch.cat([b[0] for b in batches]).double()
    y = torch.cat([b[1] for b in batches])
    model = ckpt.model.double().eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    return model, params, x, y


def flat(tree) -> torch.Tensor:
    return torch.cat([t.reshape(t.shape[0], -1) for t in tree.values()], dim=1)


def dense(run, curvature) -> np.ndarray:
    model, params, x, y = model_and_data(run)
    if curvature == "ggn":
        J = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)  # (N, C, ...)
        J = torch.cat([t.reshape(len(y), t.shape[1], -1) for t in J.values()], dim=2)  # (N, C, dim)
        out = model(x).detach()
        total = 0
        for i in range(len(y)):
            H = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o[None], y[i:i + 1]), out[i])
            total = total + J[i].T @ H @ J[i]
        return (total / len(y)).numpy()
    per_sample = torch.func.jacrev(
        lambda p: F.cross_entropy(torch.func.functional_call(model, p, (x,)), y, reduction="none"))(params)
    G = flat(per_sample)  # (N, dim): each sample's own gradient
    return (G.T @ G / len(y)).numpy()


@pytest.mark.parametrize("curvature", ["ggn", "empirical-fisher"])
def test_top3_and_trace_are_the_dense_matrix(run, tmp_path, curvature):
    r, report = analyse(run, tmp_path / "h", "--curvature", curvature, "--top", "3")
    assert r.exit_code == 0, r.output
    assert report["settings"]["curvature"] == curvature and report["settings"]["products"] == "auto"
    name = {"ggn": "Gauss-Newton matrix", "empirical-fisher": "empirical Fisher"}[curvature]
    assert f"top eigenvalues of the {name}" in r.output
    true = np.linalg.eigvalsh(dense(run, curvature))[::-1]
    np.testing.assert_allclose(report["top_eigenvalues"], true[:3], rtol=1e-4)
    tr = report["trace"]
    assert abs(tr["estimate"] - true.sum()) <= 3 * tr["stderr"], (tr, true.sum())
    # the exact trace: the dense matrix's to rounding, within the bound it states, and no product spent on it
    r, report = analyse(run, tmp_path / "e", "--curvature", curvature, "--top", "1", "--trace-method", "exact")
    assert r.exit_code == 0, r.output
    tr = report["trace"]
    assert tr["method"] == "exact" and tr["hvps"] == 0 and "(exact, a bound on its rounding" in r.output
    assert report["precision"] == "float32"  # the checkpoint's: the bound is float32's worst case, well above 1e-7
    assert abs(tr["estimate"] - true.sum()) <= tr["stderr"] < 1e-3 * abs(true.sum()), (tr, true.sum())


def test_the_exact_trace_refuses_a_hessian_it_cannot_compute(run, tmp_path, monkeypatch):
    """The tiny network has a tanh between its layers: its Hessian's trace is not the Gauss-Newton matrix's, which
    the check finds; one line, nothing written."""
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    r, _ = analyse(run, tmp_path / "h", "--trace-method", "exact")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "needs a network linear in each layer's parameters" in r.output and "hutchpp" in r.output
    assert not (tmp_path / "h" / "hessian.json").exists()


def test_the_ratio_of_the_top_eigenvalues(run, tmp_path):
    r, report = analyse(run, tmp_path / "h", "--top", "5", "--no-trace")
    assert r.exit_code == 0, r.output
    values = report["top_eigenvalues"]
    assert report["eigenvalue_ratio"] == {"k": 5, "value": pytest.approx(values[0] / values[4], rel=1e-12)}
    assert f"lambda_1/lambda_5 = {values[0] / values[4]:.6g}" in r.output
    r, report = analyse(run, tmp_path / "h4", "--top", "4", "--no-trace")
    assert report["eigenvalue_ratio"] is None and "lambda_1/lambda_" not in r.output
    assert report["settings"]["curvature"] == "hessian"


LOSS = f"{Path(__file__).parent / 'no_double_backward.py'}:squared_logits"


def test_a_loss_without_second_derivative_and_finite_differences(run, tmp_path, monkeypatch):
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    r, _ = analyse(run, tmp_path / "h", "--loss", LOSS)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "no second derivative" in r.output and "--products finite-difference" in r.output
    assert "internal error" not in r.output and not (tmp_path / "h" / "hessian.json").exists()

    r, _ = analyse(run, tmp_path / "g", "--loss", LOSS, "--curvature", "ggn")  # an objective without its split
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "has no outputs and loss_of_outputs" in r.output
    r, report = analyse(run, tmp_path / "fd", "--loss", LOSS, "--products",
                        "finite-difference", "--no-trace", "--tol", "1e-6")
    assert r.exit_code == 0, r.output
    assert report["products"]["method"] == "finite-difference" and report["products"]["relative_error"] > 0
    assert "finite-difference products (stated relative error" in r.output
    # the dense finite-difference Hessian in float64: central differences of autograd gradients
    model, params, x, y = model_and_data(run)
    names, theta = list(params), torch.cat([p.reshape(-1) for p in params.values()])

    def gradient(vector):
        vector = vector.clone().requires_grad_(True)
        tree, i = {}, 0
        for n in names:
            tree[n] = vector[i:i + params[n].numel()].view(params[n].shape)
            i += params[n].numel()
        loss = F.cross_entropy(torch.func.functional_call(model, tree, (x,)) ** 2, y)
        return torch.autograd.grad(loss, vector)[0]

    h = 1e-5
    eye = torch.eye(len(theta), dtype=torch.float64)
    steps = torch.cat([theta + h * eye, theta - h * eye])  # row j: theta + h e_j, then theta - h e_j
    grads = torch.stack([gradient(s) for s in steps])
    H = ((grads[:len(theta)] - grads[len(theta):]) / (2 * h)).numpy()
    top = np.linalg.eigvalsh((H + H.T) / 2)[-1]
    assert abs(report["top_eigenvalues"][0] - top) <= 1e-3 * abs(top), (report["top_eigenvalues"][0], top)


def test_tracking_another_curvature(tmp_path):
    import csv

    from flatfl.analysis.commands.hessian_settings import tracking_settings

    run = train_tiny(tmp_path / "run", "--track-hessian", "1", "--track-curvature", "ggn", "--track-samples", "64")
    config = json.loads((run / "config.json").read_text())
    assert config["tracking"]["curvature"] == "ggn"
    with open(run / "metrics.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    s = tracking_settings()
    r = CliRunner().invoke(main, ["hessian", str(run), "--curvature", "ggn", "--samples", "64", "--batch-size",
                                  str(s.batch_size), "--tol", str(s.tol), "--trace-method", s.trace_method,
                                  "--trace-hvps", str(s.trace_hvps), "--trace-rtol", str(s.trace_rtol), "--quiet",
                                  "--out", str(tmp_path / "h")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "h" / "hessian.json").read_text())
    assert float(last["hessian_top"]) == report["top_eigenvalues"][0]
    assert float(last["hessian_trace"]) == report["trace"]["estimate"]
    # a Hessian tracking records what it always did (no curvature key)
    plain = train_tiny(tmp_path / "plain", "--track-hessian", "1", "--track-samples", "64")
    assert "curvature" not in json.loads((plain / "config.json").read_text())["tracking"]


def test_hessian_clients_of_another_curvature(tmp_path):
    from flatfl.analysis import GGNOperator, cross_client_metrics
    from flatfl.report.run_reader import clients_results

    run = train_tiny(tmp_path / "run", "--save-clients")
    args = ["hessian-clients", str(run), "--probes", "8", "--groups", "2", "--samples", "32", "--quiet"]
    r = CliRunner().invoke(main, [*args, "--curvature", "ggn"])
    assert r.exit_code == 0, r.output
    assert "of the Gauss-Newton matrix" in r.output
    result = json.loads((run / "hessian" / "clients-default-ggn.json").read_text())
    assert result["settings"]["curvature"] == "ggn"
    ckpt = load_checkpoint(run)
    expected = cross_client_metrics(
        [lambda k=k: GGNOperator(ckpt.model, ckpt.client_batches(k, batch_size=256, samples=32, seed=0))
         for k in range(2)], protocol="default", probes=8, groups=2, seed=0)
    assert result["H_N"] == expected.as_dict()["H_N"] and result["H_D"] == expected.as_dict()["H_D"]
    # the Hessian's own file stays as it is; a report uses the Hessian's results only
    assert not (run / "hessian" / "clients-default.json").exists()
    assert clients_results(run, {}) == {}
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    hessian_result = json.loads((run / "hessian" / "clients-default.json").read_text())
    assert "curvature" not in hessian_result["settings"] and hessian_result["H_N"] != result["H_N"]
    assert clients_results(run, {})["default"]["H_N"] == hessian_result["H_N"]
